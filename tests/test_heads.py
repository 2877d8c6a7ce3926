"""Self-drafting heads (Medusa, EAGLE): hidden rows from the KV models, save/load, training, and
greedy decoding with random heads equal to plain decoding (chains and trees), on tiny models."""

from __future__ import annotations

import pytest
import torch

from speculate.drafters.eagle import EagleDrafter
from speculate.drafters.medusa import MedusaDrafter
from speculate import SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.errors import SpeculateError
from speculate.heads import EagleHead, MedusaHeads, load_heads, save_heads
from speculate.heads.data import build_data, with_taps
from speculate.heads.train import _Batches, _medusa_loss, make_heads, train_heads
from speculate.models.kv import KVModel
from speculate.sampling import SamplingParams

PROMPT = [5, 40, 77, 12, 9, 100, 33, 250, 7, 64, 64, 3]


def lm_head(loaded):
    return loaded.model.get_output_embeddings()


@pytest.mark.parametrize("fast", [True, False])
def test_kv_hidden_is_the_lm_head_input(tiny, fast):
    loaded = tiny[0]
    kv = KVModel(loaded, fast=fast)
    assert type(kv).__name__ == ("FastKVModel" if fast else "HFKVModel")
    kv.reset(64)
    tokens = torch.tensor(PROMPT)
    logits = kv.forward(tokens, last=1)
    assert kv.hidden.shape == (len(PROMPT), loaded.model.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(lm_head(loaded)(kv.hidden[-1:]).float(), logits, atol=1e-5)
        logits = kv.forward(torch.tensor([8, 9, 10]))  # a chain: every row
        assert kv.hidden.shape[0] == 3
        assert torch.allclose(lm_head(loaded)(kv.hidden).float(), logits, atol=1e-5)
        logits = kv.forward(torch.tensor([1, 2, 3]), tree_parents=[-1, 0, 0])  # a tree
        assert torch.allclose(lm_head(loaded)(kv.hidden).float(), logits, atol=1e-5)


def test_hidden_equal_on_both_backends(tiny):
    rows = []
    for fast in (True, False):
        kv = KVModel(tiny[1], fast=fast)
        kv.reset(64)
        kv.forward(torch.tensor(PROMPT))
        rows.append(kv.hidden.clone())
    assert torch.allclose(rows[0], rows[1], atol=1e-4)


@pytest.mark.parametrize("fast", [True, False])
def test_kv_taps_follow_the_hidden_rows(tiny, fast):
    """With ``taps`` the hidden rows are followed by those decoder layers' outputs (Hugging Face's
    hidden_states[i + 1]) on both backends; the first H columns do not change."""
    loaded = tiny[0]
    h = loaded.model.config.hidden_size
    kv = KVModel(loaded, fast=fast)
    kv.reset(64)
    kv.forward(torch.tensor(PROMPT))
    plain = kv.hidden.clone()
    kv.taps = (0,)
    kv.reset(64)
    kv.forward(torch.tensor(PROMPT))
    with torch.no_grad():
        ref = loaded.model(input_ids=torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    assert kv.hidden.shape == (len(PROMPT), 2 * h)
    assert torch.equal(kv.hidden[:, :h], plain)
    assert torch.allclose(kv.hidden[:, h:], ref[1][0], rtol=1e-4, atol=1e-5)  # (fp32 through the kernel: its own sums)
    assert not torch.allclose(ref[1][0], ref[0][0], atol=1e-2)  # the layer did change its input


def random_heads(kind, loaded, subset=None, seed=0, feature_layers=()):
    torch.manual_seed(seed)
    vocab = None
    v = lm_head(loaded).out_features
    if subset:
        vocab = torch.randperm(v)[:subset].sort().values
    if kind == "medusa":
        heads = MedusaHeads(loaded.model.config.hidden_size, 3, 1, vocab, zero_init=False)
    else:
        heads = EagleHead.for_target(loaded.model.config, vocab, feature_layers)
    return heads.eval().requires_grad_(False)


FUSED = (0,)  # a fused EAGLE head on the tiny models (2 layers; the last one's output is what the norm reads)


@pytest.mark.parametrize("kind,subset,layers", [("medusa", None, ()), ("medusa", 100, ()), ("eagle", None, ()),
                                                ("eagle", 100, ()), ("eagle", 100, FUSED)])
def test_save_load_round_trip(tiny, tmp_path, kind, subset, layers):
    loaded = tiny[0]
    heads = random_heads(kind, loaded, subset, feature_layers=layers)
    save_heads(tmp_path, heads, loaded.name, 259, {"steps": 3})
    back, config = load_heads(tmp_path, kind)
    assert config["kind"] == kind and config["training"] == {"steps": 3} and config["vocab_size"] == 259
    assert (back.vocab is None) == (subset is None)
    if subset:
        assert torch.equal(back.vocab, heads.vocab)
    h = torch.randn(5, loaded.model.config.hidden_size)
    if kind == "medusa":
        assert torch.equal(back.features(h), heads.features(h))
    else:
        assert back.feature_layers == layers and config.get("feature_layers", []) == list(layers)
        emb, wide = torch.randn(2, 5, h.shape[1]), torch.randn(2, 5, h.shape[1] * (1 + len(layers)))
        assert torch.equal(back(emb, wide), heads(emb, wide))
    # fp16 storage (what `speculate train-heads` writes): half the size, the same heads to fp16 precision.
    save_heads(tmp_path / "half", heads, loaded.name, 259, dtype=torch.float16)
    half, config = load_heads(tmp_path / "half", kind)
    assert config["weights_dtype"] == "float16" and all(p.dtype == torch.float32 for p in half.parameters())
    for key, value in heads.state_dict().items():
        assert torch.allclose(half.state_dict()[key].float(), value.float(), rtol=1e-3, atol=1e-4), key
    with pytest.raises(SpeculateError):
        load_heads(tmp_path, "eagle" if kind == "medusa" else "medusa")
    (tmp_path / "heads.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpeculateError):
        load_heads(tmp_path)


def test_no_shipped_heads_for_a_local_model(tiny):
    with pytest.raises(SpeculateError, match="no medusa heads ship"):
        MedusaDrafter(tiny[0])


def test_eagle_cache_matches_training_forward(tiny):
    """The drafting path (static cache, one pair at a time) equals the batched causal forward."""
    loaded = tiny[0]
    head = random_heads("eagle", loaded)
    h = loaded.model.config.hidden_size
    emb, feat = torch.randn(1, 7, h), torch.randn(1, 7, h)
    full = head(emb, feat)[0]
    cache = head.new_cache(16)
    out = [head.step(cache, emb[0, :3], feat[0, :3], torch.arange(3), torch.arange(3), None)]
    for t in range(3, 7):
        out.append(head.step(cache, emb[0, t:t + 1], feat[0, t:t + 1], torch.tensor([t]), torch.tensor([t]), None))
    assert torch.allclose(torch.cat(out), full, atol=1e-5)


@pytest.mark.parametrize("layers", [(), FUSED])
def test_eagle_unroll_is_drafting(tiny, layers):
    """Training-time test: pass m of ``unroll`` at row r is what drafting computes at depth m after the
    real pairs 0..r — each drafted pair fed on the head's own previous output, at the next slot. A fused
    head (EAGLE-3) reads the wide real features at depth 1 and its own H-wide outputs after."""
    loaded = tiny[0]
    head = random_heads("eagle", loaded, seed=3, feature_layers=layers)
    h, t = loaded.model.config.hidden_size, 7
    emb, feat = torch.randn(1, t, h), torch.randn(1, t, h * (1 + len(layers)))
    passes = head.unroll(emb, feat, 3)
    assert torch.equal(passes[0], head(emb, feat))
    for r in range(t - 2):
        cache = head.new_cache(16)
        pos = torch.arange(r + 1)
        out = head.step(cache, emb[0, : r + 1], head.real_features(feat[0, : r + 1]), pos, pos, None)[-1]
        assert torch.allclose(out, passes[0][0, r], atol=1e-5)
        for m in (2, 3):  # the pair [embedding of token r+m, the previous prediction] at position r+m-1
            at = torch.tensor([r + m - 1])
            out = head.step(cache, emb[0, r + m - 1: r + m], out[None], at, at, None)[0]
            assert torch.allclose(out, passes[m - 1][0, r], atol=1e-5), (r, m)
    # Causal in both passes: a change to feature 2 leaves every earlier row of pass 1 and pass 2 alone.
    other = head.unroll(emb, feat + 0.5 * torch.eye(t, feat.shape[-1])[None] * (torch.arange(t) == 2)[None, :, None], 2)
    assert torch.equal(other[0][0, :2], passes[0][0, :2]) and torch.equal(other[1][0, :2], passes[1][0, :2])
    assert not torch.allclose(other[1][0, 2], passes[1][0, 2])

# ----------------------------------------------------------------------------- decoding loops

def plain_greedy(loaded, prompt, n):
    kv = KVModel(loaded)
    kv.reset(len(prompt) + n + 1)
    tokens = list(prompt)
    logits = kv.forward(torch.tensor(tokens), last=1)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = kv.forward(torch.tensor(out[-1:]))
    return out


def spec_greedy(loaded, drafter, prompt, n, k, fast=True):
    """Greedy decoding through the engine, whose observe() hook feeds the heads the target's features.
    Returns (tokens, accepted drafts, rounds); the tokens stop early only at EOS."""
    decoder = SpeculativeDecoder(loaded, SpeculativeSpec(verifier="greedy", k=k), drafter=drafter)
    if not fast:
        decoder.new_cache = lambda: KVModel(loaded, fast=False)
    g = decoder.generate(list(prompt), max_new_tokens=n)
    assert len(g.token_ids) == n or g.finish_reason == "stop"
    return g.token_ids, g.stats.accepted_draft_tokens, g.stats.target_calls


def drafter_for(kind, loaded, folder, tree):
    if kind == "medusa":
        return MedusaDrafter(loaded, folder, tree=tree)
    return EagleDrafter(loaded, folder, tree=tree)


def heads_kind(kind):
    """("medusa" | "eagle", feature layers) for the parametrized kinds, "eagle-fused" among them."""
    return ("eagle", FUSED) if kind == "eagle-fused" else (kind, ())


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle-fused"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("subset", [None, 120])
def test_greedy_with_random_heads_equals_plain(tiny, tmp_path, kind, tree, subset):
    loaded = tiny[2]
    kind, layers = heads_kind(kind)
    save_heads(tmp_path, random_heads(kind, loaded, subset, seed=3, feature_layers=layers), loaded.name, 259)
    expected = plain_greedy(loaded, PROMPT, 30)
    drafter = drafter_for(kind, loaded, tmp_path, tree)
    assert drafter.tree == tree
    for fast in (True, False) if subset is None else (True,):  # both KV backends feed the hook
        got, _, rounds = spec_greedy(loaded, drafter, PROMPT, 30, 4, fast)
        assert got == expected[: len(got)]
        assert rounds <= 30


def test_eagle_tree_respects_budget_and_order(tiny, tmp_path):
    loaded = tiny[1]
    save_heads(tmp_path, random_heads("eagle", loaded, seed=5), loaded.name, 259)
    drafter = EagleDrafter(loaded, tmp_path, tree=True, topk=3, budget=7, depth=4)
    kv = KVModel(loaded)
    kv.reset(64)
    drafter.begin(PROMPT, SamplingParams(), torch.Generator())
    kv.forward(torch.tensor(PROMPT[:-1]))
    drafter.observe(kv.hidden)
    draft = drafter.propose(list(PROMPT), 4)
    assert len(draft) == 7 and draft.parents[0] == -1
    assert all(p < i for i, p in enumerate(draft.parents))
    assert max(draft.node_depths()) <= 4
    assert drafter.max_nodes(4) == 7


def test_medusa_sampling_tree_rows(tiny, tmp_path):
    """Sampling trees: siblings share their depth's row and are distinct (drawn without replacement),
    every token has mass in its row."""
    loaded = tiny[0]
    save_heads(tmp_path, random_heads("medusa", loaded, seed=1), loaded.name, 259)
    drafter = MedusaDrafter(loaded, tmp_path, tree=True)
    drafter.begin(PROMPT, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    kv = KVModel(loaded)
    kv.reset(64)
    kv.forward(torch.tensor(PROMPT[:-1]))
    drafter.observe(kv.hidden)
    draft = drafter.propose(list(PROMPT), 3)
    assert draft.probs is not None and draft.probs.shape == (len(draft), 259)
    for i, parent in enumerate(draft.parents):
        assert draft.probs[i, draft.tokens[i]] > 0
        sibs = [j for j, p in enumerate(draft.parents) if p == parent]
        assert len({int(draft.tokens[j]) for j in sibs}) == len(sibs)
        assert all(torch.equal(draft.probs[j], draft.probs[i]) for j in sibs)


# ----------------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def tiny_data(tiny, tmp_path_factory):
    loaded = tiny[0]
    prompts = ["hello there", "write a poem", "count to ten", "abc abc abc", "what is two plus two",
               "the quick brown fox", "once upon a time", "rewrite: cats are nice"]
    folder = tmp_path_factory.mktemp("data")
    data = build_data(loaded, folder, len(prompts), 24, batch_size=4, prompts=prompts, progress=False)
    import speculate.heads.data as heads_data

    with pytest.MonkeyPatch.context() as mp:  # (a module fixture: no function-scoped monkeypatch)
        mp.setattr(heads_data, "hidden_states", None)  # served from the cache file: no teacher-forced pass again
        again = build_data(loaded, folder, len(prompts), 24, batch_size=4, prompts=prompts, progress=False)
    assert torch.equal(again.hidden, data.hidden)
    return data


def test_data_rows_are_the_targets_hidden(tiny, tiny_data):
    data = tiny_data
    assert data.hidden.dtype == torch.float16 and data.hidden.shape[0] == data.ids.numel()
    s, n, p = (int(x[0]) for x in (data.starts, data.lengths, data.prompt_lengths))
    ids = data.ids[s: s + n]
    # The answer is the target's greedy continuation: row t's LM-head argmax is token t+1.
    logits = lm_head(tiny[0])(data.hidden[s: s + n].float())
    assert torch.equal(logits[p - 1: n - 1].argmax(-1), ids[p:n])


def test_medusa_training_lowers_the_loss(tiny, tiny_data, tmp_path):
    loaded = tiny[0]
    lm = lm_head(loaded).weight.detach()
    batches = _Batches(tiny_data, 3, torch.arange(259), holdout=0.0)
    fixed = batches.medusa(batches.medusa_train[:512])
    torch.manual_seed(0)
    with torch.no_grad():
        before = float(_medusa_loss(make_heads("medusa", loaded, 3), lm, *fixed)[0])
    heads, meta = train_heads("medusa", loaded, tiny_data, tmp_path, 60, 64, 3e-3, 3, None, progress=False)
    after = float(_medusa_loss(heads, lm, *fixed)[0])
    assert after < before - 0.1, (before, after)
    assert meta["steps"] == 60 and len(meta["heldout_top1"]) == 3
    # Decoding a training prompt with the trained heads: still the target's tokens, and drafts land.
    save_heads(tmp_path / "heads", heads, loaded.name, 259, meta)
    s, p = int(tiny_data.starts[-1]), int(tiny_data.prompt_lengths[-1])
    prompt = tiny_data.ids[s: s + p].tolist()
    for tree in (False, True):
        got, accepted, _ = spec_greedy(loaded, MedusaDrafter(loaded, tmp_path / "heads", tree=tree), prompt, 20, 3)
        assert got == plain_greedy(loaded, prompt, 20)
        assert accepted > 0


def test_eagle_training_lowers_the_loss_and_resumes(tiny, tiny_data, tmp_path):
    loaded = tiny[0]
    kw = dict(batch_size=4, lr=3e-3, vocab_subset=150, progress=False, checkpoint_every=1000)
    straight, meta = train_heads("eagle", loaded, tiny_data, tmp_path / "a", 30, **kw)
    first = float(meta["final_loss"])
    assert meta["vocab_subset"] == 150 and 0 < meta["vocab_coverage"] <= 1
    # Interrupted at step 12 (checkpoint), then rerun: it resumes there and ends with the same weights.
    none, info = train_heads("eagle", loaded, tiny_data, tmp_path / "b", 30, stop_at=12, **kw)
    assert none is None and info == {"stopped_at": 12}
    before = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["seconds"]
    logs = []
    resumed, resumed_meta = train_heads("eagle", loaded, tiny_data, tmp_path / "b", 30, log=logs.append, **kw)
    assert any("at step 12/30" in line for line in logs)
    # Training time adds up over resumed runs; rerunning a finished run reports the final checkpoint's time.
    final = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["seconds"]
    assert 0 < before < final and resumed_meta["train_seconds"] == round(final, 1)
    _, again = train_heads("eagle", loaded, tiny_data, tmp_path / "b", 30, **kw)
    assert again["train_seconds"] == resumed_meta["train_seconds"]
    for key, value in straight.state_dict().items():
        assert torch.allclose(value, resumed.state_dict()[key], atol=1e-6), key
    # The loss went down: compare the first steps' loss with the final running loss.
    _, early = train_heads("eagle", loaded, tiny_data, tmp_path / "c", 2, **kw)
    assert first < float(early["final_loss"])
    # Settings that differ from the checkpoint's are refused, not silently mixed.
    with pytest.raises(SpeculateError, match="other settings"):
        train_heads("eagle", loaded, tiny_data, tmp_path / "b", 40, **{**kw, "lr": 1e-3})
    with pytest.raises(SpeculateError, match="unroll"):
        train_heads("eagle", loaded, tiny_data, tmp_path / "b", 30, unroll=2, **kw)


def test_eagle_training_time_test_lowers_the_depth_two_loss(tiny, tiny_data, tmp_path):
    """Trained with unroll=2 the head predicts better from its own first prediction (the second pass's
    loss on training batches) than one trained for as many steps on real features only."""
    from speculate.heads.train import _eagle_loss

    loaded = tiny[0]
    kw = dict(batch_size=4, lr=3e-3, vocab_subset=None, progress=False, checkpoint_every=1000)
    one, _ = train_heads("eagle", loaded, tiny_data, tmp_path / "one", 40, **kw)
    two, meta = train_heads("eagle", loaded, tiny_data, tmp_path / "two", 40, unroll=2, **kw)
    assert meta["unroll"] == 2 and len(meta["heldout_top1_by_depth"]) == 2
    lm = lm_head(loaded).weight.detach()
    batches = _Batches(tiny_data, 1, torch.arange(259), holdout=0.0)
    embed = loaded.model.get_input_embeddings().weight.detach()
    batch = batches.eagle(batches.train_seqs[:16], embed, 384, torch.Generator().manual_seed(1))
    with torch.no_grad():
        depth2 = {name: float(1.8 * _eagle_loss(h, lm, *batch, unroll=2) - _eagle_loss(h, lm, *batch))
                  for name, h in (("one", one), ("two", two))}  # (L1 + 0.8 L2) / 1.8 · 1.8 − L1 = 0.8 L2
    assert depth2["two"] < depth2["one"] - 0.05, depth2


def test_fused_eagle_head_trains_on_the_tapped_layers(tiny, tmp_path):
    """EAGLE-3's fused features: build_data extends a cached data file with the layers asked for (one more
    teacher-forced pass; the answers are kept), training refuses data without them, and a fused head
    trains (its loss falls) and keeps its layers through save and load."""
    loaded = tiny[0]
    prompts = ["hello there", "write a poem", "count to ten", "abc abc abc", "what is two plus two"]
    plain = build_data(loaded, tmp_path / "d", len(prompts), 16, batch_size=4, prompts=prompts, progress=False)
    assert plain.taps is None
    kw = dict(batch_size=4, lr=3e-3, vocab_subset=None, progress=False, checkpoint_every=1000)
    with pytest.raises(SpeculateError, match="no outputs of layers"):
        train_heads("eagle", loaded, plain, tmp_path / "x", 2, feature_layers=FUSED, **kw)
    data = build_data(loaded, tmp_path / "d", len(prompts), 16, prompts=prompts, progress=False, feature_layers=FUSED)
    assert torch.equal(data.ids, plain.ids) and torch.equal(data.hidden, plain.hidden)
    assert data.meta["feature_layers"] == list(FUSED) and data.taps.shape == (data.ids.numel(), 64)
    again = build_data(loaded, tmp_path / "d", len(prompts), 16, prompts=prompts, progress=False)
    assert torch.equal(again.taps, data.taps)  # kept in the cache file
    kv = KVModel(loaded)
    kv.taps = FUSED
    kv.reset(64)
    n = int(data.lengths[0])
    kv.forward(data.ids[:n])
    assert torch.allclose(kv.hidden[:, 64:], data.taps[:n].float(), rtol=2e-3, atol=2e-3)
    heads, meta = train_heads("eagle", loaded, data, tmp_path / "h", 40, feature_layers=FUSED, **kw)
    _, early = train_heads("eagle", loaded, data, tmp_path / "e", 2, feature_layers=FUSED, **kw)
    assert heads.feature_layers == FUSED and meta["final_loss"] < early["final_loss"]
    assert meta["feature_layers"] == list(FUSED) and meta["loss_weights"] == [1.0, 0.1]
    # EAGLE-3 weighs the token loss over the feature loss: another objective, so another checkpoint.
    token_only, info = train_heads("eagle", loaded, data, tmp_path / "t", 2, feature_layers=FUSED,
                                   loss_weights=(0.0, 1.0), **kw)
    assert info["loss_weights"] == [0.0, 1.0] and early["final_loss"] != info["final_loss"]
    with pytest.raises(SpeculateError, match="loss_weights"):
        train_heads("eagle", loaded, data, tmp_path / "t", 2, feature_layers=FUSED, **kw)
    save_heads(tmp_path / "saved", heads, loaded.name, 259, meta)
    assert load_heads(tmp_path / "saved")[0].feature_layers == FUSED


def test_training_keeps_the_best_heldout_heads(tiny, tiny_data, tmp_path, monkeypatch):
    """Held-out top-1 is measured at every checkpoint and at the end; the returned heads are those of the
    best measurement (here step 20 of 30), across an interruption, and the curve is recorded."""
    import speculate.heads.train as train

    loaded = tiny[0]
    kw = dict(batch_size=4, lr=3e-3, vocab_subset=150, progress=False, checkpoint_every=10)
    scores, seen = [], []  # what the scripted evaluation returns next; the fc weights it was shown

    def scripted(kind, heads, *args):
        seen.append(heads.fc.weight.detach().clone())
        return {"heldout_top1": scores.pop(0)}

    monkeypatch.setattr(train, "evaluate", scripted)
    scores[:] = [0.1, 0.2]  # steps 10 and 20 of the same 30-step schedule, stopped there
    train.train_heads("eagle", loaded, tiny_data, tmp_path / "a", 30, stop_at=20, **kw)
    at20 = torch.load(tmp_path / "a" / train.CHECKPOINT, weights_only=False)["heads"]
    scores[:] = [0.5]  # step 10, then interrupted at 15
    none, _ = train.train_heads("eagle", loaded, tiny_data, tmp_path / "b", 30, stop_at=15, **kw)
    assert none is None and scores == []
    seen.clear()
    scores[:] = [0.9, 0.3, 0.9]  # steps 20 and 30 after resuming, then the final report
    heads, meta = train.train_heads("eagle", loaded, tiny_data, tmp_path / "b", 30, **kw)
    assert meta["best_step"] == 20 and meta["heldout_curve"] == [[10, 0.5], [20, 0.9], [30, 0.3]]
    assert meta["heldout_top1"] == 0.9
    for key, value in at20.items():  # step 20's weights, not step 30's
        assert torch.allclose(value, heads.state_dict()[key], atol=1e-6), key
    assert not torch.allclose(seen[1], heads.fc.weight, atol=1e-4)  # step 30's weights differ


def test_prompt_mix_and_self_instruct_filtering(tiny, monkeypatch, tmp_path):
    """default_prompts: slots of GSM8K question / chat / chat / task, the written chat questions first,
    then the target's own; self_instruct_prompts keeps user turns that ended, of >= 4 words, once each,
    sampled after the template's user-turn prefix, and leaves the global RNG as it was."""
    from speculate.heads.data import QUESTIONS, chat_slots, default_prompts, self_instruct_prompts
    from speculate.text import eos_ids

    prompts = default_prompts(100, chat=["own question one?", "own question two?"])
    chat = [p for i, p in enumerate(prompts) if i % 4 in (1, 2)]
    assert len(chat) == chat_slots(100) == 50 and chat[:40] == QUESTIONS
    assert chat[40:42] == ["own question one?", "own question two?"] and chat[42] == QUESTIONS[0] + " (1)"
    # Without the GSM8K file every slot is a chat question, and chat_slots says so (so that many are written).
    own = [f"own question {i}?" for i in range(60)]
    alone = default_prompts(100, data_dir=tmp_path, chat=own)
    assert chat_slots(100, tmp_path) == 100 and alone == QUESTIONS + own

    loaded = tiny[0]
    tok = loaded.tokenizer
    eos = min(eos_ids(loaded))
    rows = [tok("What is the tallest mountain?")["input_ids"] + [eos],
            tok("What is the tallest mountain?")["input_ids"] + [eos],  # a duplicate
            tok("Hi there")["input_ids"] + [eos],  # too short
            tok("Tell me a long story that never ends")["input_ids"]]  # no end of turn
    width = max(map(len, rows))
    seen_prefix = []

    def generate(input_ids, **kw):
        seen_prefix.append(input_ids[0].tolist())
        torch.rand(3)  # the sampler draws from the global RNG
        tails = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
        return torch.cat([input_ids[: len(rows)], tails], dim=1)

    monkeypatch.setattr(loaded.model, "generate", generate)
    state = torch.random.get_rng_state()
    got = self_instruct_prompts(loaded, 3, batch_size=4, progress=False)
    assert got == ["What is the tallest mountain?"]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert tok.decode(seen_prefix[0]) == "<|im_start|>user\n"  # the template up to the user's words


def test_answer_generation_resumes_from_its_partial_file(tiny, tmp_path, monkeypatch):
    from speculate.heads.data import generate_answers

    loaded = tiny[1]
    prompts = ["one", "two two", "three three three"]
    partial = tmp_path / "answers.json"
    first = generate_answers(loaded, prompts[:2], 8, batch_size=1, progress=False, partial=partial)
    calls = []
    real = loaded.model.generate
    monkeypatch.setattr(loaded.model, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = generate_answers(loaded, prompts, 8, batch_size=1, progress=False, partial=partial)
    assert again[:2] == first and len(calls) == 1  # only the new prompt was generated


@pytest.mark.parametrize("layers", [(), FUSED])
def test_eagle_drafting_pairs_match_training_pairs(tiny, tiny_data, tmp_path, layers):
    """The drafter feeds the head exactly the pairs training does: after observing the hidden rows of
    a sequence (and, fused, the tapped layers' outputs the engine's KV model adds), its predicted feature
    equals the training forward's output at the same position, and its first draft is that output's
    LM-head argmax."""
    loaded = tiny[0]
    head = random_heads("eagle", loaded, seed=7, feature_layers=layers)
    save_heads(tmp_path, head, loaded.name, 259)
    data = with_taps(loaded, tiny_data, layers, progress=False)
    s, n = int(data.starts[0]), int(data.lengths[0])
    ids = data.ids[s: s + n].tolist()
    rows = data.hidden[s: s + n].float()
    if layers:
        rows = torch.cat([rows, data.taps[s: s + n, data.tap_columns(layers)].float()], dim=-1)
    kv = KVModel(loaded)  # what the engine hands over is what the data holds (to fp16 rounding)
    kv.taps = layers
    kv.reset(n + 1)
    kv.forward(torch.tensor(ids))
    assert torch.allclose(kv.hidden, rows, rtol=2e-3, atol=2e-3)
    embed = loaded.model.get_input_embeddings().weight.detach()
    batches = _Batches(data, 1, torch.arange(259), holdout=0.0, feature_layers=layers)
    emb, feat, *_ = batches.eagle(torch.tensor([0]), embed, 4096, torch.Generator())
    with torch.no_grad():
        trained_view = head(emb, feat)[0]  # row t: the prediction of feature t+1
    drafter = EagleDrafter(loaded, tmp_path)
    L = n - 3
    drafter.begin(ids[:L], SamplingParams(), torch.Generator())
    drafter.observe(rows[: L - 1])
    draft = drafter.propose(ids[:L], 1)
    assert torch.allclose(drafter.root, trained_view[L - 2], atol=1e-4)
    lm = loaded.model.get_output_embeddings().weight.detach()
    assert int(draft.tokens[0]) == int((lm @ trained_view[L - 2]).argmax())


# ------------------------------------------------------------------------------------ int8 targets

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_hidden_rows_scale_back_to_the_fp32_features(tiny_folders, tmp_path, monkeypatch, arch):
    """An int8 target's final norm is smoothed (its rows are the fp32 features divided by s): the
    feature scale undoes that, and the LM head the drafters use is the fp32 one (tied: the embedding,
    exactly; untied: dequantized and unsmoothed)."""
    from speculate import load_model
    from speculate.models.quantize import feature_scale, lm_head_weight
    from speculate.models.tiny import save_tiny_model

    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path / "cache"))
    folder = tiny_folders[0] if arch == "llama" else save_tiny_model(tmp_path / "qwen2", seed=4, arch="qwen2")
    fp32, int8 = load_model(str(folder)), load_model(str(folder), dtype="int8")
    rows = {}
    for name, loaded in (("fp32", fp32), ("int8", int8)):
        kv = KVModel(loaded)
        kv.reset()
        kv.forward(torch.tensor(PROMPT))
        rows[name] = kv.hidden
    lm, scale = lm_head_weight(int8.model), feature_scale(int8.model)
    assert feature_scale(fp32.model) is None
    assert scale is not None and (scale - 1).abs().max() > 0.1  # smoothing did move the rows
    error = (rows["int8"] * scale - rows["fp32"]).norm() / rows["fp32"].norm()
    unscaled = (rows["int8"] - rows["fp32"]).norm() / rows["fp32"].norm()
    assert error < 0.1 and unscaled > 5 * error, (error, unscaled)  # int8 noise of a random model: ~6 %
    fp32_lm = lm_head_weight(fp32.model)
    if arch == "llama":
        assert torch.equal(lm, fp32_lm)
    else:
        assert ((lm - fp32_lm).norm() / fp32_lm.norm()) < 0.01


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle-fused"])
@pytest.mark.parametrize("tree", [False, True])
def test_greedy_with_heads_on_an_int8_target_equals_plain_int8(tiny_folders, tmp_path, monkeypatch, kind, tree):
    """Beside an int8 target the heads and their LM head run in int8 too; greedy decoding stays exactly
    the int8 target's own."""
    from speculate import load_model
    from speculate.models.quantize import Int8Linear

    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path / "cache"))
    loaded = load_model(str(tiny_folders[2]), dtype="int8")
    kind, layers = heads_kind(kind)
    save_heads(tmp_path / "heads", random_heads(kind, loaded, 120, seed=3, feature_layers=layers), loaded.name, 259)
    drafter = drafter_for(kind, loaded, tmp_path / "heads", tree)
    assert isinstance(drafter.lm, Int8Linear)
    assert any(isinstance(m, Int8Linear) for m in (drafter.heads if kind == "medusa" else drafter.head).modules())
    got, _, _ = spec_greedy(loaded, drafter, PROMPT, 30, 4)
    assert got == plain_greedy(loaded, PROMPT, 30)[: len(got)]


# ------------------------------------------------------------------------ the shipped heads, for real

SHIPPED_PROMPTS = [
    "A baker makes 24 muffins and sells them in boxes of 4. Each box costs $6. How much money does the "
    "baker get for all the muffins?",
    "Give me three tips for a good night's sleep.",
]


@pytest.fixture(scope="module")
def default_int8(default_model):
    from speculate import load_model

    return load_model(dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_shipped_heads_decode_exactly_like_plain_greedy(default_model, default_int8, precision):
    """The heads that ship for the default model, as chains and trees, at both precisions: exactly the
    plain greedy tokens of the target as run, and their drafts are accepted (random heads would give
    τ ≈ 1.0; these reach 1.3-2.2 here)."""
    target = default_model if precision == "fp32" else default_int8
    plain = SpeculativeDecoder(target, SpeculativeSpec("none"))
    refs = [plain.generate(p, max_new_tokens=48).token_ids for p in SHIPPED_PROMPTS]
    for spec in ("eagle", "eagle-chain", "medusa", "medusa-chain"):
        decoder = SpeculativeDecoder(target, SpeculativeSpec(spec, verifier="greedy", k=4))
        new = calls = 0
        for prompt, ref in zip(SHIPPED_PROMPTS, refs):
            out = decoder.generate(prompt, max_new_tokens=48)
            assert out.token_ids == ref, spec
            new, calls = new + out.stats.new_tokens, calls + out.stats.target_calls
        assert new / calls > 1.2, (spec, precision, new / calls)


def test_drafters_of_one_target_share_their_heads_until_the_files_change(tiny, tmp_path):
    """The server builds a drafter per request: the heads are loaded (and quantized) once per target
    and folder; heads saved again into that folder are loaded anew."""
    import os

    loaded = tiny[1]
    save_heads(tmp_path, random_heads("eagle", loaded, 100, seed=1), loaded.name, 259)
    a, b = EagleDrafter(loaded, tmp_path), EagleDrafter(loaded, tmp_path)
    assert a.head is b.head and a.lm is b.lm
    save_heads(tmp_path, random_heads("eagle", loaded, 100, seed=2), loaded.name, 259)
    weights = tmp_path / "heads.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1000))  # coarse clocks
    c = EagleDrafter(loaded, tmp_path)
    assert c.head is not a.head
    assert not torch.equal(c.head.fc.weight, a.head.fc.weight)


def test_tree_shape_bench_is_lossless_and_reports_every_shape(tiny, tmp_path):
    """python -m speculate.bench.trees: every shape and chain decodes exactly like plain greedy."""
    from speculate.bench import trees

    loaded = tiny[2]
    for kind in ("medusa", "eagle"):
        save_heads(tmp_path / kind, random_heads(kind, loaded, 120, seed=5), loaded.name, 259)
    result = trees.run(str(loaded.path), "fp32", str(tmp_path), n_prompts=1, max_new_tokens=6)
    n = len(trees.SHAPES) + len(trees.CHAINS) + 1 + 2 + 1 + sum(map(len, trees.WITH_LOOKUP.values())) + 2 * len(trees.GATES)
    assert len(result["identical_to_plain"]) == n
    assert all(v == "2/2" for v in result["identical_to_plain"].values()), result["identical_to_plain"]
    for rows in result["sets"].values():
        assert rows["plain"] == {"tau": 1.0, "speedup": 1.0}
        assert all(r["tau"] >= 1.0 for r in rows.values())


def test_eagle_chain_confidence_gate(tiny, tmp_path):
    """``min_confidence`` stops a chain where the head is unsure: fewer drafts, the same greedy tokens;
    1.0 drafts nothing (plain decoding); when sampling, the gate reads the row before the draw, so the
    first sampled tokens still follow the exact warped target distribution (chi-square, 1e-3)."""
    from test_tree_engine import sampled_prefix_pvalue

    loaded = tiny[2]
    save_heads(tmp_path, random_heads("eagle", loaded, seed=3), loaded.name, 259)
    expected = plain_greedy(loaded, PROMPT, 30)
    drafted = {}
    for threshold in (0.0, 0.02, 1.0):  # random heads over 259 tokens: top probabilities of ~0.004-0.05
        g = SpeculativeDecoder(loaded, SpeculativeSpec(verifier="greedy", k=4),
                               drafter=EagleDrafter(loaded, tmp_path,
                                                    min_confidence=threshold)).generate(list(PROMPT), max_new_tokens=30)
        assert g.token_ids == expected
        drafted[threshold] = g.stats.drafted_tokens
    assert drafted[0.0] > drafted[0.02] > drafted[1.0] == 0
    with pytest.raises(ValueError, match="min_confidence"):
        EagleDrafter(loaded, tmp_path, min_confidence=1.5)

    drafter = EagleDrafter(loaded, tmp_path, min_confidence=0.4)  # top-k 3 warping: the rows' tops are 0.34-1
    lengths = []
    propose = drafter.propose
    drafter.propose = lambda tokens, k: lengths.append((len(d := propose(tokens, k)), k)) or d
    decoder = SpeculativeDecoder(loaded, SpeculativeSpec(verifier="sample", k=2), drafter=drafter)
    assert sampled_prefix_pvalue(loaded, PROMPT, SamplingParams(temperature=1.0, top_k=3), decoder, 1000) > 1e-3
    assert any(n < k for n, k in lengths) and any(n == k > 0 for n, k in lengths)  # the gate cut some, not all
    # The registry's EAGLE chains are gated at 0.35 (docs/benchmarks.md, "Confidence-gated chains"); trees are
    # not; 0 turns it off.
    from speculate.drafters import get_drafter

    gates = {name: get_drafter(name, None, loaded, heads=tmp_path) for name in ("eagle-chain", "eagle-chain+lookup",
                                                                              "eagle", "eagle+lookup")}
    assert gates["eagle-chain"].min_confidence == gates["eagle-chain+lookup"].base.min_confidence == 0.35
    assert gates["eagle"].min_confidence == gates["eagle+lookup"].base.min_confidence == 0.0
    assert get_drafter("eagle-chain", None, loaded, heads=tmp_path, min_confidence=0).min_confidence == 0.0


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle-fused"])
def test_heads_take_a_stored_prefix_and_draft_as_they_do_alone(tiny_folders, tmp_path, monkeypatch, kind):
    """The prefix store with the heads (int8: the paged cache): Medusa's last prompt row is computed, EAGLE's head
    gets the target's hidden rows of the blocks it takes (stored beside them by a generation whose drafter read
    them; a block stored without them, by a lookup run, is computed again). Tokens, accepted drafts and target calls
    are each the decoder's alone without the store."""
    import random

    from speculate import SpeculativeDecoder, load_model
    from speculate.models.paged import BLOCK
    from speculate.models.prefix_store import PrefixStore
    from speculate.spec import SpeculativeSpec

    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path / "cache"))
    loaded = load_model(str(tiny_folders[2]), dtype="int8")
    kind, layers = heads_kind(kind)
    save_heads(tmp_path / "heads", random_heads(kind, loaded, 120, seed=3, feature_layers=layers), loaded.name, 259)
    rng = random.Random(0)
    shared = [rng.randrange(3, 259) for _ in range(2 * BLOCK + 5)]
    prompts = [shared + [rng.randrange(3, 259) for _ in range(9)] for _ in range(3)] + [shared[: 2 * BLOCK + 1]]
    store = PrefixStore(1 << 30)
    # A lookup run stores the shared blocks without hidden rows.
    SpeculativeDecoder(loaded, SpeculativeSpec("lookup", k=3), prefix_store=store).generate(prompts[0], max_new_tokens=4)
    def recorded():  # a drafter whose every proposal is kept: the heads' drafts show the features they read
        drafter = drafter_for(kind, loaded, tmp_path / "heads", False)
        drafter.drafts, propose = [], drafter.propose
        drafter.propose = lambda tokens, k: drafter.drafts.append(propose(tokens, k)) or drafter.drafts[-1]
        return drafter

    reused = []
    for prompt in prompts[1:]:
        mine, fresh = recorded(), recorded()
        with_store = SpeculativeDecoder(loaded, drafter=mine, prefix_store=store).generate(prompt, max_new_tokens=20)
        alone = SpeculativeDecoder(loaded, drafter=fresh).generate(prompt, max_new_tokens=20)
        assert with_store.token_ids == alone.token_ids
        assert [d.tokens.tolist() for d in mine.drafts] == [d.tokens.tolist() for d in fresh.drafts]
        assert mine.drafts[0].tokens.numel() > 0
        reused.append(with_store.stats.reused_prompt_tokens)
    # Medusa takes the lookup run's blocks at once; EAGLE only once a head's run has stored their hidden rows. The
    # last prompt (its prefill: exactly two blocks, all stored by the run before) shows the rest: Medusa computes
    # its last row only (the rest of that block's rows are copied from the stored block); EAGLE takes both blocks
    # and their rows.
    assert reused == ([2 * BLOCK] * 2 + [2 * BLOCK - 1] if kind == "medusa" else [0, 2 * BLOCK, 2 * BLOCK])


