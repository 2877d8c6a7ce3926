"""The speculative decoding loop: draft → verify → accept → roll back.

One round (Leviathan et al. 2023, Algorithm 1; Consultant Decoding, Algorithm 1):

1. the drafter proposes up to k tokens x_1..x_m with their draft distributions p_draft;
2. the target scores [last committed token, x_1..x_m] in ONE forward pass: m+1 rows of p_target,
   row i being the target's distribution for the token after x_i (row m: the bonus position);
3. the verifier — a pure function of those tensors — keeps the first n drafts and names the next token;
4. both KV caches forget the m−n rejected positions; the n drafts and the next token are emitted.

Plain decoding is the same loop with an empty draft (drafter ``none``): one target call per token.

One generation or many: a generation is a :class:`Run`, and :func:`step` moves a list of runs one round each —
every run drafts, ONE target forward scores all their rows (each run's cache its own; models/kv.py,
``forward_many``), every run verifies and rolls back on its own. ``generate`` is ``step`` over one run; the server
steps all its running requests together (server/scheduler.py). At int8 and q4 a row's bits do not depend on the
other rows of a forward, so a run's tokens are the same alone or batched.

Tree drafts (``Draft.parents``, e.g. drafter ``model-tree``) take the same four steps: the forward
runs [last committed token] + the N nodes under the tree mask (each node sees its ancestors only),
giving N+1 rows (row 0 after the root, row i+1 after node i); the verifier's tree rule
(``Verifier.verify_tree``, the algorithms in verifiers/tree.py) names the accepted root-to-node path;
the cache keeps exactly that path (``keep_path``). Acceptance by position is acceptance by depth. Either
way the engine makes one call, ``verifier.judge``, and gets one verdict type, with a ``path``.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from .policy.auto import AutoK, FixedK, calibrate_eps, is_auto, profile_for
from .drafters import Drafter
from .drafters.base import Draft
from .errors import SpeculateError
from .grammar import Constraint
from .models import exactness
from .models.kv import KVModel, Rows, forward_many
from .models.prefix_store import PrefixStore
from .models.loader import LoadedModel, check_thread
from .sampling import SamplingParams, one_hot, warp
from .spec import SpeculativeSpec, build_drafter
from .stats import Stats
from .text import Detokenizer, check_prompt, encode_prompt, eos_ids
from .verifiers import Verdict, Verifier, get_verifier, tree_rule_missing, verifier_class, verifier_for

# A decoder's own prefix store (``prefix_cache`` without a store given): its generations' blocks, 64 MiB at most.
PREFIX_CACHE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target (raw logits, log-softmax), and the ``top`` most likely tokens
    with theirs, most likely first (``SamplingParams.logprobs`` of them)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # new tokens only; an EOS that ended the generation is included
    stats: Stats
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length" (max_new_tokens)
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, None for the first


@dataclass(frozen=True)
class Request:
    """One generation, checked (``SpeculativeDecoder._request``): the prompt's token ids, how it samples and
    stops, and the verifier built for that sampling."""

    prompt_ids: list[int]
    sampling: SamplingParams
    verifier: Verifier


@dataclass
class Stream:
    """An iterator of text pieces; ``generation`` holds the finished result once it is exhausted."""

    pieces: Iterator[str]
    generation: Generation | None = field(default=None)

    def __iter__(self):
        return self.pieces


def _check_parts(spec, drafter, verifier) -> None:
    """TypeError where the decoder is handed settings in another form than a spec, or a built part beside the
    spec's own choice of it (which of the two would run?)."""
    if not isinstance(spec, SpeculativeSpec):
        raise TypeError(f"spec must be a SpeculativeSpec (speculate.SpeculativeSpec('lookup', k=6)), got {spec!r}")
    if drafter is not None and (not isinstance(drafter, Drafter) or spec.drafter != "auto"):
        raise TypeError("drafter= is a built Drafter, given in place of the spec's drafter (leave it 'auto'); "
                        f"got {drafter!r} beside the spec's {spec.drafter!r}")
    if verifier is not None and (not isinstance(verifier, Verifier) or spec.verifier is not None or spec.params):
        raise TypeError("verifier= is a built Verifier, given in place of the spec's verifier and parameters (leave "
                        f"them unset); got {verifier!r} beside {spec.label()}")


