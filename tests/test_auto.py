"""``--k auto`` (cost curve + running α estimate) and ``--eps auto`` (the target's own NLL)."""

from __future__ import annotations

import pytest
import torch

from speculate import SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.policy import auto
from speculate.policy.auto import AutoK, calibrate_eps, mean_nll, profile_for, profile_path
from speculate.policy.speedup import best_k, expected_tokens
from speculate.drafters import get_drafter
from speculate.errors import SpeculateError
from speculate.stats import Stats

from conftest import noisy_copy

# MKL-like step: 1-3 rows cost the same, a 4th row doubles the cost (a stylised form of the fp32 step at 4
# rows, docs/benchmarks.md, "Verification cost T(n)").
STEP = {1: 1.0, 2: 1.02, 3: 1.05, 4: 2.0, 5: 2.05, 6: 2.1, 7: 2.6, 8: 2.7, 9: 2.8}


def test_auto_k_follows_the_estimated_alpha():
    policy = AutoK(STEP, c=0.1, alpha0=0.6, prior_weight=4)
    assert policy.alpha == pytest.approx(0.6)
    assert policy.next_k() == best_k(STEP, 0.6, 0.1)[0]
    for _ in range(200):  # every draft accepted: α̂ → 1, the longest k the step curve pays for
        policy.update(policy.next_k(), policy.next_k())
    assert policy.alpha > 0.99 and policy.next_k() == best_k(STEP, 0.99, 0.1)[0]
    policy.reset()
    for _ in range(200):  # every first draft rejected: α̂ → 0, k = 1
        policy.update(3, 0)
    assert policy.alpha < 0.03 and policy.next_k() == 1
    # The table is best_k's answer at every grid point; at high α this step curve never drafts 3 < k < 7.
    assert policy.table == [best_k(STEP, i / 100, 0.1)[0] for i in range(100)]
    assert best_k(STEP, 0.9, 0.1)[0] == 2


def test_alpha_estimate_is_the_geometric_mle():
    policy, stats = AutoK(STEP, 0.0, prior_weight=0.0, alpha0=0.0), Stats()
    for drafted, accepted in [(4, 4), (4, 1), (2, 0), (3, 3)]:  # 8 successes, 2 rejecting rounds
        policy.update(drafted, accepted)
        stats.record(drafted, accepted)
    assert policy.alpha == pytest.approx(8 / 10) == stats.alpha_estimate
    assert stats.rejected_rounds == 2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))
    return tmp_path


def test_k_auto_is_lossless_and_measures_the_curve_once(tiny, cache, monkeypatch):
    target, draft = tiny[0], noisy_copy(tiny[0], 0.1)
    prompt = "abcabcabc hello hello hello abcabc"
    ref = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(prompt, max_new_tokens=40)
    # model+lookup's copies (12) are longer than the cost curve reaches (k_max + 1 rows): k auto prices its depth k
    # at T(k + 1), what the draft model's rounds verify.
    for drafter in (get_drafter("lookup"), get_drafter("model", draft, target),
                    get_drafter("model+lookup", draft, target, min_match=1, lookup_k=12)):
        dec = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k="auto"), drafter=drafter)
        out = dec.generate(prompt, max_new_tokens=40)
        assert out.token_ids == ref.token_ids, drafter.name
        assert isinstance(dec.k_policy, AutoK) and dec.spec.k == "auto"
        deepest = 12 if drafter.name == "model+lookup" else auto.AUTO_K_MAX  # it drafted, never past k_max
        assert 1 <= len(out.stats.drafted_by_position) <= deepest
    assert profile_path(target).is_file() and profile_path(target, draft).is_file()
    assert profile_for(target, draft).c is not None

    def fail(*a, **k):
        raise AssertionError("the cached profile should have been used")

    monkeypatch.setattr(auto, "measure_profile", fail)
    SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k="auto"),
                       drafter=get_drafter("model", draft, target))


