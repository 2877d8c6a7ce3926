"""The engine on tiny random models: exactness, stops, rollback, trees, sampling, streaming."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from scipy import stats as sstats

from speculate import SpeculateError, SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.drafters import get_drafter
from speculate.drafters.base import Draft, Drafter
from speculate.models.kv import KVModel
from speculate.sampling import SamplingParams, warp
from conftest import noisy_copy


class OracleDrafter(Drafter):
    """Proposes the known greedy continuation with random corruptions: long accepted drafts, rejections
    at random positions, and drafts that run past stops: every path of the accept/roll-back logic."""

    name = "oracle"

    def __init__(self, prompt_len, reference, corrupt=0.3, seed=0, vocab=259):
        self.prompt_len, self.reference, self.corrupt, self.vocab = prompt_len, reference, corrupt, vocab
        self.rng = random.Random(seed)

    def propose(self, tokens, k):
        done = len(tokens) - self.prompt_len
        out = list(self.reference[done: done + k])
        out += [self.rng.randrange(self.vocab) for _ in range(k - len(out))]
        out = [self.rng.randrange(self.vocab) if self.rng.random() < self.corrupt else t for t in out]
        return Draft(torch.tensor(out, dtype=torch.long))


def random_prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def plain(model, prompt, n, **kw):
    return SpeculativeDecoder(model, SpeculativeSpec("none")).generate(prompt, max_new_tokens=n, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_oracle_drafts_equal_plain_decoding(tiny, seed, k):
    model = tiny[seed]
    for n_prompt, n_new in [(1, 9), (7, 40), (30, 23)]:
        prompt = random_prompt(seed * 100 + k + n_prompt, n_prompt)
        ref = plain(model, prompt, n_new)
        for corrupt in (0.0, 0.3):
            drafter = OracleDrafter(len(prompt), ref.token_ids, corrupt, seed=k)
            out = SpeculativeDecoder(model, SpeculativeSpec(verifier="greedy", k=k),
                                     drafter=drafter).generate(prompt, max_new_tokens=n_new)
            assert out.token_ids == ref.token_ids
            assert out.stats.new_tokens == n_new
            if corrupt == 0.0:  # every draft right: ceil(n / (k+1)) rounds
                assert out.stats.target_calls == math.ceil(n_new / (k + 1))


def test_greedy_decoding_is_the_targets_own_argmax_token_by_token(tiny):
    """Plain greedy decoding (the reference of the tests above) and speculative decoding each give, at every step, the
    argmax of the target's logits over the whole text so far, from a fresh forward: whatever form the engine hands the
    greedy verifier (engine.py, ``_verify``: the logits themselves, unwarped), it reads their argmax."""
    model = tiny[1]
    prompt = random_prompt(7, 9)
    kv, ids = KVModel(model), list(prompt)
    for _ in range(20):
        kv.reset()
        ids.append(int(kv.forward(torch.tensor(ids), last=1)[-1].argmax()))
    assert plain(model, prompt, 20).token_ids == ids[len(prompt):]
    lookup = SpeculativeDecoder(model, SpeculativeSpec("lookup", verifier="greedy", k=3))
    assert lookup.generate(prompt, max_new_tokens=20).token_ids == ids[len(prompt):]


def test_stats_split_the_decoding_time(tiny):
    """Stats.target_seconds / draft_seconds / first_draft_seconds (the costed speedup model's terms,
    calc/results.py): a drafter that sleeps 20 ms a proposal is charged at least that for every round, the first
    round's apart, and the parts never exceed the decoding time."""
    import time

    class Slow(OracleDrafter):
        def propose(self, tokens, k):
            time.sleep(0.02)
            return super().propose(tokens, k)

    prompt = random_prompt(5, 7)
    ref = plain(tiny[0], prompt, 24)
    assert ref.stats.prompt_tokens == 7 and ref.stats.target_seconds > 0
    out = SpeculativeDecoder(tiny[0], SpeculativeSpec(verifier="greedy", k=3),
                             drafter=Slow(len(prompt), ref.token_ids, 0.3)).generate(
        prompt, max_new_tokens=24)
    s = out.stats
    assert s.first_draft_seconds >= 0.02 and s.draft_seconds >= 0.02 * (s.target_calls - 1)
    assert 0 < s.target_seconds and s.target_seconds + s.draft_seconds + s.first_draft_seconds <= \
        s.wall_seconds - s.prefill_seconds
    assert {"target_seconds", "draft_seconds", "first_draft_seconds", "prompt_tokens"} <= set(s.to_dict())


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_model_and_lookup_drafters_equal_plain_decoding(tiny, k):
    target = tiny[0]
    draft = noisy_copy(target, 0.1)
    accepted = 0
    for seed in range(3):
        # Repetitive prompts so that lookup finds matches.
        prompt = random_prompt(seed, 6) * 4
        ref = plain(target, prompt, 48)
        for drafter in (get_drafter("lookup"), get_drafter("model", draft, target)):
            out = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=k),
                                     drafter=drafter).generate(prompt, max_new_tokens=48)
            assert out.token_ids == ref.token_ids, drafter.name
            accepted += out.stats.accepted_draft_tokens
    assert accepted > 0  # the drafts were not all rejected: acceptance paths were exercised