class SpeculativeDecoder:
    """``SpeculativeDecoder(target, spec)``: generations from ``target`` with the settings of ``spec``.

    ``spec``: a :class:`~speculate.spec.SpeculativeSpec`, the settings checked once where they were given (the
    drafter and its options, the verifier and its parameters, k): ``SpeculativeSpec("lookup", k=6)``,
    ``SpeculativeSpec("lookup", verifier="consultant", params={"eps": 2.0, "beta": 0.2})``; None: the defaults
    (``auto`` drafter, k = 6). Without a verifier, ``greedy`` at temperature 0 and ``sample`` (lossless) otherwise.
    ``draft_model``: the loaded draft model, for a spec whose drafter takes one (the others leave it unused).
    ``drafter`` / ``verifier``: parts built by the caller (a custom class, a head with options of its own), in
    place of the spec's drafter (which then stays ``auto``) / verifier (then neither named nor given parameters).
    ``prefix_store``: a :class:`~speculate.models.prefix_store.PrefixStore` shared by every decoder of this process
    (the server's): a prompt's blocks that any generation computed, whatever its settings, are taken instead of
    computed — the target's and a draft model's alike — and each generation's blocks (its prompt as soon as it is in,
    its whole sequence at its end: the next turn of a chat) are added for the next. At int8 and q4 a taken block has
    the bits a fresh prefill computes (batch-invariant kernels); at fp32 they can differ in the last bits, so a
    near-tie may resolve differently. The heads get what they read: Medusa's last prompt row is always computed;
    EAGLE's head takes the target's hidden rows of the blocks it takes, kept beside them in the store
    (:meth:`Run._from_store`). ``prefix_cache``: where no store is given, a store of this decoder's own
    (:data:`PREFIX_CACHE_BYTES`), so that its generations reuse each other's prefixes.

    A decoder is immutable once built: the models, the settings and the built parts. Each generation (a :class:`Run`)
    gets its own KV cache (:meth:`new_cache`, blocks of the model's pool) and its own drafter state
    (:meth:`new_drafter`), so any number of generations run on one decoder at once.
    """

    def __init__(self, target: LoadedModel, spec: SpeculativeSpec | None = None, *,
                 draft_model: LoadedModel | None = None, drafter: Drafter | None = None,
                 verifier: Verifier | None = None, prefix_cache: bool = False,
                 prefix_store: PrefixStore | None = None):
        spec = SpeculativeSpec() if spec is None else spec
        _check_parts(spec, drafter, verifier)
        self.target = target
        self.spec = spec if drafter is not None else spec.resolved(target)
        # The drafter as built: what it declares (tree, wants_hidden, its cost) and what its forks share (weights, a
        # draft model, a learned index); lent to one generation at a time, forked for the others (new_drafter).
        self.drafter = drafter if drafter is not None else build_drafter(self.spec, target, draft_model)
        self._lent = False  # whether a run drafts with self.drafter now (new_drafter)
        self._lock = threading.Lock()
        if prefix_store is None and prefix_cache:
            prefix_store = PrefixStore(PREFIX_CACHE_BYTES)
        self.prefix_store = prefix_store
        # How the target's rows equal one-token decoding here (models/exactness.py): its self-check runs once per
        # loaded model, at the first cache, so that its warning comes as the decoder is built.
        self.exactness = exactness.mode(KVModel(target))
        self.built_verifier = verifier
        if is_auto(spec.verifier_params.get("eps")):  # consultant's eps, the one 'auto' a verifier declares
            self.spec = replace(self.spec, params={**spec.verifier_params, "eps": calibrate_eps(target)})
        self.k_policy = self._k_policy(spec.k)
        self.eos = eos_ids(target)
        self._verifier(SamplingParams())  # build the verifier once now (its tree rule), not at the first request

    def new_cache(self):
        """A generation's KV cache on the target (models/kv.py: paged on the lean path, blocks from the model's pool)."""
        return KVModel(self.target)

    def new_drafter(self) -> Drafter:
        """A generation's drafter, drawing on the prefix store for a draft model's prompt: the decoder's own while no
        other run drafts with it (so one generation at a time runs with the drafter as built, and whoever built it
        sees its state), else a fork of it (``Drafter.fork``: the weights, draft model and indexes shared, the
        per-generation state its own). :meth:`Run.release` gives the decoder's own back."""
        with self._lock:
            lend, self._lent = not self._lent, True
        drafter = self.drafter if lend else self.drafter.fork()
        drafter.use_store(self.prefix_store)
        return drafter

    def _given_back(self, drafter: Drafter) -> None:
        if drafter is self.drafter:
            with self._lock:
                self._lent = False

    def _k_policy(self, k):
        if not is_auto(k):
            return FixedK(k)
        if self.drafter.max_nodes(1) == 0:
            return FixedK(1)  # a drafter that never drafts: k is moot
        cost = self.drafter.relative_cost()  # c: lookup ~0, heads by the weights they read...
        draft = self.drafter.model if cost is None else None  # ...a draft model's measured with the target
        prof = profile_for(self.target, draft)
        # A tree drafter verifies all its nodes: the cost of depth k is T(nodes + 1), not T(k + 1). A chain
        # drafter's k rounds verify k + 1 rows (model+lookup's copies, of their own length, cost no draft).
        rows = (lambda k: self.drafter.priced_nodes(k) + 1) if self.drafter.tree else None
        return AutoK(prof, prof.c if cost is None else cost, rows=rows)

    def _verifier(self, sampling: SamplingParams) -> Verifier:
        if self.built_verifier is not None:
            verifier = self.built_verifier
        else:
            params = self.spec.verifier_params
            try:
                name = verifier_for(self.spec.verifier, sampling.greedy)
                if any(p.name == "greedy" for p in verifier_class(name).params):
                    params.setdefault("greedy", sampling.greedy)  # (argmax or drawn correction tokens)
                verifier = get_verifier(name, **params)
            except ValueError as e:
                raise SpeculateError(str(e)) from None
        if self.drafter.tree and not verifier.has_tree_rule():
            raise SpeculateError(tree_rule_missing(verifier, self.drafter.name))
        return verifier

    # ---------------------------------------------------------------------------------------------
    def generate(self, prompt, sampling: SamplingParams | None = None, *, chat: bool | None = None,
                 **params) -> Generation:
        """Generate from a string, a list of chat messages or token ids; returns text, token ids and stats.
        ``sampling``: a :class:`SamplingParams`, or its fields by name (``max_new_tokens=128, temperature=0.7,
        seed=1, stop=[...]``; given with ``sampling`` they replace its fields). ``chat``: see ``encode_prompt``."""
        stream = self.stream(prompt, sampling, chat=chat, **params)
        for _ in stream:
            pass
        return stream.generation

    def stream(self, prompt, sampling: SamplingParams | None = None, *, chat: bool | None = None,
               **params) -> Stream:
        """Like :meth:`generate`, as an iterator of text pieces (bad settings raise here, eagerly)."""
        request = self._request(prompt, sampling, chat, params)
        stream = Stream(iter(()))
        stream.pieces = self._pieces(stream, request)
        return stream

    def start(self, prompt, sampling: SamplingParams | None = None, *, chat: bool | None = None,
              prefill_chunk: int | None = None, reserve: int | None = None, **params) -> Run:
        """A generation as a :class:`Run`, for :func:`step` to move round by round together with others (batched
        serving, speculate/policy/batch.py). ``prefill_chunk``: prompt tokens per round until the prompt is in the
        cache (None: all in the first round). ``reserve``: cache positions to allocate at once (None: all it may
        need; the server's admission by memory gives a first stretch, and the cache grows as it fills)."""
        return Run(self, self._request(prompt, sampling, chat, params), prefill_chunk=prefill_chunk, reserve=reserve)

    def _request(self, prompt, sampling: SamplingParams | None, chat: bool | None, params: dict) -> Request:
        """One generation's settings, checked once: the prompt's ids (``text.check_prompt``: not empty, within the
        context window with the new tokens), the sampling parameters and the verifier they call for."""
        check_thread(self.target)  # (a warning, once: several threads running torch slow every forward)
        if sampling is None:
            sampling = SamplingParams(**params)
        elif not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams (or give its fields by name), got {sampling!r}")
        elif params:
            sampling = replace(sampling, **params)
        prompt_ids = list(prompt) if _is_token_ids(prompt) else encode_prompt(self.target.tokenizer, prompt, chat)
        check_prompt(prompt_ids, sampling.max_new_tokens, self.target.context_window)
        return Request(prompt_ids, sampling, self._verifier(sampling))

    def _pieces(self, stream: Stream, request: Request) -> Iterator[str]:
        """One generation alone: :func:`step` over a single run until it is done."""
        run = Run(self, request)
        stream.generation = run.generation  # (done at once: nothing to prefill and nothing to generate)
        while not run.done:
            pieces = step([run])[0]
            if run.error is not None:
                raise run.error
            if run.done:
                stream.generation = run.generation
            yield from pieces