def test_a_kernel_build_for_other_instructions_has_its_own_profile(tiny, cache, monkeypatch):
    """SPECULATE_KERNEL_FLAGS builds the kernels for other instructions (AVX2, scalar): a cost profile measured with
    the native build must not be read for them."""
    from speculate.models import kernel

    def path(flags):
        monkeypatch.setenv("SPECULATE_KERNEL_FLAGS", flags)
        kernel.source_digest.cache_clear()
        return profile_path(tiny[0])

    try:
        native, avx2, scalar = path(""), path("-march=x86-64-v3"), path("-march=x86-64-v2")
        assert len({native, avx2, scalar}) == 3 and path("") == native
    finally:
        kernel.source_digest.cache_clear()


def test_mean_nll_equals_a_direct_computation(tiny):
    loaded = tiny[1]
    text = "the quick brown fox jumps over the lazy dog " * 3
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = loaded.model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    direct = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item()
    value, count = mean_nll(loaded, text)
    assert count == len(ids) - 1 and value == pytest.approx(direct, rel=1e-5)
    # In windows of 10 tokens, each window's first token goes unscored.
    value10, count10 = mean_nll(loaded, text, chunk=10)
    expected = []
    for start in range(0, len(ids) - 1, 9):
        w = ids[start:start + 10]
        if len(w) < 2:
            break
        with torch.no_grad():
            lp = loaded.model(torch.tensor([w])).logits[0, :-1].log_softmax(-1)
        expected += (-lp[torch.arange(len(w) - 1), torch.tensor(w[1:])]).tolist()
    assert count10 == len(expected) and value10 == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_eps_auto_sets_the_consultant_threshold(tiny):
    target = tiny[2]
    eps = calibrate_eps(target)
    assert eps == pytest.approx(mean_nll(target, auto.calibration_text())[0])
    dec = SpeculativeDecoder(target,
                             SpeculativeSpec("lookup", verifier="consultant", k=3, params={"eps": "auto", "beta": 0.2}))
    assert dec._verifier(dec_sampling()).eps == pytest.approx(eps)
    with pytest.raises(SpeculateError, match="consultant"):
        SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="typical", params={"eps": "auto"}))


def dec_sampling():
    from speculate.sampling import SamplingParams

    return SamplingParams()


def test_calc_eps_auto_prints_the_calibrated_value(tiny_folders, tiny, capsys):
    from speculate.cli import main

    assert main(["calc", "--eps-auto", "--model", str(tiny_folders[0])]) == 0
    out = capsys.readouterr().out
    assert f"{calibrate_eps(tiny[0]):.3f} nats per token" in out and "Chinchilla estimate" in out
    assert main(["calc", "--eps-auto", "--calibration", "/no/such/file", "--model", str(tiny_folders[0])]) == 2


def test_weight_bytes_count_what_a_step_reads(tiny_folders, cache):
    """fp32: four bytes per parameter (the tied LM head counted once, as the head; the embedding table is
    not read whole); int8: a byte per linear weight plus its scales, and the fp32 norms."""
    from speculate import load_model
    from speculate.models.quantize import Int8Linear, weight_bytes

    fp32 = load_model(str(tiny_folders[0]))
    assert fp32.model.config.tie_word_embeddings
    assert weight_bytes(fp32.model) == 4 * sum(p.numel() for p in fp32.model.parameters())
    int8 = load_model(str(tiny_folders[0]), dtype="int8")
    linears = [m for m in int8.model.modules() if isinstance(m, Int8Linear)]
    norms = [p for n, p in int8.model.named_parameters() if "norm" in n]
    assert len(linears) == 4 * int8.model.config.num_hidden_layers + 1  # fused qkv, o, gate_up, down; head
    expected = sum(m.in_features * m.out_features + 4 * m.out_features for m in linears)
    assert weight_bytes(int8.model) == expected + 4 * sum(p.numel() for p in norms)