@pytest.mark.parametrize("name", ["model", "model-tree", "model+lookup"])
def test_draft_model_drafters_at_the_smallest_budgets(tiny, name):
    """max_new_tokens 1 leaves no room for a draft (k = 0 in the first and only round): the drafter's
    rollback must still work (model drafters once failed here, never having drafted)."""
    target = tiny[0]
    prompt = random_prompt(5, 6) * 2
    for n in (1, 2, 3):
        ref = plain(target, prompt, n)
        out = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=3),
                                 drafter=get_drafter(name, noisy_copy(target, 0.1),
                                                     target)).generate(prompt, max_new_tokens=n)
        assert out.token_ids == ref.token_ids


def test_stop_inside_an_accepted_draft(tiny):
    model = tiny[1]
    prompt = random_prompt(5, 5)
    ref = plain(model, prompt, 40)
    # EOS: pretend the 13th token is an end-of-sequence id; an all-correct k=8 draft covers it.
    decoder = SpeculativeDecoder(model, SpeculativeSpec(verifier="greedy", k=8),
                                 drafter=OracleDrafter(len(prompt), ref.token_ids, 0.0))
    cut = ref.token_ids[12]
    first = ref.token_ids.index(cut)
    decoder.eos = {cut}
    out = decoder.generate(prompt, max_new_tokens=40)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stats.new_tokens == first + 1
    # max_new_tokens: exactly that many, even though the drafts would go on.
    out = SpeculativeDecoder(model, SpeculativeSpec(verifier="greedy", k=8),
                             drafter=OracleDrafter(len(prompt), ref.token_ids, 0.0)).generate(
        prompt, max_new_tokens=11)
    assert out.token_ids == ref.token_ids[:11] and out.finish_reason == "length"
    # A stop string in the middle of the text: the text ends right before it, nothing after is emitted.
    text = ref.text
    stop = text[15:18]
    assert stop and text.find(stop) >= 0
    out = SpeculativeDecoder(model, SpeculativeSpec(verifier="greedy", k=8),
                             drafter=OracleDrafter(len(prompt), ref.token_ids, 0.0)).generate(
        prompt, max_new_tokens=40, stop=[stop])
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < 40 and out.token_ids == ref.token_ids[: len(out.token_ids)]


@pytest.fixture(params=["fast", "hf", "int8"])
def make_kv(request, tmp_path, monkeypatch):
    """Each KV backend: the lean decoder, the Hugging Face modules, and the lean decoder at int8 (its
    batch-invariant attention keeps chains and trees equal to separate forwards there too)."""
    if request.param == "int8":
        monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))
        return lambda loaded: KVModel(load_model(str(loaded.path), dtype="int8"))
    return lambda loaded: KVModel(loaded, fast=request.param == "fast")