class Run:
    """One generation between rounds: its tokens, budget, verifier state, stats and text so far, with the
    decoder's drafter, cache and k policy, which it holds until it is done. :func:`step` moves a list of runs by
    one round each; ``done`` then ``generation`` (or ``error``) say how it ended."""

    def __init__(self, decoder: SpeculativeDecoder, request: Request, prefill_chunk: int | None = None,
                 reserve: int | None = None):
        prompt_ids, sampling = request.prompt_ids, request.sampling
        self.sampling, self.verifier, self.generator = sampling, request.verifier, sampling.generator()
        self.eos, self.max_new_tokens = decoder.eos, sampling.max_new_tokens
        self.stats = Stats(prompt_tokens=len(prompt_ids))
        self.detok = Detokenizer(decoder.target.tokenizer, list(sampling.stop))
        self.finish = "length"  # "stop" (EOS or a stop string) or "length" (max_new_tokens)
        self.started = self.round_started = time.perf_counter()
        self.tokens = list(prompt_ids)  # prompt + everything committed so far
        self.prompt_tokens = len(prompt_ids)
        self.verifier_state, self.produced, self.draft, self.rows_last = None, 0, None, 0
        self.peeked = None  # a round that drafts nothing: the token its drafter would have drafted first (None: none)
        self.done, self.generation, self.error = False, None, None
        self.resumed = 0  # times it was preempted and resumed (server/scheduler.py: admission by memory)
        # A fixed k that the batch planner may lower, in a batch where drafting does not pay (the server's default
        # k; speculate/policy/batch.py). False: the k is kept as given.
        self.k_is_cap = False
        # Log-probabilities, where asked: of the new tokens (from the verification rows), of the prompt's (from the
        # prefill's rows: so every prompt row is computed, none taken from a cache).
        self.logprobs = [] if sampling.logprobs is not None else None
        self.prompt_logprobs = [None] if sampling.prompt_logprobs is not None else None
        # Structured output: every new token follows the grammar (speculate/grammar.py: masked rows, cut drafts).
        self.constraint = Constraint(decoder.target.tokenizer, sampling.grammar) if sampling.grammar else None
        # Whether only each verified row's argmax is read (greedy verification, nothing else asked of the logits): the
        # LM head then leaves the logits that cannot be the greatest at -inf (Rows.argmax).
        self.argmax_only = (self.verifier.argmax_only and sampling.greedy and self.logprobs is None
                            and self.prompt_logprobs is None and self.constraint is None)
        self._bind(decoder, prefill_chunk, reserve)
        self.stats.reused_prompt_tokens = self.filled
        self._prefilled()

    def _bind(self, decoder: SpeculativeDecoder, prefill_chunk: int | None, reserve: int | None) -> None:
        """Take a cache, a drafter and a k policy of ``decoder``'s, this run's own, and make every token so far (the
        prompt; after a preemption, the prompt and the answer so far) the prompt to prefill, but the blocks any
        generation stored (models/prefix_store.py). ``reserve``: cache positions to allocate now (None: all the run
        may need; the cache grows past them as it fills)."""
        self.decoder = decoder
        self.kv, self.drafter, self.policy = decoder.new_cache(), decoder.new_drafter(), copy.copy(decoder.k_policy)
        # The decoder's own drafter goes back at release, or when a caller drops the run unfinished (a stream left
        # half-read): once, whichever comes first.
        self._give_back = weakref.finalize(self, decoder._given_back, self.drafter)
        self.stats.exactness = decoder.exactness
        # c, a draft token's cost against a target step (None: a draft model's, measured in a profile): read once,
        # not by the batch planner every round (a head drafter sums its weights' bytes).
        self.draft_cost = self.drafter.relative_cost()
        self.most_nodes = self.drafter.max_nodes(self.policy.k_max)  # (a draft's rows at most, for positions_next)
        self.prefill_chunk = prefill_chunk or len(self.tokens)
        self.prompt_end = len(self.tokens) - 1  # the prefill covers all but the last token: the first round feeds it
        # Whether the prompt's last chunk may go in with the first draft (:attr:`joins`): not for a drafter that drafts
        # from the target's hidden rows of the prompt (the heads: they need that forward's rows first), not where the
        # prompt's rows are scored (every row's logits), not for a run of no new token.
        self._joinable = not self.drafter.wants_hidden and not self._scoring_prompt and self.max_new_tokens > 0
        capacity = self.positions_needed
        capacity = capacity if reserve is None else min(capacity, reserve)
        reuse = self.prompt_logprobs is None or self.resumed > 0  # (the prompt's rows are scored once, computed)
        self.kv.reset(capacity)
        self.store, self.reuse = decoder.prefix_store, reuse
        # A drafter that observes every prompt row (EAGLE): the target's hidden rows of positions 0..filled-1, taken
        # from the store or computed, to be stored beside the blocks this run adds.
        self.hidden_rows = [] if self.store is not None and self.drafter.wants_hidden and \
            self.drafter.observes_prompt else None
        self.filled = self._from_store(0) if self.store is not None and reuse else 0
        self.kv.taps = self.drafter.feature_layers  # the layer outputs a fused EAGLE head reads beside the hidden rows
        self.policy.reset()
        self.drafter.begin(self.tokens, self.sampling, self.generator)
        if self.hidden_rows:
            self.drafter.observe(torch.cat(self.hidden_rows))

    def _store_terms(self) -> tuple[int, tuple | None]:
        """What this run may take from the prefix store: (the prompt positions it may take, at most; the taps whose
        hidden rows a taken block must come with, or None). A drafter that reads the target's hidden rows gets what
        it needs: Medusa's heads read the last prompt row only, so that one is always computed; EAGLE's head reads
        every row, so only blocks stored with their hidden rows (for its taps) are taken."""
        drafter = self.drafter
        if not drafter.wants_hidden:
            return self.prompt_end, None
        if not drafter.observes_prompt:
            return self.prompt_end - 1, None
        return self.prompt_end, drafter.feature_layers

    def _from_store(self, have: int, again: bool = False) -> int:
        """Take from the prefix store the blocks of this run's prompt past ``have`` (its cache's positions), within
        :meth:`_store_terms`; returns the positions its cache holds then. Hidden rows taken go to ``hidden_rows``
        (the caller hands them to the drafter)."""
        most, hidden = self._store_terms()
        self.looked_at = self.store.version
        return self.store.fill(self.kv, self.tokens[:most], have, again=again, hidden=hidden,
                               rows=self.hidden_rows if hidden is not None else None)

    def resume(self, decoder: SpeculativeDecoder, prefill_chunk: int | None = None, reserve: int | None = None):
        """Go on with ``decoder`` after a preemption took this run's cache away: its tokens so far are prefilled
        again (or found in the decoder's cache or the prefix store), then it decodes from where it stopped. Its
        tokens, verifier state, random generator, text and statistics carry on; at int8 and q4 a row's bits do not
        depend on how its keys were computed (a prefill chunk or one token a round), so a greedy answer is the one
        the run gives uninterrupted."""
        self.resumed += 1
        self._bind(decoder, prefill_chunk, reserve)
        self._prefilled()

    def could_take(self, end: int, other: "Run") -> bool:
        """Whether this run could take from the prefix store the prompt blocks up to position ``end`` once
        ``other`` (prefilling the same tokens) has stored them (see :meth:`_from_store`)."""
        if self.store is None or not self.reuse or other.store is not self.store:
            return False
        most, hidden = self._store_terms()
        return end <= most and (hidden is None or (other.hidden_rows is not None
                                                   and other.drafter.feature_layers == hidden))

    def catch_up(self) -> None:
        """While prefilling: take the blocks of this prompt that other runs stored since this run started (runs
        that share its prefix and prefill beside it: server/scheduler.py lets this run wait a round while another
        computes its next block)."""
        if self.prefilling and self.store is not None and self.reuse and self.store.version != self.looked_at:
            seen = len(self.hidden_rows or ())
            filled = self._from_store(self.filled, again=True)
            if self.hidden_rows and len(self.hidden_rows) > seen:  # (EAGLE: the rows of the blocks just taken)
                self.drafter.observe(torch.cat(self.hidden_rows[seen:]))
            if filled > self.filled:
                self.stats.reused_prompt_tokens += filled - self.filled
                self.filled = filled

    @property
    def positions_needed(self) -> int:
        """Cache positions this run may fill by its end: :attr:`positions_next` and the rest of its budget."""
        return self.positions_next + self.max_new_tokens - self.produced

    @property
    def preemptible(self) -> bool:
        """Whether the run may give its cache up between rounds and :meth:`resume` later: not while the prefill
        scores its prompt (those scores are made once)."""
        return not self.done and not (self.prompt_logprobs is not None and self.prefilling)

    @property
    def positions_next(self) -> int:
        """Cache positions this run may fill by the end of its next round (its tokens and one draft's nodes)."""
        return len(self.tokens) + self.most_nodes + 1

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are still to go into the cache. All but the last: that one is scored with the
        first draft."""
        return self.filled < self.prompt_end

    @property
    def joins(self) -> bool:
        """Whether this round's prefill chunk is the prompt's last and goes in with the first draft, so that the
        round that completes the prompt also gives the first token (one round to it, not two: a request that finds
        its prompt in the prefix store answers a round sooner)."""
        return self.prefilling and self._joinable and self.prompt_end - self.filled <= self.prefill_chunk

    @property
    def prefill_rows(self) -> int:
        """The rows of the next prefill chunk (0 once the prompt is in)."""
        return max(0, min(self.prompt_end, self.filled + self.prefill_chunk) - self.filled)

    @property
    def budget(self) -> int:
        """The deepest draft the token budget can still take (the target adds one token)."""
        return self.max_new_tokens - self.produced - 1

    def draft_length(self, k: int | None = None) -> int:
        """This round's draft length: ``k`` (default: what the k policy asks for), within :attr:`budget`."""
        return min(self.policy.next_k() if k is None else k, self.budget)

    def rows(self, draft: Draft | None = None) -> Rows:
        """1. This round's rows for the target: a prefill chunk (while :attr:`prefilling`), or the committed tokens
        not in the cache yet (the last one; or, where it :attr:`joins`, the rest of the prompt) + ``draft``, a proposal
        of the drafter."""
        if self.prefilling and not self.joins:
            self.draft = None
            rows = Rows(self.kv, torch.tensor(self.tokens[self.filled: self.filled + self.prefill_rows]),
                        want=None if self._scoring_prompt else 0)
        else:
            self.draft = draft.within(self.budget)
            if self.constraint is not None and self.sampling.greedy and draft.parents is None:
                self.draft = self.draft.within(self.constraint.valid_prefix(self.draft.tokens.tolist()))
            fed = torch.tensor(self.tokens[self.kv.length:])  # ..., then the root: the last committed token
            rows = Rows(self.kv, torch.cat([fed, self.draft.tokens]), _rooted(self.draft.parents, len(fed)),
                        len(self.draft.tokens) + 1, self.argmax_only)  # (the root's and the draft's logits: verified)
        self.rows_last = rows.tokens.shape[0]  # (the scheduler's rows-per-forward metric)
        return rows

    def take(self, logits: torch.Tensor | None) -> list[str]:
        """3-4. The target's rows for :meth:`rows`: verify, roll back, commit; returns the new text pieces."""
        if self.draft is None:  # a prefill chunk went in
            if self.drafter.wants_hidden:
                self.drafter.observe(self.kv.hidden)
                if self.hidden_rows is not None:
                    self.hidden_rows.append(self.kv.hidden.clone())
            if self._scoring_prompt:  # row j of the chunk scores the prompt token after it
                following = self.tokens[self.filled + 1: self.filled + 1 + logits.shape[0]]
                self.prompt_logprobs += _logprobs(logits, following, self.sampling.prompt_logprobs)
            self.filled = self.kv.length
            if self.store is not None and self.prefilling:  # the chunk's full blocks, for runs prefilling beside it
                self._to_store(self.filled)
            return self._prefilled()
        draft, kv, drafter = self.draft, self.kv, self.drafter
        raw = logits
        if self.constraint is not None:  # each row keeps what the grammar allows after its draft path
            logits = logits.clone() if self.logprobs is not None else logits  # (logprobs: the raw model's)
            self.constraint.mask(logits, _paths(draft))
        # 3. Verify: the accepted drafts (a chain's first n, or a tree's path) and the next token.
        verdict = _verify(self.verifier, draft, logits, self.sampling, self.verifier_state, self.generator)
        path, self.verifier_state = verdict.path, verdict.state
        # 4. Roll back: keep the cache up to the last accepted draft; the next token is fed next round.
        rows = list(range(len(path) + 1)) if draft.parents is None else [0] + [node + 1 for node in path]
        if draft.parents is None:
            kv.keep(len(self.tokens) + len(path))
            drafter.update(len(path), verdict.next_token)
        else:
            kv.keep_path(len(self.tokens) - 1, rows)  # the root, then the path
            drafter.update(len(path), verdict.next_token, path)
        if self.prefilling:  # it joined: the prompt is in (its prefill timed to this round's start, its first round)
            self.filled = self.prompt_end
            self._prefilled(self.round_started)
        if drafter.wants_hidden:  # self-drafting heads continue from the target's own features
            drafter.observe(kv.hidden[rows])
        if draft.from_k:  # (model+lookup's copies say nothing about the draft model's acceptance)
            self.policy.update(draft.depth, len(path))
        if self.peeked is not None:  # no draft, but a free one was there: a one-token round's verdict, for α
            hit = self.peeked == verdict.next_token  # (greedy: what verifying it would say; sampling: p_target)
            self.policy.update(1, int(hit))
            self.stats.peek(hit)
        self.stats.record(len(draft), len(path), draft.depth)
        new = draft.tokens[path].tolist() + [verdict.next_token]
        # Row rows[j] scored new[j]: the accepted drafts' values are the verification forward's, so they are the
        # values plain decoding reports (the same bits at int8 and q4, where a row does not depend on the others).
        scored = _logprobs(raw[rows], new, self.sampling.logprobs) if self.logprobs is not None else None
        return self._commit(new, scored)

    def _commit(self, new: list[int], scored: list[TokenLogprob] | None = None) -> list[str]:
        """Append the round's tokens up to EOS, a stop string or the budget; nothing past them is kept."""
        pieces = []
        for j, token in enumerate(new):
            if scored is not None:
                self.logprobs.append(scored[j])
            self.tokens.append(token)
            self.produced += 1
            self.stats.new_tokens += 1
            if self.constraint is not None:
                self.constraint.consume(token)
            if token in self.eos:
                self.detok.ids.append(token)
                self.finish = "stop"
                break
            piece = self.detok.add(token)
            if piece:
                pieces.append(piece)
            if self.detok.stopped or (self.constraint is not None and self.constraint.ended):
                self.finish = "stop"
                break
        if self.finish == "stop" or self.produced >= self.max_new_tokens:
            pieces += self._end()
        return pieces

    @property
    def _scoring_prompt(self) -> bool:
        """Whether the prefill's rows score the prompt (asked for, and not a resumed run's second prefill)."""
        return self.prompt_logprobs is not None and not self.resumed

    def _prefilled(self, at: float | None = None) -> list[str]:
        """Once the prompt is in: its blocks to the store, the prefill's time (to ``at``, else now)."""
        if self.prefilling:
            return []
        if self.store is not None:  # the prompt's blocks, for the generations that share its prefix
            self._to_store(self.prompt_end)
            self.hidden_rows = None  # (the prompt is in: no more rows to store)
        if self.resumed:
            return []
        self.stats.prefill_seconds = (time.perf_counter() if at is None else at) - self.started
        return self._end() if self.max_new_tokens == 0 else []

    def _to_store(self, end: int) -> None:
        """The full blocks of positions 0..end-1 into the prefix store, with the hidden rows an EAGLE head reads."""
        if self.hidden_rows is None:
            self.store.add(self.kv, self.tokens[:end])
        else:
            self.store.add(self.kv, self.tokens[:end], hidden=self.drafter.feature_layers,
                           rows=torch.cat(self.hidden_rows) if self.hidden_rows else None)

    def _end(self) -> list[str]:
        self.stats.wall_seconds = time.perf_counter() - self.started
        tail = self.detok.flush()
        self.generation = Generation(self.detok.text, list(self.detok.ids), self.stats, self.finish,
                                     self.prompt_tokens, self.logprobs, self.prompt_logprobs)
        if self.store is not None:  # its whole sequence (full blocks, then its tail): a chat's next turn starts so
            self.store.add(self.kv, self.tokens, tail=True)
        self.drafter.end(self.tokens)
        self.done = True
        self.release()
        return [tail] if tail else []

    def release(self) -> None:
        """Give the cache and the drafter's state up (at its end, or preempted: :meth:`resume` makes new ones): the
        cache's blocks go back to the pool but for those the prefix store holds."""
        if self.drafter is not None:
            self._give_back()
        self.kv = self.drafter = None

    def fail(self, error: BaseException) -> None:
        """End the run with ``error`` (its drafter, verifier or forward raised); its cache and drafter go with it."""
        self.error, self.done = error, True
        self.release()


