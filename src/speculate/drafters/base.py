"""The drafter interface, and what a drafter declares of itself.

A drafter proposes drafts that continue the committed sequence, with the distributions they were
drawn from, and learns the verifier's verdict through :meth:`update` (so it can roll back its own
state). The engine never special-cases a drafter.

A draft is a *chain* (``parents`` None: x_1..x_m, each continuing the one before) or a *tree*
(``parents`` a list): nodes in topological order, ``parents[i]`` = -1 for a child of the last
committed token, else the index of node i's parent. A tree is verified in one target forward
(the engine's ``tree_parents`` mask) and the verdict names the accepted root-to-node ``path``.

A drafter is one module: its class declares its name, its options (``params``), what it needs (``needs``), its
variants and a line of help, and the registry (``drafters/__init__.py``) finds it there and builds it through
:meth:`Drafter.build`, the one constructor shape it calls.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..params import Param
from ..sampling import SamplingParams
from ..tree_shape import chain_as_tree, depths

# What a drafter may need besides its options (``Drafter.needs``); each is the phrase its error text uses.
DRAFT_MODEL = "a draft model"  # a LoadedModel sharing the target's tokenizer (--draft-model)
TARGET = "the target model"  # the target itself: its weights, hidden rows or the assets shipped for it


@dataclass
class Draft:
    tokens: torch.Tensor  # LongTensor [m], m <= k chain tokens or m tree nodes (m = 0: nothing this round)
    probs: torch.Tensor | None = None  # p_draft rows [m, V], row i the distribution token i was drawn
    #                                    from (tree siblings share their parent's row); None: one-hot
    parents: list[int] | None = None  # None: a chain; else each node's parent (-1: the last committed token)
    replacement: bool = False  # tree only: siblings drawn i.i.d. WITH replacement (else without); the
    #                            lossless sampling rule differs (verifiers/tree.py, tree_sample)
    from_k: bool = True  # False: its length was not the round's k (model+lookup's copies), so --k auto,
    #                      which sizes the draft model's rounds, learns no acceptance rate from it

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def node_depths(self) -> list[int]:
        """Depth of each token, 1 for a child of the last committed token (a chain: 1..m)."""
        return depths(self.tree_parents())

    def tree_parents(self) -> list[int]:
        """``parents`` as a tree's (a chain x_1..x_m is the tree -1 → 0 → ... → m-2); a copy."""
        return chain_as_tree(len(self)) if self.parents is None else list(self.parents)

    @property
    def depth(self) -> int:
        """The longest path: how many draft tokens one round can accept."""
        return len(self) if self.parents is None else max(self.node_depths(), default=0)

    def within(self, max_depth: int) -> Draft:
        """This draft without the tokens deeper than ``max_depth`` (self when none is). Nodes are
        topologically ordered and a child is deeper than its parent, so what stays is still a tree."""
        if self.depth <= max_depth:
            return self
        if self.parents is None:  # a chain: its first max_depth tokens
            return replace(self, tokens=self.tokens[:max_depth],
                           probs=None if self.probs is None else self.probs[:max_depth])
        keep = [i for i, d in enumerate(self.node_depths()) if d <= max_depth]
        index = torch.tensor(keep, dtype=torch.long)
        probs = None if self.probs is None else self.probs[index]
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [-1 if self.parents[i] < 0 else new_index[self.parents[i]] for i in keep]
        return replace(self, tokens=self.tokens[index], probs=probs, parents=parents)


@dataclass(frozen=True)
class Variant(Param):
    """A true/false option that names a variant of its drafter: ``suffix`` joins the name where the option is not
    its default (``eagle`` with tree=false is ``eagle-chain``, with lookup=true ``eagle+lookup``)."""

    suffix: str = ""