def test_k_auto_with_heads_uses_their_weight_ratio_as_the_draft_cost(tiny, cache, tmp_path):
    """Heads have no draft model to profile: --k auto takes c from the bytes they read per drafted token
    against the target's, and needs only the target's own cost curve."""
    from speculate.heads import save_heads
    from speculate.heads.train import make_heads
    from speculate.models.quantize import weight_bytes

    target = tiny[0]
    save_heads(tmp_path, make_heads("eagle", target, None, None), target.name, 259)
    drafter = get_drafter("eagle-chain", target=target, heads=tmp_path)
    c = drafter.relative_cost()
    assert c == pytest.approx((weight_bytes(drafter.head) + weight_bytes(drafter.lm)) / weight_bytes(target.model))
    assert 0.05 < c < 1
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k="auto"), drafter=drafter)
    prof = profile_for(target)
    assert profile_path(target).is_file()
    assert decoder.k_policy.table == [best_k(prof.curve, i / 100, c, auto.AUTO_K_MAX)[0] for i in range(100)]
    assert get_drafter("lookup").relative_cost() == 0.0
    assert get_drafter("model", noisy_copy(target, 0.1), target).relative_cost() is None  # measured instead
    # A tree verifies all its nodes: depth k costs T(max_nodes(k) + 1), and k stops where the profile
    # (n <= 9) no longer covers the tree (EAGLE's default 2k - 2 nodes: k <= 5).
    tree = get_drafter("eagle", target=target, heads=tmp_path)
    policy = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k="auto"), drafter=tree).k_policy
    rows = [tree.max_nodes(k) + 1 for k in range(1, 7)]
    assert rows == [2, 3, 5, 7, 9, 11]
    assert policy.table == [best_k(prof.curve, i / 100, c, auto.AUTO_K_MAX, lambda k: tree.max_nodes(k) + 1)[0]
                            for i in range(100)]
    assert max(policy.table) <= 5


def test_best_k_prices_a_tree_by_its_nodes():
    """On the step curve a chain of 2 (3 rows) is the best at high α; a tree of depth 2 with 5 nodes
    verifies 6 rows, past the step, so depth 1 (2 nodes, 3 rows) wins; k is capped where the curve
    ends."""
    assert best_k(STEP, 0.9, 0.1)[0] == 2
    nodes = {1: 2, 2: 5, 3: 8, 4: 11}
    k, s = best_k(STEP, 0.9, 0.1, rows=lambda k: nodes.get(k, 99) + 1)
    assert k == 1 and s == pytest.approx(expected_tokens(0.9, 1) / (STEP[3] + 0.1))
    assert best_k(STEP, 0.99, 0.0, rows=lambda k: 2 * k + 1)[0] <= 4  # rows 2k + 1 <= 9


def test_the_batch_cost_curve_is_measured_once_and_then_read_back(tiny, cache, capsys, monkeypatch):
    """The batch curve (n = 1, 2, 4, ..., sampled) is cached like the others and read back at the next start, not
    measured again: a server measured it at every start, and its planner once more in its first batch."""
    from speculate.policy import profile

    first = profile_for(tiny[0], batch=True)
    assert "measuring" in capsys.readouterr().err
    assert sorted(first.target_seconds)[:4] == [1, 2, 4, 8]
    monkeypatch.setattr(auto, "measure_profile", lambda *a, **k: pytest.fail("measured again"))
    again = profile_for(tiny[0], batch=True)
    assert again.target_seconds == first.target_seconds and "measuring" not in capsys.readouterr().err
    # A sampled curve still needs T(1); a gapless one is still required where no sampling is declared.
    with pytest.raises(SpeculateError, match="n = 1"):
        profile.Profile.from_dict({**first.to_dict(), "target_seconds": {"2": 0.1, "4": 0.2}}, sampled=True)
    with pytest.raises(SpeculateError, match="without gaps"):
        profile.Profile.from_dict(first.to_dict())


