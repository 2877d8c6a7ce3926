"""Batched generations (engine.py: ``SpeculativeDecoder.start`` → :class:`Run`, :func:`step`): several runs moved
round by round, ONE target forward over all their rows (models/fast.py, ``LeanModel.forward_many``).

The promise tested here: at int8, q4, and fp32 and bf16 through the kernel (batch-invariant kernels, checked at
load) a batched answer is token for token the same request run alone, greedy or sampled with a seed, whatever else
shares the forwards (other drafters, trees, prefill chunks, runs joining, finishing, being cancelled or failing);
sampling stays lossless when batched; fp32 on PyTorch's matmuls (no C compiler) makes no bit-exactness promise, so
there only what holds is checked.
"""

from __future__ import annotations

import os
import platform
import random
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from scipy import stats as sstats

from speculate import SpeculateError, SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.drafters.base import Drafter
from speculate.drafters.lookup import LookupDrafter
from speculate.engine import Run, step
from speculate.models.fast import FastKVModel
from speculate.models.kv import KVModel
from speculate.models.loader import QUANTIZED, QualityWarning, quantized_cache_folder
from speculate.models.tiny import tiny_model, tiny_tokenizer
from speculate.sampling import SamplingParams, warp
from conftest import assert_pytest_passed, noisy_copy


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


# ------------------------------------------------------------------------------------------- the driver
@dataclass
class Request:
    """One generation for :func:`run_batch`: ``make`` builds its decoder,
    ``kwargs`` go to ``start`` / ``generate``; it joins the batch before step ``join`` and, with ``cancel``, is
    removed before step ``cancel`` without finishing."""

    make: Callable[[], SpeculativeDecoder]
    kwargs: dict
    join: int = 0
    cancel: int | None = None
    prefill_chunk: int | None = None
    name: str = ""


@dataclass
class Batch:
    runs: list[Run | None]
    pieces: list[list[str]]
    sizes: list[int] = field(default_factory=list)  # how many runs each step moved
    cancelled: list[int] = field(default_factory=list)  # the requests removed unfinished


def run_batch(requests: list[Request], ks: Callable[[int, int], int] | None = None, max_steps: int = 5000) -> Batch:
    """Drive :func:`step` the way a batching server does: before each step the requests due join (``start``), the
    ones due are cancelled (dropped from the list), and after it the runs that are done leave. ``ks(step, i)``:
    request i's draft length at that step (default: its decoder's k policy)."""
    batch = Batch([None] * len(requests), [[] for _ in requests])
    active: list[int] = []
    last_join = max(r.join for r in requests)
    for s in range(max_steps):
        for i, r in enumerate(requests):
            if r.join == s:
                batch.runs[i] = r.make().start(**r.kwargs, prefill_chunk=r.prefill_chunk)
                if not batch.runs[i].done:  # (a run can end at start: max_new_tokens 0, one-token prompt)
                    active.append(i)
            if r.cancel == s and i in active:
                active.remove(i)
                batch.cancelled.append(i)
        if not active:
            if s >= last_join:
                return batch
            continue
        runs = [batch.runs[i] for i in active]
        out = step(runs, None if ks is None else [ks(s, i) for i in active])
        assert len(out) == len(runs)
        batch.sizes.append(len(runs))
        for i, pieces in zip(active, out):
            batch.pieces[i] += pieces
        active = [i for i in active if not batch.runs[i].done]
    raise AssertionError("the batch did not finish")


def alone(request: Request):
    """The same request generated alone, with a fresh decoder."""
    return request.make().generate(**request.kwargs)


def alone_with_drafts(request: Request):
    run = request.make().start(**request.kwargs)
    while not run.done:
        step([run])
    assert run.error is None, run.error
    return run.generation, getattr(run, "drafts", [])


def assert_same_as_alone(batch: Batch, requests: list[Request], skip=(), same_drafts: bool = True):
    """Every finished run: token for token (and text, finish reason) the request alone; its streamed pieces join
    to its text; with ``same_drafts`` also every draft its drafter proposed (tokens and tree: the drafter's own
    state — a draft model's cache, the heads' features — was exact too), hence the same stats."""
    for i, (run, r) in enumerate(zip(batch.runs, requests)):
        if i in skip or i in batch.cancelled:
            continue
        assert run.done and run.error is None, (r.name, run.error)
        (ref, drafts), got = alone_with_drafts(r), run.generation
        assert got.token_ids == ref.token_ids, r.name
        assert got.text == ref.text and got.finish_reason == ref.finish_reason, r.name
        assert got.prompt_tokens == ref.prompt_tokens
        assert "".join(batch.pieces[i]) == got.text, r.name
        assert got.stats.new_tokens == len(got.token_ids)
        if same_drafts:
            assert getattr(run, "drafts", []) == drafts, r.name
            assert (got.stats.target_calls, got.stats.drafted_tokens, got.stats.accepted_draft_tokens) == \
                   (ref.stats.target_calls, ref.stats.drafted_tokens, ref.stats.accepted_draft_tokens), r.name


class CountForwards:
    """Wraps ``FastKVModel.forward_many`` (every lean forward goes through it): per call on ``loaded``'s weights,
    the number of distinct caches (generations) its rows belonged to."""

    def __init__(self, monkeypatch, loaded):
        self.caches: list[int] = []
        real = FastKVModel.forward_many

        def counted(kv, items):
            if kv.loaded is loaded:
                assert all(item.kv.loaded is loaded for item in items)
                self.caches.append(len({id(item.kv) for item in items}))
            return real(kv, items)

        monkeypatch.setattr(FastKVModel, "forward_many", counted)


