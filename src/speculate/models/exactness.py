"""The load-time self-check: does a batched forward give every row the bits it gets alone, on this machine?

Why: exact greedy speculative decoding at int8, q4 and fp32 rests on it, and it is a property of the running CPU's
kernels as much as of our formulation (models/exact_attention.py makes the sums exact; the int8 matmul's
integer products and the row-local norms and element-wise functions are row-independent by their
algorithm, but a kernel library may still choose otherwise on a CPU we never saw). So it is checked,
not assumed: a few random tokens through the loaded model's real kernels — a prefill, a chain and a
small tree in one forward each, against the same tokens one at a time (plain decoding's calls). Where
any bit differs, the model runs its rows one at a time from then on — exact, slower — and says so once.

What the check found is :func:`mode`'s answer: ``"batched"`` (checked here, rows verified together),
``"row-by-row"`` (the check failed: the exact fallback), or ``"none"`` (no exactness claimed: bf16 models, fp32
models on PyTorch's matmuls — where the kernel does not build — and models outside the lean path). Stats, the server's ``speculative_stats`` and ``/metrics``
report it.
"""

from __future__ import annotations

import logging
import warnings

import torch

from ..errors import SpeculateWarning

log = logging.getLogger(__name__)

PREFIX, CHAIN = 5, 4
TREE = [-1, 0, -1, 2]  # two branches of two nodes


def check(kv) -> bool:
    """True when ``kv``'s batched rows equal its one-row forwards bit for bit (checked once per loaded model;
    about 13 one-token forwards). Leaves ``kv`` empty."""
    found = kv.loaded.shared.get("rows agree")
    if found is None:
        found = kv.loaded.shared["rows agree"] = rows_agree(kv)
        if not found:
            warnings.warn(f"{kv.loaded.name}: on this CPU a batched forward does not give every row the bits it "
                          "gets alone; verifying rows one at a time instead (exact, slower)", SpeculateWarning,
                          stacklevel=3)
    return found


@torch.inference_mode()
def rows_agree(kv) -> bool:
    """The comparison itself: logits and hidden rows of batched forwards against one-row forwards."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, kv.vocab_size, (PREFIX + CHAIN + len(TREE),), generator=generator)
    chain, tree = ids[PREFIX: PREFIX + CHAIN], ids[PREFIX + CHAIN:]
    row_by_row, kv.row_by_row = kv.row_by_row, False  # the batched path is what is checked

    def run(tokens, parents=None):
        return kv.forward(tokens, tree_parents=parents), kv.hidden.clone()

    try:
        kv.reset(64)
        batched = [run(ids[:PREFIX]), run(chain)]
        kv.keep(PREFIX)
        batched.append(run(tree, TREE))
        kv.reset(64)
        alone = [run(ids[i: i + 1]) for i in range(PREFIX + CHAIN)]
        same = all(torch.equal(a, torch.cat([r[j] for r in alone[lo:hi]]))
                   for (lo, hi), got in zip([(0, PREFIX), (PREFIX, PREFIX + CHAIN)], batched) for j, a in enumerate(got))
        for path in ([0, 1], [2, 3]):
            kv.keep(PREFIX)
            rows = [run(tree[[t]]) for t in path]
            same = same and all(torch.equal(batched[2][j][path], torch.cat([r[j] for r in rows])) for j in range(2))
    finally:
        kv.row_by_row = row_by_row
        kv.reset(0)
    log.debug("%s: batched rows %s one-row forwards", kv.loaded.name, "equal" if same else "differ from")
    return same


def mode(kv) -> str:
    """How a KV model's verified rows are exact: "batched", "row-by-row" or "none" (module docstring)."""
    if not getattr(kv, "invariant", False):
        return "none"
    return "row-by-row" if kv.row_by_row else "batched"