@torch.inference_mode()
def step(runs: list[Run], ks: list[int] | None = None, depths: list[int | None] | None = None) -> list[list[str]]:
    """One round of every run: each drafts (or feeds a prefill chunk), ONE target forward scores all their rows
    (the linear layers and the LM head once; attention per run over its own cache), then each verifies, rolls
    back and commits. Returns each run's new text pieces. ``ks``: each run's draft length (default: its k
    policy's); ``depths``: each run's deepest draft (None: as deep as its drafter proposes, which may pass k: lookup's
    copies that grow; the batch planner's, ``BatchPlanner.round``). A run that raises is ended with the error
    (``Run.error``); the others go on."""
    # 1. Draft: each run's rows, a prefill chunk or [root] + its drafter's proposal. (A run already done is left as
    # it is.)
    started = time.perf_counter()
    for run in runs:
        run.round_started = started  # (a run whose prompt completes this round counts its prefill to here)
    drafts = _propose([run for run in runs if not run.done and (not run.prefilling or run.joins)],
                      ks and {id(r): k for r, k in zip(runs, ks)}, depths and {id(r): d for r, d in zip(runs, depths)})
    drafted = time.perf_counter()
    live, rows = [], []
    for run in runs:
        if run.done:
            continue
        try:
            rows.append(run.rows(drafts.get(id(run))))
            live.append(run)
        except Exception as e:  # noqa: BLE001 — reported through run.error
            run.fail(e)
    # 2. One target forward over all of them.
    try:
        logits = forward_many(rows)
    except Exception as e:  # noqa: BLE001
        for run in live:
            run.fail(e)
        return [[] for _ in runs]
    # (The round's wall time, split for the speedup model: calc's --from-results. A batched round's times count whole
    # for each of its runs: the time each waited.)
    forwarded = time.perf_counter()
    for run in live:
        if run.draft is not None:
            run.stats.timed_round(drafted - started, forwarded - drafted)
    # 3-4. Each verifies, rolls back and commits.
    pieces = {}
    for run, out in zip(live, logits):
        try:
            pieces[id(run)] = run.take(out)
        except Exception as e:  # noqa: BLE001
            run.fail(e)
    return [pieces.get(id(run), []) for run in runs]