# ------------------------------------------------------------------------------------------- the models
def _quantized_load(folder, dtype):
    try:
        return load_model(str(folder), dtype=dtype)
    except SpeculateError as e:  # q4 needs the C kernels (a compiler)
        return e


@pytest.fixture(scope="module")
def models(tiny_folders, tmp_path_factory):
    """Tiny random int8, q4, q4a8, fp32 and bf16 targets (seed 0), a far int8 draft model (another random model, seed 1) and a
    near one (the target's weights plus noise: agrees often, not always)."""
    folder = tmp_path_factory.mktemp("near") / "near"
    near = tiny_model(0)  # the target's weights (save_tiny_model(seed=0))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.std().clamp_min(1e-3))
    near.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    try:
        with warnings.catch_warnings():  # (a random tiny model fails q4a8's gate: its answers are not the point here)
            warnings.simplefilter("ignore", QualityWarning)
            q4a8 = _quantized_load(tiny_folders[0], "q4a8")
        out = {"int8": load_model(str(tiny_folders[0]), dtype="int8"), "q4": _quantized_load(tiny_folders[0], "q4"),
               "q4a8": q4a8,
               "fp32": load_model(str(tiny_folders[0]), dtype="fp32"),  # (its own load: not the shared `tiny` one)
               "bf16": load_model(str(tiny_folders[0]), dtype="bf16"),
               "far": load_model(str(tiny_folders[1]), dtype="int8"), "near": load_model(str(folder), dtype="int8")}
        for loaded in out.values():  # the load-time self-check's forwards, once a model, now (not in a counted batch)
            if not isinstance(loaded, Exception):
                KVModel(loaded)
        yield out
    finally:  # (conftest removes the tiny folders' cache entries; this one is ours)
        for kind in QUANTIZED:
            shutil.rmtree(quantized_cache_folder(str(folder), folder, kind), ignore_errors=True)


@pytest.fixture(autouse=True)
def record_drafts():
    """Every round's draft, as the run hands it to the target (whichever way the engine asked the drafter: one by
    one, or a draft-model class's batched ``propose_many``), appended to the run's ``drafts``."""
    rows = Run.rows

    def recorded(run, *args, **kwargs):
        out = rows(run, *args, **kwargs)
        if run.draft is not None:
            run.__dict__.setdefault("drafts", []).append((run.draft.tokens.tolist(), run.draft.parents))
        return out

    with pytest.MonkeyPatch.context() as mp:  # (its own: the tests' monkeypatch.undo() leaves it)
        mp.setattr(Run, "rows", recorded)
        yield


def maker(target, drafter, draft_model=None, k=4, verifier="greedy", **kw):
    """A decoder factory; ``drafter`` a name or a callable building a Drafter (a fresh one
    per decoder)."""
    def make():
        built = drafter() if callable(drafter) else None
        spec = SpeculativeSpec("auto" if built else drafter, verifier=verifier, params=kw, k=k)
        return SpeculativeDecoder(target, spec, drafter=built, draft_model=draft_model)
    return make


# ----------------------------------------------------------------------------------- 1. mixed drafters
@pytest.mark.parametrize("dtype", ["int8", "q4", "q4a8", "fp32", "bf16"])
def test_mixed_drafters_batched_equal_each_request_alone(models, dtype, monkeypatch):
    target = models[dtype]
    if isinstance(target, Exception):
        pytest.skip(f"q4 does not load here: {target}")
    near, far = models["near"], models["far"]
    reqs = [
        Request(maker(target, "none"), dict(prompt=random_prompt(1, 5), max_new_tokens=23), name="none"),
        Request(maker(target, "lookup", k=5), dict(prompt=random_prompt(2, 6) * 4, max_new_tokens=40),
                prefill_chunk=4, name="lookup"),
        Request(maker(target, "model", near, k=4), dict(prompt=random_prompt(3, 17), max_new_tokens=31),
                name="model near"),
        Request(maker(target, "model", far, k=3), dict(prompt=random_prompt(4, 2), max_new_tokens=12),
                prefill_chunk=4, name="model far"),
        Request(maker(target, "model-tree", near, k=3), dict(prompt=random_prompt(5, 9), max_new_tokens=27),
                prefill_chunk=4, name="model-tree"),
        Request(maker(target, "model+lookup", near, k=4), dict(prompt=random_prompt(6, 7) * 3, max_new_tokens=36),
                name="model+lookup"),
        Request(maker(target, "lookup", k=3), dict(prompt="hello there, hello there", max_new_tokens=19),
                name="lookup chat"),
    ]
    counted = CountForwards(monkeypatch, target)
    batch = run_batch(reqs)
    # One target forward a step, over every run's rows (prefill chunks, chains and trees together).
    assert len(counted.caches) == len(batch.sizes) and counted.caches == batch.sizes
    assert batch.sizes[0] == len(reqs) and max(batch.sizes) == len(reqs)
    monkeypatch.undo()
    assert_same_as_alone(batch, reqs)
    gens = [run.generation for run in batch.runs]
    assert all(g.stats.exactness == "batched" for g in gens)
    assert all(len(g.token_ids) == r.kwargs["max_new_tokens"] for g, r in zip(gens, reqs) if g.finish_reason == "length")
    assert all(any(tokens for tokens, _ in run.drafts) for run in batch.runs[1:])  # (compared: not empty)
    assert any(parents for _, parents in batch.runs[4].drafts)  # model-tree's trees
    # The drafts were used: accepted and rejected, by the draft models too.
    assert sum(g.stats.accepted_draft_tokens for g in gens[2:6]) > 0
    assert sum(g.stats.drafted_tokens - g.stats.accepted_draft_tokens for g in gens) > 0