def test_rollback_equals_fresh_forward(tiny, make_kv):
    kv = make_kv(tiny[2])
    prefix = torch.tensor(random_prompt(1, 12))
    draft = torch.tensor([10, 20, 30, 40, 50])
    kv.reset()
    kv.forward(prefix)
    kv.forward(draft)  # verify 5 drafts...
    kv.keep(len(prefix) + 2)  # ...keep two
    after = kv.forward(torch.tensor([99]))[-1]
    kv.reset()
    fresh = kv.forward(torch.cat([prefix, draft[:2], torch.tensor([99])]))[-1]
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)
    assert kv.length == len(prefix) + 3


def test_tree_forward_gives_each_node_its_ancestors(tiny, make_kv):
    kv = make_kv(tiny[0])
    prefix = torch.tensor(random_prompt(2, 9))
    #        node: 0   1   2   3   4   5      tree: 0→1→2, 0→3, 4→5
    tokens = torch.tensor([11, 12, 13, 14, 15, 16])
    parents = [-1, 0, 1, 0, -1, 4]
    kv.reset()
    kv.forward(prefix)
    start = kv.length
    tree = kv.forward(tokens, tree_parents=parents)
    for path in ([0, 1, 2], [0, 3], [4, 5]):
        kv.keep(start)
        chain = kv.forward(tokens[path])
        torch.testing.assert_close(tree[path], chain, rtol=1e-4, atol=1e-4)
    # Keeping one branch of a tree forward = having run that branch alone.
    kv.keep(start)
    kv.forward(tokens, tree_parents=parents)
    kv.keep_path(start, [0, 3])
    after = kv.forward(torch.tensor([7]))[-1]
    kv.keep(start)
    torch.testing.assert_close(after, kv.forward(torch.tensor([11, 14, 7]))[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fast_path_equals_hugging_face(tmp_path, arch):
    """The lean decoder (models/fast.py) against the HF model it shares weights with: prefill, a
    chain, a rollback, a tree and a kept branch, with the cache growing past its first capacity."""
    from speculate.models.fast import FastKVModel
    from speculate.models.kv import HFKVModel
    from speculate.models.tiny import save_tiny_model

    folder = save_tiny_model(tmp_path / arch, seed=4, arch=arch)
    loaded = load_model(str(folder))
    fast, hf = FastKVModel(loaded), HFKVModel(loaded)
    fast.reset(capacity=8)  # forces two reallocations below
    hf.reset()
    steps = [("forward", torch.tensor(random_prompt(6, 20)), None), ("forward", torch.tensor([3, 4, 5]), None),
             ("keep", 21, None), ("forward", torch.tensor([7]), None),
             ("forward", torch.tensor([8, 9, 10, 11]), [-1, 0, 0, 2]), ("keep_path", 22, [0, 2, 3]),
             ("forward", torch.tensor([12, 13]), None)]
    for op, arg, extra in steps:
        if op == "forward":
            a, b = fast.forward(arg, tree_parents=extra), hf.forward(arg, tree_parents=extra)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        elif op == "keep":
            fast.keep(arg), hf.keep(arg)
        else:
            fast.keep_path(arg, extra), hf.keep_path(arg, extra)
        assert fast.length == hf.length


def test_speculative_sampling_end_to_end_matches_the_target(tiny):
    """Distribution of the first two sampled tokens: speculative (model drafter + `sample`) against the
    exact warped target distribution, computed from the model. Chi-square at significance 1e-3."""
    target = tiny[0]
    draft = noisy_copy(target, 0.1)
    prompt = random_prompt(3, 8)
    s = SamplingParams(temperature=1.0, top_k=4)
    with torch.no_grad():
        p1 = warp(target.model(torch.tensor([prompt])).logits[0, -1:], s)[0]
        firsts = p1.nonzero()[:, 0]
        batch = torch.tensor([prompt + [int(t)] for t in firsts])
        p2 = warp(target.model(batch).logits[:, -1], s)
    exact = {(int(a), int(b)): float(p1[a] * p2[i, b]) for i, a in enumerate(firsts) for b in p2[i].nonzero()[:, 0]}
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="sample", k=3),
                                 drafter=get_drafter("model", draft, target))
    n = 2000
    counts = Counter(tuple(decoder.generate(prompt, max_new_tokens=2, temperature=1.0, top_k=4, seed=i).token_ids)
                     for i in range(n))
    assert set(counts) <= set(exact)
    keys = sorted(exact)
    observed = [counts.get(key, 0) for key in keys]
    total = sum(exact.values())
    expected = [exact[key] / total * n for key in keys]
    assert sstats.chisquare(observed, expected).pvalue > 1e-3
    # And the draft was really used: some drafts accepted, some rejected.
    st = decoder.generate(prompt, max_new_tokens=40, temperature=1.0, top_k=4, seed=0).stats
    assert 0 < st.accepted_draft_tokens < st.drafted_tokens


