"""``speculate calc``: the speedup arithmetic on the command line (:mod:`.command`), and the speedup model held
against a ``speculate bench`` run (:mod:`.results`). The model itself is the engine's policy (speculate/policy/).
"""