@pytest.mark.parametrize("dtype", ["int8", "q4", "q4a8", "fp32", "bf16"])
def test_one_forward_over_several_caches_gives_each_its_own_bits(models, dtype):
    """``forward_many`` over four caches of one model (a prefill chunk, a chain, a tree, one token; logits of all
    rows, the last ones, none): each cache's logits, hidden rows and next state are bit for bit its forward alone."""
    from speculate.models.kv import Rows, forward_many

    target = models[dtype]
    if isinstance(target, Exception):
        pytest.skip(f"q4 does not load here: {target}")
    prefixes = [random_prompt(80 + j, n) for j, n in enumerate((3, 17, 9, 30))]
    news = [(torch.tensor(random_prompt(90, 6)), None, 0), (torch.tensor(random_prompt(91, 5)), None, None),
            (torch.tensor(random_prompt(92, 7)), [-1, 0, 0, 1, -1, 4, 2], None), (torch.tensor([42]), None, 1)]

    def caches():
        kvs = [KVModel(target) for _ in prefixes]
        for kv, prefix in zip(kvs, prefixes):
            kv.reset(16)  # (the batched rows grow the caches past their capacity)
            kv.forward(torch.tensor(prefix))
        return kvs

    kvs = caches()
    together = forward_many([Rows(kv, tokens, parents, want) for kv, (tokens, parents, want) in zip(kvs, news)])
    hidden = [kv.hidden.clone() for kv in kvs]
    after = [kv.forward(torch.tensor([7])) for kv in kvs]  # the caches the batched forward wrote
    for j, (kv, (tokens, parents, want)) in enumerate(zip(caches(), news)):
        own = kv.forward(tokens, last=want or 0, tree_parents=parents)
        if want == 0:
            assert together[j] is None
        else:
            assert torch.equal(together[j], own), j
        assert torch.equal(hidden[j], kv.hidden), j
        assert torch.equal(after[j], kv.forward(torch.tensor([7]))), j


def test_random_draft_lengths_per_round_and_one_decoder_reused(models):
    """``ks`` overrides each run's draft length for one round (random here, 0 included): the answers stay the
    requests' own. A decoder whose run ended starts the next run cleanly (a server's pool reuses them)."""
    target, near = models["int8"], models["near"]
    rng = random.Random(3)
    table: dict[tuple[int, int], int] = {}

    def ks(s, i):
        return table.setdefault((s, i), rng.randrange(0, 7))

    reqs = [Request(maker(target, "model", near, k=4), dict(prompt=random_prompt(10, 11), max_new_tokens=30)),
            Request(maker(target, "lookup", k=4), dict(prompt=random_prompt(11, 5) * 5, max_new_tokens=35)),
            Request(maker(target, "model-tree", near, k=4), dict(prompt=random_prompt(12, 4), max_new_tokens=25)),
            Request(maker(target, "none"), dict(prompt=random_prompt(13, 8), max_new_tokens=20))]
    batch = run_batch(reqs, ks=ks)
    assert_same_as_alone(batch, reqs, same_drafts=False)
    stats = [run.generation.stats for run in batch.runs]
    assert sum(st.accepted_draft_tokens for st in stats) > 0
    # Drafts never deeper than the round's ks (the draft model's chain and tree; lookup's copies may grow past it).
    assert max(len(stats[i].drafted_by_position) for i in (0, 2)) <= 6
    # The same decoders again, in another batch: each decoder's second run is a fresh generation.
    refs = [run.generation.token_ids for run in batch.runs]
    decoders = [r.make() for r in reqs]
    for _ in range(2):
        again = [Request(lambda d=d: d, r.kwargs, join=j) for j, (d, r) in enumerate(zip(decoders, reqs))]
        assert [run.generation.token_ids for run in run_batch(again).runs] == refs


