"""The verifier interface: a pure function of tensors plus a small state.

A verifier never sees a model. Each round the engine hands it

- ``draft_tokens``  LongTensor [k]     the drafted tokens x_1..x_k
- ``draft_probs``   FloatTensor [k, V] p_draft rows, row i is the distribution x_{i+1} was drawn from
- ``target_probs``  FloatTensor [k+1, V] p_target rows from one target forward; row k is the bonus
  position (the distribution after all k drafts)
- ``state``         whatever the previous round returned (None at the start of a generation)
- ``generator``     a seeded ``torch.Generator`` for every random draw, so seeded runs reproduce

and gets back a :class:`Verdict`: which drafts to keep (``path``; ``n_accepted`` = its length), the
one token the target adds after them (``next_token``), and the state for the next round.

A tree draft (``parents``, see ``tree_shape``) goes to :meth:`Verifier.verify_tree`, the rule's tree
form, which each verifier defines (or inherits) on its class; the engine calls one method for both,
:meth:`Verifier.judge`. Parameters are declared once, in ``params`` (``speculate/params.py``).

Naming: the lesson writes the target distribution q and the draft p, the Consultant Decoding paper the
reverse. Here it is always ``target_probs`` / ``draft_probs`` (p_target / p_draft in docstrings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import SpeculateError
from ..params import Param
from ..sampling import argmax


@dataclass(frozen=True, init=False)
class Verdict:
    """The verdict on one draft, chain or tree: ``path``, the accepted draft indices from the root down
    (a chain's first n: ``[0, ..., n-1]``; ``[]`` when nothing was accepted), ``next_token``, the token
    the target adds after them, and ``state``, for the next round.

    ``Verdict(n_accepted, next_token, state)`` builds a chain's; ``Verdict(path=[...], next_token=...,
    state=...)`` a tree's."""

    path: list[int] = field(default_factory=list)
    next_token: int = 0
    state: Any = None

    def __init__(self, n_accepted: int | None = None, next_token: int = 0, state: Any = None, *,
                 path: list[int] | None = None):
        if path is None:
            path = range(n_accepted or 0)
        elif n_accepted is not None and n_accepted != len(path):
            raise ValueError(f"Verdict: n_accepted = {n_accepted} but the path has {len(path)} nodes")
        object.__setattr__(self, "path", [int(i) for i in path])
        object.__setattr__(self, "next_token", next_token)
        object.__setattr__(self, "state", state)

    @property
    def n_accepted(self) -> int:
        return len(self.path)