def _propose(runs: list[Run], ks: dict | None, depths: dict | None = None) -> dict[int, Draft]:
    """id(run) → its draft this round, cut to its depth where ``depths`` gives one. Drafters with their own model
    propose together (``Drafter.propose_many``: their forwards batched); the others one by one. A drafter that
    raises ends its run (its group's, batched)."""
    drafts, groups = {}, {}
    for run in runs:
        many = type(run.drafter).propose_many
        groups.setdefault(many, []).append(run)
    for many, group in groups.items():
        lengths = [run.draft_length(None if ks is None else ks[id(run)]) for run in group]
        for run, k in zip(group, lengths):  # k = 0 with tokens to go: peek, so α is still learned (Drafter.peek)
            try:
                run.peeked = run.drafter.peek(run.tokens) if k == 0 < run.budget else None
            except Exception as e:  # noqa: BLE001 — as a proposal that raises: its run ends with the error
                run.peeked = None
                run.fail(e)
        if many is None:  # one by one: a drafter that raises ends its own run
            for run, k in zip(group, lengths):
                try:
                    drafts[id(run)] = run.drafter.propose(run.tokens, k)
                except Exception as e:  # noqa: BLE001
                    run.fail(e)
            continue
        try:
            drafts.update(zip(map(id, group), many([run.drafter for run in group], [run.tokens for run in group],
                                                   lengths)))
        except Exception as e:  # noqa: BLE001 — a batched proposal that raises ends its group's runs
            for run in group:
                run.fail(e)
    for key, depth in (depths or {}).items():
        if depth is not None and key in drafts:
            drafts[key] = drafts[key].within(depth)
    return drafts