def test_self_drafting_heads_with_and_without_tapped_layers_batched_equal_alone(tiny_folders, tmp_path):
    """Random Medusa and EAGLE heads on a tiny int8 target, one EAGLE head fused over a tapped layer (its rows carry
    that layer's outputs beside the hidden rows: the forward computes the union of the runs' taps and gives each run
    its own), batched with plain and lookup runs: the same drafts and answers as alone."""
    from speculate.drafters.eagle import EagleDrafter
    from speculate.drafters.medusa import MedusaDrafter
    from speculate.heads import save_heads
    from test_heads import FUSED, random_heads

    target = load_model(str(tiny_folders[2]), dtype="int8")
    folders = {}
    for kind, layers in (("medusa", ()), ("eagle", ()), ("fused", FUSED)):
        folders[kind] = tmp_path / kind
        heads = random_heads("medusa" if kind == "medusa" else "eagle", target, None, seed=3, feature_layers=layers)
        save_heads(folders[kind], heads, target.name, 259)
    drafters = {"medusa": lambda: MedusaDrafter(target, folders["medusa"], tree=True),
                "eagle": lambda: EagleDrafter(target, folders["eagle"], tree=True),
                "fused": lambda: EagleDrafter(target, folders["fused"], tree=False),
                "fused tree": lambda: EagleDrafter(target, folders["fused"], tree=True)}
    assert drafters["fused"]().feature_layers == FUSED and drafters["eagle"]().feature_layers == ()
    reqs = [Request(maker(target, make, k=3), dict(prompt=random_prompt(100 + j, 6 + 5 * j), max_new_tokens=20),
                    prefill_chunk=4 if j % 2 else None, join=j % 3, name=name)
            for j, (name, make) in enumerate(drafters.items())]
    reqs += [Request(maker(target, "none"), dict(prompt=random_prompt(110, 5), max_new_tokens=15), name="none"),
             Request(maker(target, "lookup"), dict(prompt=random_prompt(111, 4) * 3, max_new_tokens=18), join=1,
                     name="lookup")]
    batch = run_batch(reqs)
    assert max(batch.sizes) == len(reqs)
    assert_same_as_alone(batch, reqs)
    assert all(any(tokens for tokens, _ in run.drafts) for run in batch.runs[:4])


# ----------------------------------------------------------------------------------- 2. the default model
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."}],
    [{"role": "user", "content": "Give me three tips for a good night's sleep."}],
    "Speculative decoding lets a small draft propose several tokens that the large target model then checks",
]


@pytest.fixture(scope="module")
def default_int8(default_model):
    return load_model(dtype="int8")


@pytest.mark.slow
def test_default_model_int8_drafters_batched_equal_alone(default_int8):
    """The default model at int8: lookup, retrieval, the shipped EAGLE tree and Medusa heads (and plain), each on 4
    prompts, all 20 runs in one batch (some prefilling in chunks): every answer is the request's own alone."""
    target = default_int8
    drafters = ["none", "lookup", "retrieval", "eagle", "medusa"]
    reqs = []
    for d, name in enumerate(drafters):
        for p, prompt in enumerate(PROMPTS):
            kwargs = dict(prompt=prompt, max_new_tokens=24)
            if isinstance(prompt, str):
                kwargs["chat"] = False
            reqs.append(Request(maker(target, name, k=4), kwargs, prefill_chunk=16 if (d + p) % 3 == 0 else None,
                                join=(d + p) % 2, name=f"{name} {p}"))
    batch = run_batch(reqs)
    assert max(batch.sizes) == len(reqs)
    # Alone, one decoder per drafter (as a single-request user would): the same answers.
    refs = {}
    for name in drafters:
        decoder = maker(target, name, k=4)()
        for p, prompt in enumerate(PROMPTS):
            refs[name, p] = alone_with_drafts(Request(lambda: decoder, dict(
                prompt=prompt, max_new_tokens=24, chat=False if isinstance(prompt, str) else None)))
    for run, r in zip(batch.runs, reqs):
        name, p = r.name.split()
        ref, drafts = refs[name, int(p)]
        assert run.error is None and run.generation.token_ids == ref.token_ids, r.name
        assert run.drafts == drafts, r.name  # the heads drafted from the same features
    assert "Paris" in refs["none", 0][0].text
    accepted = Counter()
    for run, r in zip(batch.runs, reqs):
        accepted[r.name.split()[0]] += run.generation.stats.accepted_draft_tokens
    assert all(accepted[name] > 0 for name in drafters[1:]), accepted  # every drafter's drafts were used


# ----------------------------------------------------------------------------------------- 3. sampling
SAMPLED = dict(temperature=0.8, top_p=0.9)


def test_seeded_sampling_batched_equals_alone(models):
    target, near = models["int8"], models["near"]
    prompt = random_prompt(20, 6)
    reqs = [Request(maker(target, "model", near, k=4, verifier=None), dict(prompt=prompt, max_new_tokens=30, seed=7,
                                                                          **SAMPLED), name="model 7"),
            Request(maker(target, "model", near, k=4, verifier=None), dict(prompt=prompt, max_new_tokens=30, seed=8,
                                                                          **SAMPLED), name="model 8"),
            Request(maker(target, "lookup", k=5, verifier=None), dict(prompt=random_prompt(21, 5) * 4,
                                                                      max_new_tokens=30, seed=3, **SAMPLED),
                    prefill_chunk=4, name="lookup"),
            Request(maker(target, "model-tree", near, k=3, verifier=None), dict(prompt=prompt, max_new_tokens=25,
                                                                               seed=7, **SAMPLED), join=2,
                    name="model-tree"),
            Request(maker(target, "model+lookup", near, k=4, verifier=None),
                    dict(prompt=random_prompt(22, 7) * 3, max_new_tokens=30, seed=11, **SAMPLED), name="model+lookup"),
            Request(maker(target, "none", verifier=None), dict(prompt=prompt, max_new_tokens=20, seed=7, **SAMPLED),
                    join=3, name="none"),
            Request(maker(target, "lookup", k=4), dict(prompt=random_prompt(23, 9), max_new_tokens=28), name="greedy")]
    batch = run_batch(reqs)
    assert_same_as_alone(batch, reqs)
    gens = [run.generation for run in batch.runs]
    assert gens[0].token_ids != gens[1].token_ids  # the seeds matter: it did sample
    assert all(any(tokens for tokens, _ in run.drafts) for run in batch.runs[:5])
    assert sum(g.stats.accepted_draft_tokens for g in gens[:5]) > 0
    assert sum(g.stats.drafted_tokens - g.stats.accepted_draft_tokens for g in gens[:5]) > 0