def test_a_prompt_of_the_wrong_shape_is_refused(tiny):
    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup"))
    for prompt in (5, [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}], [], ["a", "b"]):
        with pytest.raises(SpeculateError, match="the prompt must be|the prompt is empty"):
            decoder.generate(prompt, max_new_tokens=2)


def test_a_seed_out_of_torchs_range_is_refused(tiny):
    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup"))
    for seed in (2**64, -(2**63) - 1, 1.5, True):
        with pytest.raises(SpeculateError, match="seed must be an integer"):
            decoder.generate("abc", max_new_tokens=2, seed=seed)
    assert decoder.generate("abc", max_new_tokens=2, seed=2**64 - 1).stats.new_tokens == 2


def test_seeded_runs_reproduce(tiny):
    decoder = SpeculativeDecoder(tiny[1], SpeculativeSpec(verifier="sample", k=4),
                                 drafter=get_drafter("model", noisy_copy(tiny[1], 0.1), tiny[1]))
    prompt = random_prompt(4, 6)
    a = decoder.generate(prompt, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7).token_ids
    b = decoder.generate(prompt, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7).token_ids
    c = decoder.generate(prompt, max_new_tokens=30, temperature=0.8, top_p=0.9, seed=8).token_ids
    assert a == b and a != c


def test_stream_pieces_join_to_the_text(tiny):
    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k=4))
    for stop in (None, ["e"], ["zz", "a b"]):
        stream = decoder.stream("hello there, hello there", max_new_tokens=50, stop=stop)
        pieces = list(stream)
        assert "".join(pieces) == stream.generation.text
        assert stream.generation.text == decoder.generate("hello there, hello there", max_new_tokens=50,
                                                          stop=stop).text


def test_chat_template_and_raw_prompt(tiny):
    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("none"))
    tok = tiny[0].tokenizer
    chat = decoder.generate("hi", max_new_tokens=1)
    assert chat.prompt_tokens == len(tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                            add_generation_prompt=True, return_dict=False))
    raw = decoder.generate("hi", max_new_tokens=1, chat=False)
    assert raw.prompt_tokens == 2
    msgs = decoder.generate([{"role": "user", "content": "hi"}], max_new_tokens=1)
    assert msgs.prompt_tokens == chat.prompt_tokens and msgs.token_ids == chat.token_ids