def test_a_curve_measured_on_a_busy_machine_is_measured_again_and_not_cached(tiny, cache, capsys, monkeypatch):
    """A profile timed while other processes took the CPUs (or whose T(n) falls as n grows) is not this machine's
    curve: measured again, up to three times, the first quiet one cached; if none is quiet, the least busy one serves
    the run, with one warning line, and nothing is cached (the next run measures again)."""
    from speculate.policy import profile

    # busy_share: the others' ticks over the machine's (clock ticks per second x seconds x CPUs).
    hz, cpus = profile.os.sysconf("SC_CLK_TCK"), profile.os.cpu_count()
    assert profile.busy_share((100, 40), (100 + hz * cpus, 40 + hz * cpus // 2), 1.0) == pytest.approx(0.5, abs=0.01)
    assert profile.busy_share((100, 40), (100 + hz, 40 + hz), 2.0) == 0.0  # all of it this process's own
    assert profile.busy_share(None, (1, 1), 1.0) is None
    ticks = profile.cpu_ticks()
    assert ticks is None or (ticks[0] >= ticks[1] >= 0)

    def made(seconds, busy):
        return profile.Profile(target_seconds=dict(enumerate(seconds, 1)), model="m", busy=busy)

    monkeypatch.setenv("SPECULATE_BUSY_TOLERANCE", "0.25")  # (the product's default; the suite's conftest sets 1)
    assert made([1.0, 1.1, 1.2], 0.1).doubtful() is None
    assert made([1.0, 1.1, 1.2], 0.9).doubtful(tolerance=1.0) is None
    assert "40%" in made([1.0, 1.1, 1.2], 0.4).doubtful()
    assert "T(3)" in made([1.0, 1.1, 0.7], None).doubtful()  # faster over 3 rows than over 2: noise
    assert made([1.0, 0.8, 1.2], None).doubtful() is None  # (within a quarter: kept)
    # Nor may a cost per row rise past ceil(n / m) x T(m) (n rows fit in that many forwards of m): the batch curve a
    # server measured at its start on the EPYC, against the one it measured quiet.
    kinked = {1: 1.0, 2: 1.5, 4: 1.80, 8: 4.80, 16: 6.28, 32: 16.06}
    quiet = {1: 1.0, 2: 1.49, 4: 2.25, 8: 4.09, 16: 7.24, 32: 13.45}
    assert "T(8) measured 2.67x T(4)" in profile.Profile(target_seconds=kinked, busy=0.12).doubtful()
    assert profile.Profile(target_seconds=quiet, busy=0.12).doubtful() is None
    assert "T(2)" in made([1.0, 2.6], None).doubtful() and made([1.0, 2.4, 4.9], None).doubtful() is None
    assert profile.Profile(target_seconds=kinked, busy=0.9).doubtful(tolerance=1.0) is None

    real = auto.measure_profile
    for busy, want_tries, cached in (([0.6, 0.3, 0.1], 3, True), ([0.6, 0.2], 2, True), ([0.9, 0.5, 0.7], 3, False)):
        tries = []

        def measured(*a, **k):
            prof = real(*a, **k)
            prof.busy = busy[len(tries)]
            # Only the busy share decides here: a tiny model's curve timed beside other work may fall with n, which
            # Profile.doubtful also refuses (checked above), so the measured times are replaced by a rising curve.
            prof.target_seconds = {n: 1e-3 * n for n in prof.target_seconds}
            tries.append(prof)
            return prof

        monkeypatch.setattr(auto, "measure_profile", measured)
        path = auto.profile_path(tiny[0]).with_name(auto.profile_path(tiny[0]).stem + "-batch.json")
        path.unlink(missing_ok=True)
        capsys.readouterr()
        got = profile_for(tiny[0], batch=True)
        err = capsys.readouterr().err
        assert len(tries) == want_tries and path.is_file() == cached
        if cached:
            assert got is tries[-1] and profile.load_profile(path, sampled=True).busy == busy[-1]
            assert "warning" not in err
        else:
            assert got is tries[1]  # the least busy (0.5)
            assert err.count("warning") == 1 and "50% of the CPUs" in err and "not cached" in err
    monkeypatch.setenv("SPECULATE_BUSY_TOLERANCE", "lots")
    with pytest.raises(SpeculateError, match="SPECULATE_BUSY_TOLERANCE must be a share"):
        made([1.0, 1.1], 0.1).doubtful()