def test_batched_speculative_sampling_matches_the_target_distribution(models):
    """Distribution of the first two sampled tokens over 2000 seeded runs, 25 at a time in one batch (draft model
    and lookup drafters, lossless ``sample``, drafts of 2 tokens), against the int8 target's exact warped
    distribution computed from the model. Chi-square at significance 1e-3."""
    target, near = models["int8"], models["near"]
    # A prompt that ends in the target's own greedy continuation, which repeats one token: lookup's copies are
    # in the target's support (accepted often, not always).
    start = random_prompt(36, 4)
    prompt = start + SpeculativeDecoder(target, SpeculativeSpec("none")).generate(start, max_new_tokens=24).token_ids
    s = SamplingParams(temperature=1.5, top_k=4)
    kv = KVModel(target)
    kv.reset()
    p1 = warp(kv.forward(torch.tensor(prompt))[-1:], s)[0]
    exact = {}
    for a in p1.nonzero()[:, 0].tolist():
        kv.reset()
        p2 = warp(kv.forward(torch.tensor(prompt + [a]))[-1:], s)[0]
        for b in p2.nonzero()[:, 0].tolist():
            exact[a, b] = float(p1[a] * p2[b])
    assert len(exact) > 4  # a distribution worth testing
    width = 25
    decoders = [maker(target, "model", near, k=3, verifier="sample")() if j % 2 == 0 else
                maker(target, "lookup", k=3, verifier="sample")() for j in range(width)]
    n = 2000
    counts, drafted, accepted = Counter(), Counter(), Counter()
    for lo in range(0, n, width):
        reqs = [Request(lambda d=d: d, dict(prompt=prompt, max_new_tokens=3, temperature=1.5, top_k=4, seed=lo + j))
                for j, d in enumerate(decoders)]
        batch = run_batch(reqs)
        for j, run in enumerate(batch.runs):
            counts[tuple(run.generation.token_ids[:2])] += 1
            drafted[j % 2] += run.generation.stats.drafted_tokens
            accepted[j % 2] += run.generation.stats.accepted_draft_tokens
    assert set(counts) <= set(exact)
    total = sum(exact.values())
    keys = sorted(exact, key=lambda key: -exact[key])
    big = [key for key in keys if exact[key] / total * n >= 5]  # the rest pooled into one bin
    observed = [counts.get(key, 0) for key in big]
    expected = [exact[key] / total * n for key in big]
    if len(big) < len(keys):
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    assert sstats.chisquare(observed, expected).pvalue > 1e-3
    # Both drafters drafted, and their drafts were both accepted and rejected.
    for j in (0, 1):
        assert 0 < accepted[j] < drafted[j], (j, accepted, drafted)


# ----------------------------------------------------------------------------- 4. joining and leaving
class FailingDrafter(Drafter):
    """Prompt lookup that raises at its ``at``-th proposal (or, ``in_update``, at its ``at``-th verdict)."""

    name = "failing"

    def __init__(self, at: int = 3, in_update: bool = False):
        self.inner, self.at, self.in_update, self.calls = LookupDrafter(), at, in_update, 0

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.inner.begin(prompt_ids, sampling, generator)

    def max_nodes(self, k):
        return self.inner.max_nodes(k)

    def _count(self, where):
        if self.in_update == (where == "update"):
            self.calls += 1
            if self.calls == self.at:
                raise RuntimeError(f"drafter broke at {where} {self.at}")

    def propose(self, tokens, k):
        self._count("propose")
        return self.inner.propose(tokens, k)

    def update(self, n_accepted, next_token, path=None):
        self._count("update")
        self.inner.update(n_accepted, next_token, path)


