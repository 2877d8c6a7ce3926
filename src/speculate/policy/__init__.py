"""The engine's policies: how much to draft, decided from measurements of this machine, below the engine.

- :mod:`.speedup`  the lesson's model done right: α, the residual, E(α, k), the exact speedup on a cost curve, the
  lesson's approximation, and the best k (pure Python)
- :mod:`.profile`  T(n)/T(1) and the draft cost ratio c measured on this machine; JSON save/load
- :mod:`.scaling`  Consultant Decoding's eq. 9 (Chinchilla) estimate of ε
- :mod:`.auto`  ``--k auto`` (k each round from the cost curve and the running α) and ``--eps auto``
- :mod:`.batch`  k by batch size: each round's draft lengths for a batch's throughput
- :mod:`.gate`  the measured gate over that plan: rounds drafted against rounds plain, the faster one run
- :mod:`.draft_length`  k's parsing and its fixed policy

``recommend_k(load_profile(path), alpha, c)`` picks k from a saved profile, with c = 0 for prompt lookup or
``profile.c`` for the draft model the profile was measured with. ``speculate calc`` (speculate/calc/) is their
command line.
"""

from .profile import Profile, load_profile, measure_profile, save_profile
from .scaling import chinchilla_loss, chinchilla_terms
from .speedup import (acceptance_rate, best_k, check_distribution, expected_tokens, lesson_speedup, recommend_k,
                      residual_distribution, speedup, verify_cost)

__all__ = ["Profile", "acceptance_rate", "best_k", "check_distribution", "chinchilla_loss", "chinchilla_terms",
           "expected_tokens", "lesson_speedup", "load_profile", "measure_profile", "recommend_k",
           "residual_distribution", "save_profile", "speedup", "verify_cost"]