def test_bad_settings_raise_clear_errors(tiny, tmp_path):
    from speculate.models.tiny import save_tiny_model, tiny_tokenizer

    m = tiny[0]
    with pytest.raises(SpeculateError, match="k must be"):
        SpeculativeDecoder(m, SpeculativeSpec("lookup", k=0))
    with pytest.raises(SpeculateError, match="unknown drafter"):
        SpeculativeDecoder(m, SpeculativeSpec("nope"))
    with pytest.raises(SpeculateError, match="unknown verifier"):
        SpeculativeDecoder(m, SpeculativeSpec("lookup", verifier="nope"))
    with pytest.raises(SpeculateError, match="beta"):
        SpeculativeDecoder(m, SpeculativeSpec("lookup", verifier="consultant", params={"beta": 1.0}))
    d = SpeculativeDecoder(m, SpeculativeSpec("lookup"))
    for kwargs, match in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                          ({"top_p": 1.5}, "top_p"), ({"max_new_tokens": -1}, "max_new_tokens"),
                          ({"max_new_tokens": 5000}, "context window")]:
        with pytest.raises(SpeculateError, match=match):
            d.generate("hi", **kwargs)
    with pytest.raises(SpeculateError, match="empty"):
        d.generate("   ")
    with pytest.raises(SpeculateError, match="greedy"):
        SpeculativeDecoder(m, SpeculativeSpec("lookup", verifier="greedy")).generate("hi", temperature=0.5)
    # A draft model with another tokenizer is refused.
    other = save_tiny_model(tmp_path / "other", seed=9)
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tok.save_pretrained(other)
    from speculate import load_model
    with pytest.raises(SpeculateError, match="tokenizer"):
        SpeculativeDecoder(m, SpeculativeSpec("model"), draft_model=load_model(str(other)))


def test_decoders_on_one_model_share_the_fused_weights(tiny):
    """Every generation's cache computes through one lean model per loaded model (models/fast.py): the fused q/k/v and
    gate/up weights are made once, not per decoder or request; an early-exit view of the target (layerskip: another
    loaded model over the same layers) fuses nothing again."""
    from speculate.drafters.layerskip import early_exit_model

    target = tiny[1]
    before = SpeculativeDecoder(target, SpeculativeSpec("none")).generate("abc", max_new_tokens=8).token_ids
    ptrs = {p.data_ptr() for p in target.model.parameters()}
    decoders = [SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="greedy", k=2)) for _ in range(3)]
    assert len({id(d.new_cache().lean) for d in decoders}) == 1
    short = KVModel(early_exit_model(target, 1))
    assert short.lean is not decoders[0].new_cache().lean
    assert {p.data_ptr() for p in target.model.parameters()} == ptrs
    first = decoders[0].new_cache().lean.layers[0]

    def weight(qkv):  # the fused q/k/v weight a layer computes with: F.linear's, or the kernel's F32 layer's
        return qkv.keywords["weight"] if hasattr(qkv, "keywords") else qkv.__self__.weight

    assert weight(short.lean.layers[0][1]).data_ptr() == weight(first[1]).data_ptr()
    assert all(d.generate("abc", max_new_tokens=8).token_ids == before for d in decoders)


def test_generating_on_another_thread_than_the_loading_one_warns_once(tiny, tiny_folders, monkeypatch):
    """Several threads running torch keep several OpenMP teams and slow every forward (~1.5x measured,
    docs/benchmarks.md, "Server"): generating on another thread than the loading one warns, once a process;
    the loading thread, or one torch thread, does not."""
    import threading
    import warnings

    from speculate.models import loader

    monkeypatch.setattr(loader, "_WARNED_THREAD", False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", k=3))
    caught = []

    def generate():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            decoder.generate([5, 6, 7], max_new_tokens=3)
        caught.append([str(w.message) for w in seen if w.category is RuntimeWarning])

    generate()  # the thread that loaded the tiny models (the test session's)
    for _ in range(2):
        thread = threading.Thread(target=generate)
        thread.start()
        thread.join()
    assert caught[0] == [] and len(caught[1]) == 1 and "loaded on another thread" in caught[1][0]
    assert caught[2] == []  # once
    monkeypatch.setattr(loader, "_WARNED_THREAD", False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    thread = threading.Thread(target=generate)
    thread.start()
    thread.join()
    assert caught[3] == []
    # A loading thread that has ended holds no OpenMP team any more: no warning.
    monkeypatch.setattr(loader, "_WARNED_THREAD", False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    loaded = []
    thread = threading.Thread(target=lambda: loaded.append(load_model(str(tiny_folders[1]))))
    thread.start()
    thread.join()
    decoder = SpeculativeDecoder(loaded[0], SpeculativeSpec("lookup", k=3))
    generate()
    assert caught[4] == []