def test_runs_join_leave_are_cancelled_and_fail_without_touching_the_others(models, monkeypatch):
    target, near = models["int8"], models["near"]
    free = maker(target, "lookup", k=4)().generate("ab ab ab ab", max_new_tokens=40).text
    stop = free[12:15]  # a stop string inside that answer: the batched run must end right before it
    assert len(stop) == 3
    reqs = [
        Request(maker(target, "model", near, k=4), dict(prompt=random_prompt(40, 12), max_new_tokens=40), name="long"),
        Request(maker(target, "lookup", k=4), dict(prompt=random_prompt(41, 5) * 3, max_new_tokens=3),
                name="early"),  # finishes in a round or two and leaves
        Request(maker(target, "none"), dict(prompt=random_prompt(42, 30), max_new_tokens=1), prefill_chunk=4,
                name="one token"),
        Request(maker(target, "none"), dict(prompt=random_prompt(43, 6), max_new_tokens=0), join=2,
                name="nothing"),  # done at its prefill
        Request(maker(target, "none"), dict(prompt=[7], max_new_tokens=0), join=1, name="done at start"),
        Request(maker(target, "model-tree", near, k=3), dict(prompt=random_prompt(44, 8), max_new_tokens=30),
                join=3, name="joins"),
        Request(maker(target, "model+lookup", near, k=4), dict(prompt=random_prompt(45, 6) * 2, max_new_tokens=25),
                join=7, prefill_chunk=3, name="joins late"),
        Request(maker(target, "model", near, k=4), dict(prompt=random_prompt(46, 9), max_new_tokens=40), join=1,
                cancel=6, name="cancelled"),
        Request(maker(target, lambda: FailingDrafter(3), k=3), dict(prompt=random_prompt(47, 7) * 2,
                                                                    max_new_tokens=40), join=1, name="fails"),
        Request(maker(target, lambda: FailingDrafter(2, in_update=True), k=3),
                dict(prompt=random_prompt(48, 7) * 2, max_new_tokens=40), name="fails in update"),
        Request(maker(target, "lookup", k=4), dict(prompt="ab ab ab ab", max_new_tokens=40, stop=["zzz", stop]),
                join=4, name="stop string"),
    ]
    names = [r.name for r in reqs]
    counted = CountForwards(monkeypatch, target)
    batch = run_batch(reqs)
    # One forward a step over every run still in the list, but the one whose drafter raised before it.
    assert len(counted.caches) == len(batch.sizes)
    assert all(c <= n for c, n in zip(counted.caches, batch.sizes))
    assert sum(batch.sizes) - sum(counted.caches) == 1
    monkeypatch.undo()
    assert len(set(batch.sizes)) > 3  # the batch grew and shrank
    fails, fails_update = names.index("fails"), names.index("fails in update")
    assert_same_as_alone(batch, reqs, skip={fails, fails_update})
    # The failed runs: ended with their drafter's error, no generation; what they had committed was the
    # request's own answer so far (greedy: the target's).
    for i, where in ((fails, "propose 3"), (fails_update, "update 2")):
        run = batch.runs[i]
        assert run.done and run.generation is None
        assert isinstance(run.error, RuntimeError) and str(run.error) == f"drafter broke at {where}"
        plain = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(**reqs[i].kwargs).token_ids
        got = run.tokens[run.prompt_tokens:]
        assert got == plain[: len(got)]
    # Alone, the error is raised to the caller.
    with pytest.raises(RuntimeError, match="drafter broke at propose 3"):
        alone(reqs[fails])
    # The cancelled run stopped where it was dropped, part-way.
    cancelled = batch.runs[names.index("cancelled")]
    assert batch.cancelled == [names.index("cancelled")] and not cancelled.done
    assert 0 < cancelled.produced < 40
    gens = {r.name: run.generation for r, run in zip(reqs, batch.runs) if run.generation is not None}
    assert gens["nothing"].token_ids == [] and gens["done at start"].token_ids == []
    assert gens["nothing"].text == gens["done at start"].text == "" and gens["done at start"].prompt_tokens == 1
    assert len(gens["one token"].token_ids) == 1 and len(gens["early"].token_ids) == 3
    assert gens["stop string"].finish_reason == "stop" and gens["stop string"].text == free[: free.find(stop)]


def test_a_done_run_cannot_be_confused_with_a_live_one(models):
    """A run that ends in a step reports done right after it; the others of that step are still live."""
    target = models["int8"]
    short = maker(target, "none")().start(random_prompt(50, 3), max_new_tokens=1)
    long = maker(target, "none")().start(random_prompt(51, 3), max_new_tokens=5)
    step([short, long])  # the prefill, and each one's first token
    assert short.done and short.generation.stats.new_tokens == 1 and not long.done and long.produced == 1
    step([short, long])
    assert short.generation.stats.new_tokens == 1 and long.produced == 2
    for _ in range(3):
        step([long])
    assert long.done and len(long.generation.token_ids) == 5


def test_generate_with_nothing_to_do_returns_an_empty_generation(models):
    """A run done at its start (max_new_tokens 0 and nothing to prefill: a one-token prompt, or a prefix_cache hit)
    is an empty generation, alone too; and a step over a done run leaves it as it was."""
    decoder = maker(models["int8"], "none")()
    assert decoder.start([7], max_new_tokens=0).generation.token_ids == []  # (the Run is fine)
    out = decoder.generate([7], max_new_tokens=0)
    assert out is not None and out.token_ids == [] and out.finish_reason == "length"
    run = decoder.start([7, 8, 9], max_new_tokens=2)
    while not run.done:
        step([run])
    before = run.generation
    assert step([run]) == [[]] and run.generation is before and len(run.generation.token_ids) == 2


