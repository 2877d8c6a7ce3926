"""Self-drafting heads trained on the target's own hidden states: Medusa heads and an EAGLE head.

``speculate train-heads`` (command.py) builds the self-distillation data (data.py), trains (train.py)
and saves (io.py); the drafters in ``speculate.drafters.medusa`` / ``.eagle`` load them.
"""

from .eagle import EagleHead
from .io import load_heads, save_heads, shipped_folder
from .medusa import MedusaHeads

__all__ = ["EagleHead", "MedusaHeads", "load_heads", "save_heads", "shipped_folder"]
