"""What one forward over several generations' caches takes: each generation's :class:`Rows`.

Its own module so that both KV paths (kv.py's Hugging Face one, fast.py's lean one) can take it without importing
each other: kv.py picks the path (``KVModel``), fast.py implements one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rows:
    """One generation's part of a forward: new ``tokens`` [n] for the cache of ``kv`` (at its next positions; a tree
    by ``tree_parents``, as :meth:`HFKVModel.forward` takes them), and the logits wanted: the last ``want`` rows
    (None: all of them; 0: none, a prefill chunk). ``argmax``: only each row's argmax is read (greedy verification),
    so the LM head may leave every logit that cannot be the row's greatest at -inf (fast.py, ``LeanModel._head``)."""

    kv: object
    tokens: torch.Tensor
    tree_parents: list[int] | None = None
    want: int | None = None
    argmax: bool = False