@pytest.mark.parametrize("drafter", ["none", "lookup", "suffix-tree", "model"])
def test_the_round_that_completes_the_prompt_gives_the_first_token(models, drafter):
    """The prompt's last prefill chunk goes in with the first draft (``Run.joins``): the first token comes from the
    round that completes the prompt, ceil(prompt_end / chunk) rounds after the start, not one round later; chains
    and trees, a draft model's too; every answer the request's plain one. The heads (they draft from the prompt's
    hidden rows) and a scored prompt keep their own round."""
    target = models["int8"]
    prompt = random_prompt(30, 25) * 2  # (repeats: lookup and the suffix tree draft from the first round)
    plain = maker(target, "none")().generate(prompt, max_new_tokens=24).token_ids
    for chunk in (16, 49, 1000):
        decoder = maker(target, drafter, models["near"] if drafter == "model" else None, k=4)()
        run = decoder.start(prompt, max_new_tokens=24, prefill_chunk=chunk)
        rounds = 0
        while run.produced == 0:
            step([run])
            rounds += 1
        assert rounds == -(-(len(prompt) - 1) // chunk), (drafter, chunk)
        drafted = run.stats.drafted_tokens
        while not run.done:
            step([run])
        assert run.generation.token_ids == plain, (drafter, chunk)
        if drafter in ("lookup", "suffix-tree") and chunk == 1000:
            assert drafted > 0  # (the first round verified a draft beside the prompt)
    scored = maker(target, "lookup")().start(prompt, max_new_tokens=4, prompt_logprobs=1)
    assert not scored.joins and scored.prefilling  # (its prompt's rows all scored: a round of their own)


# ---------------------------------------------------------------------------------------------- 5. fp32
def test_fp32_on_pytorchs_matmuls_runs_to_the_right_lengths_and_stays_greedy(tiny_folders, monkeypatch):
    """fp32 where the kernel does not build (SPECULATE_NO_KERNEL: PyTorch's matmuls and attention): rows are not
    batch-invariant, so no bit-exactness is promised (stats say ``exactness`` none). What holds: one forward a step,
    each run to its length, a batched forward's rows close to each run's own, and every greedy token the target's
    argmax up to rounding (its logit within 1e-3 of the row's maximum, scored afresh). (Through the kernel, fp32 is
    exact: the tests above run it.)"""
    with monkeypatch.context() as patch:
        patch.setenv("SPECULATE_NO_KERNEL", "1")
        target = load_model(str(tiny_folders[0]), dtype="fp32")
        KVModel(target)  # (its lean model, made now: PyTorch's layers and attention from here on)
    draft = noisy_copy(target, 0.1)
    reqs = [Request(maker(target, "none"), dict(prompt=random_prompt(60, 5), max_new_tokens=20)),
            Request(maker(target, "lookup", k=4), dict(prompt=random_prompt(61, 6) * 3, max_new_tokens=30),
                    prefill_chunk=5),
            Request(maker(target, "model", draft, k=3), dict(prompt=random_prompt(62, 9), max_new_tokens=25), join=2),
            Request(maker(target, "model-tree", draft, k=3), dict(prompt=random_prompt(63, 4), max_new_tokens=15)),
            Request(maker(target, "model", draft, k=4, verifier=None),
                    dict(prompt=random_prompt(64, 7), max_new_tokens=22, seed=1, **SAMPLED))]
    counted = CountForwards(monkeypatch, target)
    batch = run_batch(reqs)
    assert counted.caches == batch.sizes and max(batch.sizes) == len(reqs)
    monkeypatch.undo()
    for run, r, pieces in zip(batch.runs, reqs, batch.pieces):
        g = run.generation
        assert run.error is None and g.stats.exactness == "none"
        assert "".join(pieces) == g.text
        assert len(g.token_ids) == r.kwargs["max_new_tokens"] or g.finish_reason == "stop"
        if "seed" in r.kwargs:
            continue
        with torch.no_grad():
            logits = target.model(torch.tensor([r.kwargs["prompt"] + g.token_ids])).logits[0].float()
        rows = logits[len(r.kwargs["prompt"]) - 1: -1]
        chosen = rows.gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert (rows.max(-1).values - chosen).max() < 1e-3
    # One batched forward over three caches against each cache's own forward: close, not necessarily equal.
    from speculate.models.kv import Rows, forward_many

    kvs = [KVModel(target) for _ in range(3)]
    prompts = [random_prompt(70 + j, 4 + 3 * j) for j in range(3)]
    for kv in kvs:
        kv.reset()
    together = forward_many([Rows(kv, torch.tensor(p)) for kv, p in zip(kvs, prompts)])
    for kv, p, rows in zip(kvs, prompts, together):
        kv.reset()
        torch.testing.assert_close(rows, kv.forward(torch.tensor(p)), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ 6. other code paths
@pytest.mark.skipif(os.environ.get("SPECULATE_KERNEL_FLAGS") is not None, reason="already another code path")
@pytest.mark.parametrize("env", [
    {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
     "SPECULATE_KERNEL_FLAGS": "-march=x86-64-v3 -mprefer-vector-width=256"},  # what an AVX2-only CPU runs
    {"SPECULATE_KERNEL_FLAGS": "-march=x86-64-v2"},  # the kernels' scalar loops
], ids=["avx2", "scalar-kernels"])
def test_batched_equals_alone_under_other_code_paths(env, tmp_path):
    """The batched-equals-alone tests again in a fresh process, under ATen's and MKL's AVX2 paths with the kernels
    built for AVX2, and with the kernels' scalar loops: exactness may not rest on this CPU's fastest kernels."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 code paths")
    here = Path(__file__).resolve()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here), "-m", "not slow",
                           "-k", "mixed_drafters or several_caches or seeded_sampling_batched or join_leave"],
                          env={**os.environ, **env, "SPECULATE_CACHE": str(tmp_path)}, cwd=here.parent.parent,
                          capture_output=True, text=True, timeout=600)
    assert_pytest_passed(done, skipped=False)


# ------------------------------------------------------------------------------- preempted and resumed
def assert_preempted_runs_equal_alone(target, reqs, stretch=256):
    """Admission by memory (server/scheduler.py) with a budget too small for every generation's whole cache: each of
    ``reqs`` ((drafter, draft model, prompt, new tokens)) reserves a ``stretch`` of positions at a time (a draft
    model's cache takes 256 at first), the youngest is preempted where the next stretch does not fit, and resumes
    later on another decoder (its tokens prefilled again). Every answer is token for token the request alone, the
    reservations never pass the budget, preemptions happened mid-answer, and each request's text and
    log-probabilities went to its handler once."""
    import threading
    import time

    from speculate.models.kv import position_bytes
    from speculate.server.scheduler import Job, Scheduler

    def ids(prompt):  # (text prompts as raw text, not a chat)
        return prompt if isinstance(prompt, list) else target.tokenizer.encode(prompt, add_special_tokens=False)

    alone = [maker(target, d, m, k=3)().generate(ids(p), SamplingParams(max_new_tokens=n)).token_ids
             for d, m, p, n in reqs]
    events, lock, made, resumed_at = [], threading.Lock(), [], []

    class Recorded(Job):
        def __init__(self, i):
            drafter, draft, prompt, n = reqs[i]
            prompt = ids(prompt)
            pb = position_bytes(target) + (position_bytes(draft) if draft is not None else 0)

            def open(resume=None, reserve=None):  # a fresh decoder each time: a resumed run recomputes its tokens
                decoder = maker(target, drafter, draft, k=3)()
                made.append(i)
                if resume is None:  # (the scheduler sends log-probabilities as a stream asks for them)
                    sampling = SamplingParams(max_new_tokens=n, logprobs=1)
                    return decoder.start(prompt, sampling, reserve=reserve), lambda: None
                resumed_at.append(resume.produced)
                resume.resume(decoder, None, reserve)
                return resume, lambda: None

            super().__init__(open, loop=None, prompt_tokens=len(prompt), kv_bytes=pb * (len(prompt) + n + 20),
                             position_bytes=pb)
            self.i = i

        def emit(self, kind, value=None):
            with lock:
                events.append((self.i, kind, value))

    jobs = [Recorded(i) for i in range(len(reqs))]
    # Room for every first stretch (the prompt and a stretch, in the cache's 64-position blocks) and one more
    # stretch of a target's cache: not for every generation's whole cache.
    first = [-(-(job.prompt_tokens + stretch) // 64) * 64 * job.position_bytes for job in jobs]
    budget = sum(first) + stretch * position_bytes(target)
    assert budget < sum(job.kv_bytes for job in jobs) and max(job.kv_bytes for job in jobs) <= budget
    sched = Scheduler(max_batch=len(reqs), max_queue=8, kv_budget=budget, stretch=stretch)
    reserved = []
    sched.on_round = lambda n, rows, seconds: reserved.append((n, sched.kv_reserved))
    sched.submit(*jobs)
    sched.start()
    try:
        deadline = time.monotonic() + 900  # (a hang guard, not a timing: 300 s tripped on a loaded 2-core machine)
        while sum(kind == "done" for _, kind, _ in events) < len(reqs):
            assert time.monotonic() < deadline and not any(kind == "error" for _, kind, _ in events), events
            time.sleep(0.01)
    finally:
        sched.stop()
    done = {i: value.generation for i, kind, value in events if kind == "done"}
    assert [done[i].token_ids for i in range(len(reqs))] == alone
    assert sched.preempted >= 1 and len(made) == len(reqs) + sched.preempted  # (each resumption a new decoder)
    assert len(resumed_at) == sched.preempted and max(resumed_at) > 0  # (resumed mid-answer)
    assert [len(ids) for ids in alone] == [n for *_, n in reqs]  # (long enough answers to grow past a stretch)
    assert max(n for n, _ in reserved) == len(reqs)  # all ran at once on their first stretches...
    assert max(r for _, r in reserved) <= budget and sched.kv_reserved == 0  # ...never past the budget
    for i in range(len(reqs)):  # a resumed job is announced once; its text and log-probabilities go out once
        assert [kind for j, kind, _ in events if j == i].count("ready") == 1
        assert "".join(value for j, kind, value in events if j == i and kind == "piece") == done[i].text
        scored = [lp for j, kind, value in events if j == i and kind == "logprobs" for lp in value]
        assert [lp.token for lp in scored] == done[i].token_ids


@pytest.mark.parametrize("dtype", ["int8", "q4"])
def test_preempted_and_resumed_answers_equal_each_request_alone(models, dtype):
    """Preemption on tiny random models, with drafters that draft a chain, a tree, copies and nothing."""
    target = models[dtype]
    if isinstance(target, Exception):
        pytest.skip(f"q4 does not load here: {target}")
    near = models["near"]
    assert_preempted_runs_equal_alone(target, [
        ("lookup", None, random_prompt(11, 9) * 3, 450),
        ("none", None, random_prompt(12, 20), 420),
        ("model-tree", near, random_prompt(13, 7), 400),
        ("model", near, random_prompt(14, 30), 380),
    ])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q4", "int8"])
def test_default_model_preempted_and_resumed_answers_equal_alone(dtype, default_int8):
    """Preemption on the default model at q4 (the default) and int8: raw-text continuations of 300 tokens with
    lookup, retrieval and plain decoding, 64-position stretches, each answer the request's own alone."""
    from speculate.bench.speed import PARAGRAPHS

    target = default_int8 if dtype == "int8" else load_model(dtype="q4")
    assert_preempted_runs_equal_alone(target, [
        ("lookup", None, PARAGRAPHS[0], 300),
        ("none", None, PARAGRAPHS[2], 300),
        ("retrieval", None, PARAGRAPHS[2], 300),
        ("none", None, PARAGRAPHS[0], 300),
    ], stretch=64)
