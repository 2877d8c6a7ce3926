"""A self-drafting drafter with prompt lookup merged into its draft tree (``eagle+lookup``, ...).

The two drafters are right about different tokens: heads predict fluent continuations, lookup copies
spans of the context (numbers and names from a GSM8K question, the lines of a text being rewritten),
which the heads, trained on a 135M model's answers, often get wrong. So each round the base drafter's
proposal (a chain or a tree) and lookup's chain are merged into one token tree, as SpecInfer merges
the trees of several draft models (Miao et al. 2024, "merge-based token tree construction"): lookup's
tokens follow the base's nodes while they agree, and branch off as new nodes where they do not. One
target forward verifies the union; a lookup chain the base already proposed adds no node at all.

Sampling stays lossless: lookup's chain then goes in as a branch of its own beside the base's drawn
chain, never merged into an equal drawn node (that would drop a candidate because of its token), each
lookup node with a one-hot p_draft row, and the tree is verified with ``replacement=True``: every sibling
against the row it was drawn from (``verifiers/tree.py``, ``tree_sample``: SpecInfer's multi-step
speculative sampling over several drafters' proposals). A base tree drawn without replacement keeps its
own rule, so its proposal then goes out alone. The other tree rules (greedy, consultant, typical) judge
each node by the target's distribution alone.

The base must keep no per-proposal state that :meth:`Drafter.update` rolls back (the heads' drafters
read everything they need from the committed tokens and :meth:`Drafter.observe`): an accepted path may
leave the base's nodes for lookup's, and the base would not know how to follow.
"""

from __future__ import annotations

import torch

from ..errors import SpeculateError
from ..params import Param
from ..sampling import one_hot
from .base import Composite, Draft, Drafter, Variant
from .lookup import LookupDrafter

# The variant of a drafter that declares it (medusa.py, eagle.py): its proposals with lookup's merged in.
LOOKUP = Variant("lookup", False, "merge prompt lookup's copy into each draft, as one tree", suffix="+lookup")


def base_k(default: int | None) -> Param:
    """The +lookup variant's option: how deep the base drafts beside lookup (``default`` None: each round's k)."""
    return Param("base_k", default, "how deep the drafter drafts beside lookup, whose copies reach k",
                 value_type=int)


def merged(make, lookup: bool, name: str, options: dict) -> Drafter:
    """``make(**options)``, with lookup merged in (as ``name``, to the depth ``options["base_k"]``) where ``lookup``."""
    if not lookup:
        return make(**options)
    depth = options.pop("base_k")
    return WithLookup(make(**options), depth, name=name)


class WithLookup(Composite):
    parts = ("base", "lookup")  # (Composite)
    tree = True  # the merged proposal is a tree whenever lookup adds a branch

    def __init__(self, base: Drafter, base_k: int | None = None, lookup: LookupDrafter | None = None,
                 name: str | None = None):
        """``base_k``: the base drafts at most this deep (None: each round's k), while lookup's chain
        may reach k: a long copy costs lookup nothing to draft, a deep head draft costs a head step per
        level and is rarely right that far."""
        if type(base).update is not Drafter.update:
            raise SpeculateError(f"drafter '{base.name}' rolls back its own state after each round; it cannot "
                                 "be merged with lookup")
        if base_k is not None and base_k < 1:
            raise SpeculateError("base_k must be >= 1")
        # Lookup's chain stays at most k long (max_copy 0): max_nodes counts k nodes for it.
        self.base, self.base_k, self.lookup = base, base_k, lookup or LookupDrafter(max_copy=0)
        self.name = name or f"{base.name}+lookup"
        self.wants_hidden, self.feature_layers = base.wants_hidden, base.feature_layers
        self.observes_prompt = base.observes_prompt

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.base.begin(prompt_ids, sampling, generator)
        self.lookup.begin(prompt_ids, sampling, generator)

    def observe(self, hidden: torch.Tensor) -> None:
        self.base.observe(hidden)

    def relative_cost(self):
        return self.base.relative_cost()  # lookup drafts for free

    def cache_bytes(self) -> int:
        return self.base.cache_bytes()

    def _base_k(self, k: int) -> int:
        return k if self.base_k is None else min(k, self.base_k)

    def max_nodes(self, k):
        return self.base.max_nodes(self._base_k(k)) + k

    def propose(self, tokens, k):
        draft = self.base.propose(tokens, self._base_k(k))
        copied = self.lookup.propose(tokens, k).tokens.tolist()
        if not copied:
            return draft
        return merge(draft, copied) if self.sampling.greedy else beside(draft, copied)


def merge(draft: Draft, chain: list[int]) -> Draft:
    """``draft`` (a chain or a tree, greedy: no p_draft rows) with ``chain`` merged in from the root:
    the chain follows existing nodes while their tokens agree and continues as new nodes (appended, so
    the draft's own nodes keep their indices and the order stays topological)."""
    tokens, parents = draft.tokens.tolist(), draft.tree_parents()
    child = {(parent, token): node for node, (token, parent) in enumerate(zip(tokens, parents))}
    at = -1  # the node the chain has reached (-1: the root, the last committed token)
    for token in chain:
        if (at, token) not in child:
            child[at, token] = len(tokens)
            tokens.append(token)
            parents.append(at)
        at = child[at, token]
    if len(tokens) == len(draft):
        return draft  # the base had proposed the whole chain already
    return Draft(torch.tensor(tokens, dtype=torch.long), None, parents)


def beside(draft: Draft, chain: list[int]) -> Draft:
    """Sampling: ``chain`` as a branch of its own from the root, after ``draft``'s nodes (drawn, with
    their p_draft rows), with one-hot rows, to be verified with ``replacement=True`` (each sibling
    against its own row; a draft without rows stays without: the engine reads that as one-hot). A tree
    drawn without replacement has its own rule: returned alone."""
    if not len(draft):
        return Draft(torch.tensor(chain, dtype=torch.long))  # lookup alone: a chain, one-hot
    if draft.parents is not None and not draft.replacement:
        return draft
    first = len(draft)
    parents = draft.tree_parents() + [-1] + list(range(first, first + len(chain) - 1))
    tokens = torch.cat([draft.tokens, torch.tensor(chain, dtype=torch.long)])
    probs = None if draft.probs is None else \
        torch.cat([draft.probs, one_hot(tokens[first:], draft.probs.shape[1]).to(draft.probs.dtype)])
    return Draft(tokens, probs, parents, replacement=True)