class Verifier:
    """Base class. Subclasses implement :meth:`verify` (the chain rule) and, where the rule has one,
    :meth:`verify_tree` (its tree form; a subclass inherits its parent's).

    Class attributes the engine reads (never model access, only what to hand over):

    - ``params``: the parameters (:class:`~speculate.params.Param`), declared once; the
      constructor takes them by name (or in this order), checks them and sets them as attributes.
    - ``needs_draft_probs``: False when the rule ignores p_draft (greedy, consultant, typical), so a
      drafter with one-hot drafts need not materialise [k, V] rows.
    - ``raw_target``: True when the rule must see the *unwarped* (temperature 1) target distribution
      as ``target_probs`` (consultant's NLL, typical's entropy); the warped one used for sampling the
      correction token is then passed as ``sample_probs``.
    - ``lossless``: True when the output follows the target exactly (greedy at temperature 0, sample).
    - ``argmax_only``: True when, at temperature 0, the rule reads nothing of ``target_probs`` but each row's argmax
      (greedy): the target's LM head may then compute only the logits that can be a row's greatest
      (models/fast.py, ``LeanModel._head``), and the engine hands it the raw logits as ``target_probs``, unwarped
      (the same argmax as greedy's one-hot rows; engine.py, ``_verify``).
    """

    name = "base"
    params: ClassVar[tuple[Param, ...]] = ()
    needs_draft_probs = True
    raw_target = False
    lossless = False
    argmax_only = False

    def __init__(self, *args, **kwargs):
        cls = type(self)
        if len(args) > len(cls.params):
            raise TypeError(f"{cls.__name__} takes at most {len(cls.params)} positional parameters")
        given = dict(zip((p.name for p in cls.params), args))
        for key, value in kwargs.items():
            if key in given:
                raise TypeError(f"{cls.__name__}: {key} given twice")
            given[key] = value
        unknown = sorted(set(given) - {p.name for p in cls.params})
        if unknown:
            raise TypeError(f"{cls.__name__} does not take {', '.join(unknown)}")
        for p in cls.params:
            value = p.check(self.name, given.get(p.name, p.default))
            if value == "auto":
                raise ValueError(f"{self.name}: {p.name} 'auto' ({p.auto}) is resolved by the engine "
                                 "(SpeculativeDecoder), not by the verifier")
            setattr(self, p.name, value)

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{p.name}={getattr(self, p.name)!r}' for p in self.params)})"

    def verify(
        self,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        state: Any = None,
        generator: torch.Generator | None = None,
        sample_probs: torch.Tensor | None = None,
    ) -> Verdict:
        raise NotImplementedError

    def verify_tree(
        self,
        tokens: torch.Tensor,
        parents,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        state: Any = None,
        generator: torch.Generator | None = None,
        sample_probs: torch.Tensor | None = None,
        *,
        replacement: bool = False,
    ) -> Verdict:
        """The rule over a draft tree (``verifiers/tree.py`` for the layout): ``target_probs`` [N+1, V]
        (row 0 after the root, row i+1 after node i), ``draft_probs`` [N, V] or None, the rest as in
        :meth:`verify`; ``replacement``: how siblings were drawn (``tree.tree_sample``). On a chain-shaped
        tree it gives :meth:`verify`'s verdict. This base has none: a verifier without a tree form
        leaves it, and :meth:`has_tree_rule` is then False."""
        raise SpeculateError(f"verifier '{self.name}' has no tree rule")

    @classmethod
    def has_tree_rule(cls) -> bool:
        return cls.verify_tree is not Verifier.verify_tree

    def judge(
        self,
        tokens: torch.Tensor,
        parents,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        state: Any = None,
        generator: torch.Generator | None = None,
        sample_probs: torch.Tensor | None = None,
        *,
        replacement: bool = False,
    ) -> Verdict:
        """The engine's one call: the chain rule when ``parents`` is None, else the tree form."""
        if parents is None:
            return self.verify(tokens, draft_probs, target_probs, state, generator, sample_probs)
        return self.verify_tree(tokens, parents, draft_probs, target_probs, state, generator, sample_probs,
                                replacement=replacement)


def uniform(n: int, generator: torch.Generator | None, dtype=torch.float32) -> torch.Tensor:
    """n draws of U[0, 1) from the shared generator (CPU, so seeded runs reproduce anywhere)."""
    return torch.rand(n, generator=generator, dtype=dtype)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D, possibly unnormalised, non-negative row, by inverse CDF.

    Consumes the shared generator through :func:`uniform` (one draw). A float64 cumulative sum and one
    binary search: ``torch.multinomial``
    costs ~4 ms for one draw at V = 152k on CPU, this ~0.2 ms. The token is the first i with
    cumsum[i] > u * total (u in [0, 1)), so zero-probability tokens are never returned. Works for rows
    on any device (the uniform comes from the CPU generator as a Python float)."""
    cdf = probs.detach().to(torch.float64).cumsum(0)
    total = float(cdf[-1])
    if not 0.0 < total < math.inf:
        raise ValueError(f"cannot sample from a row with total mass {total}")
    v = float(uniform(1, generator, dtype=torch.float64)) * total
    i = int(torch.searchsorted(cdf, v, right=True))
    if i >= cdf.shape[0]:  # u * total rounded up to total: take the last token with mass
        i = int((probs > 0).nonzero()[-1, 0])
    return i


def target_token(target_probs: torch.Tensor, sample_probs: torch.Tensor | None, row: int, greedy: bool,
                 generator: torch.Generator | None) -> int:
    """The token the target itself contributes at ``row``, for the likelihood-judging verifiers
    (consultant, typical): its argmax when greedy, else a draw from the warped row (``sample_probs``),
    or from the raw row when no warped one was given."""
    if greedy:
        return int(argmax(target_probs[row]))
    return sample_from((sample_probs if sample_probs is not None else target_probs)[row], generator)