def test_a_prefilling_run_waits_only_for_blocks_it_could_take(tiny_folders, tmp_path, monkeypatch):
    """The scheduler lets a prefilling run wait a round for the block another run computes from the same tokens
    (server/scheduler.py, _computed_beside) only where it could take that block from the store: not an EAGLE run
    beside a run that stores no hidden rows, not Medusa for the block that ends at its last prompt row, not with a
    store that keeps nothing."""
    import random

    from speculate import SpeculativeDecoder, load_model
    from speculate.models.paged import BLOCK
    from speculate.models.prefix_store import PrefixStore
    from speculate.sampling import SamplingParams
    from speculate.server.scheduler import _computed_beside
    from speculate.spec import SpeculativeSpec

    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path / "cache"))
    loaded = load_model(str(tiny_folders[2]), dtype="int8")
    for kind in ("medusa", "eagle"):
        save_heads(tmp_path / kind, random_heads(kind, loaded, 120, seed=3), loaded.name, 259)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 259) for _ in range(BLOCK + 1)]  # the prefill: one block, ending at the last row
    longer = prompt + [rng.randrange(3, 259) for _ in range(BLOCK)]

    def run(store, tokens, drafter=None):
        decoder = SpeculativeDecoder(loaded, drafter=drafter, prefix_store=store)
        return decoder.start(tokens, SamplingParams(max_new_tokens=2), prefill_chunk=BLOCK)

    store = PrefixStore(1 << 30)
    plain, plain_long = run(store, prompt), run(store, longer)
    eagle, eagle_long = (run(store, t, drafter_for("eagle", loaded, tmp_path / "eagle", False)) for t in (prompt, longer))
    medusa, medusa_long = (run(store, t, drafter_for("medusa", loaded, tmp_path / "medusa", False))
                           for t in (prompt, longer))
    assert _computed_beside(plain_long, [plain]) and _computed_beside(medusa_long, [plain])
    assert _computed_beside(eagle_long, [eagle]) and not _computed_beside(eagle_long, [plain])
    assert not _computed_beside(medusa, [plain])  # (its one block ends at its last prompt row)
    empty = PrefixStore(0)
    assert not _computed_beside(run(empty, longer), [run(empty, prompt)])