def _verify(verifier: Verifier, draft, logits: torch.Tensor, sampling: SamplingParams, state, generator) -> Verdict:
    """The verdict on a draft (chain or tree) from the target's rows ``logits`` [m+1, V], in one call
    shape: warped (temperature/top-k/top-p) target rows, or raw ones plus the warped rows as
    ``sample_probs`` for verifiers that judge by the target's own likelihood (``raw_target``)."""
    draft_probs = None
    if verifier.needs_draft_probs:
        draft_probs = draft.probs if draft.probs is not None else one_hot(draft.tokens, logits.shape[-1])
    if verifier.argmax_only and sampling.greedy:  # greedy's own rule reads each row's argmax alone, and a greedy
        # warp is one-hot at the logits' argmax (its first index on ties): the logits give the same verdict, without
        # building [rows, V] one-hots
        target_probs, sample_probs = logits, None
    else:
        warped = warp(logits, sampling)
        target_probs, sample_probs = (logits.softmax(-1), warped) if verifier.raw_target else (warped, None)
    # Certain drafts (no p_draft rows: the heads' greedy trees, lookup's nodes) are each their own draw,
    # independent of their siblings: the with-replacement rule is the exact one for them (trees only).
    return verifier.judge(draft.tokens, draft.parents, draft_probs, target_probs, state, generator, sample_probs,
                          replacement=draft.replacement or draft.probs is None)


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-softmax at its token (row j scores ``tokens[j]``), with the ``top`` most likely tokens. One row
    at a time, so that a value never depends on how many rows were scored together."""
    out = []
    for row, token in zip(logits, tokens):
        lp = row.float().log_softmax(-1)
        best = lp.topk(top) if top else None
        out.append(TokenLogprob(token, float(lp[token]),
                                tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()))
    return out


def _paths(draft: Draft) -> list[list[int]]:
    """The draft tokens before each row of the target's forward over [root] + draft: row 0 follows the root alone;
    in a chain row i + 1 follows draft[:i + 1], in a tree row i + 1 follows node i's root-to-node path."""
    tokens = draft.tokens.tolist()
    paths = [[]]
    for i, token in enumerate(tokens):
        parent = i - 1 if draft.parents is None else draft.parents[i]
        paths.append(paths[parent + 1] + [token])
    return paths


def _rooted(parents: list[int] | None, fed: int = 1) -> list[int] | None:
    """A tree's parents for the forward over ``fed`` committed tokens (the last is the root) + nodes: those rows a
    chain, the root (row fed - 1) every top node's parent, node i row fed + i. None (a chain) stays None: a causal
    forward."""
    return None if parents is None else list(range(-1, fed - 1)) + [parent + fed for parent in parents]


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)