class Drafter:
    # -- the declaration: what the registry (drafters/__init__.py) reads, without building one -----------------
    name = "base"  # the name --drafter, a request and a bench method take
    summary = ""  # one line for --drafter's help: what it drafts from
    rank = 100  # where it is listed among the choices (help, error texts): the plainest first, then by name
    params: ClassVar[tuple[Param, ...]] = ()  # its options (--drafter-opt KEY=VALUE): the registry fills in defaults
    needs: ClassVar[tuple[str, ...]] = ()  # DRAFT_MODEL and/or TARGET: checked before build() is called
    variants: ClassVar[tuple[Variant, ...]] = ()  # each combination is a name of its own (variant_name)

    @classmethod
    def variant_name(cls, **values) -> str:
        """The name of the variant with these ``values`` of :attr:`variants` (the defaults for any not given)."""
        return cls.name + "".join(v.suffix for v in cls.variants if values.get(v.name, v.default) != v.default)

    @classmethod
    def variant_values(cls) -> list[dict]:
        """Every combination of the variants' values, the defaults first: ``[{}]`` for a drafter without variants."""
        choices = [(v.default, not v.default) for v in cls.variants]
        return [dict(zip((v.name for v in cls.variants), values)) for values in itertools.product(*choices)]

    @classmethod
    def options(cls, **variant) -> tuple[Param, ...]:
        """The options of one variant (``variant``: a value for each of :attr:`variants`); all of ``params`` unless a
        variant takes others (a chain has no tree shape to set)."""
        return cls.params

    @classmethod
    def build(cls, target=None, draft_model=None, **options) -> Drafter:
        """The registry's one way to make this drafter: ``target`` and ``draft_model`` as the caller has them (what
        :attr:`needs` names is there), ``options`` every declared option of the variant (given or default) and the
        variant's values. This one passes what ``needs`` names, the draft model first — ``cls(draft_model, target,
        **options)``, ``cls(target, **options)`` or ``cls(**options)``; a drafter whose constructor wants something
        else overrides it."""
        if DRAFT_MODEL in cls.needs:
            return cls(draft_model, target, **options)
        return cls(target, **options) if TARGET in cls.needs else cls(**options)

    # -- the drafter at work ---------------------------------------------------------------------------------
    tree = False  # True: proposals may be trees (Draft.parents); the verifier must have a tree rule
    wants_hidden = False  # True: the engine hands over the target's hidden states through observe()
    feature_layers: tuple[int, ...] = ()  # decoder layers whose outputs observe() also wants (EAGLE-3)
    # With wants_hidden: True where observe() reads every prompt row (EAGLE's head feeds each position), False where
    # it reads the last only (Medusa's heads): what a prompt taken from the prefix store must come with.
    observes_prompt = True

    def fork(self) -> Drafter:
        """This drafter for another generation (the engine forks one per run, engine.SpeculativeDecoder.new_drafter):
        what it was built with — weights, a draft model, an index it learns — shared, its per-generation state its
        own. :meth:`begin` sets that state, so a copy of the attributes will do; a drafter that builds such state in
        its constructor (a draft model's KV cache) or holds other drafters forks them too."""
        return copy.copy(self)

    def use_store(self, store) -> None:
        """The prefix store (models/prefix_store.py) that a drafter with a model of its own takes its prompt's blocks
        from and adds its blocks to; None: none. The others have nothing to store."""

    def begin(self, prompt_ids: list[int], sampling: SamplingParams, generator: torch.Generator) -> None:
        """Start a new generation (reset any state)."""
        self.sampling, self.generator = sampling, generator

    def propose(self, tokens: list[int], k: int) -> Draft:
        """Drafts continuing ``tokens`` (prompt + everything committed so far): a chain of up to k
        tokens, or a tree at most k deep."""
        raise NotImplementedError

    # A class whose drafts come from its own model overrides this classmethod, ``propose_many(drafters, histories,
    # ks) -> [Draft]``: several generations' proposals at once, its model's forwards batched (drafters/model.py).
    # The engine then calls it once per round for all of that class's drafters; else propose, one by one.
    propose_many = None

    def peek(self, tokens: list[int]) -> int | None:
        """The first token a proposal would draft after ``tokens`` now, told without drafting and without changing
        what a later proposal or :meth:`update` does; None where there is none, or where telling it is not free (a
        drafter with a model). The engine peeks in rounds that draft nothing (k = 0): whether the target's next token
        equals it is one more observation of α, so a generation planned no draft still learns when drafting would
        pay again (engine.py, ``Run.take``)."""
        return None

    def max_nodes(self, k: int) -> int:
        """The most draft tokens one proposal at ``k`` holds (k for chains); sizes the KV caches."""
        return k

    def priced_nodes(self, k: int) -> int:
        """The draft tokens a round at depth ``k`` verifies, as ``--k auto`` prices it (``T(nodes + 1)``): a tree's
        :meth:`max_nodes`; k for a chain, whose copies of their own length (prompt lookup's) are not k's doing."""
        return self.max_nodes(k) if self.tree else k

    def relative_cost(self) -> float | None:
        """What drafting one more token (a chain step, a tree level) costs relative to a target step, for
        ``--k auto``'s c; None: measure it (a draft model's cost profile). Lookup and plain: 0."""
        return 0.0

    def cache_bytes(self) -> int:
        """Bytes of KV cache this drafter alone holds (a draft model's, but the blocks it maps from the prefix store;
        the server's --kv-memory counts a running request's cache by it). 0 for drafters without a model of their
        own."""
        return 0

    def update(self, n_accepted: int, next_token: int, path: list[int] | None = None) -> None:
        """The verdict on the last proposal: ``n_accepted`` drafts were kept, then ``next_token`` was
        appended by the target. For a chain they are its first ``n_accepted`` tokens and ``path`` is
        not passed; for a tree ``path`` lists the accepted node indices, root side first."""

    def end(self, tokens: list[int]) -> None:
        """The generation ended well: ``tokens`` is its prompt and everything it committed (a drafter that learns
        from answers keeps them: drafters/suffix.py)."""

    def observe(self, hidden: torch.Tensor) -> None:
        """For drafters that draft from the target's own features (``wants_hidden``): the final-normed
        hidden states [r, H] of newly committed positions (then, [r, (1 + L)·H], the outputs of the L
        ``feature_layers``), in order — after the prefill (every prompt
        token but the last) and after each round (the last committed token and the accepted drafts).
        The last row is always the one whose LM-head output named the current last token."""


class Composite(Drafter):
    """A drafter made of others, named by :attr:`parts` (attribute names; the first the one that may run a model of its
    own): a fork forks each, and the prefix store and a generation's end go to the first."""

    parts: ClassVar[tuple[str, ...]] = ()

    def fork(self) -> Drafter:
        twin = copy.copy(self)
        for name in self.parts:
            setattr(twin, name, getattr(self, name).fork())
        return twin

    def use_store(self, store) -> None:
        getattr(self, self.parts[0]).use_store(store)

    def end(self, tokens: list[int]) -> None:
        getattr(self, self.parts[0]).end(tokens)


EMPTY = torch.empty(0, dtype=torch.long)
