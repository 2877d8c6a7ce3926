"""The measured gate over the batch planner (speculate/policy/gate.py): rounds as planned against rounds plain, the
faster one run and the other probed; and through the planner, k changes while the tokens do not."""

from __future__ import annotations

import pytest

from speculate.policy.gate import DraftGate, bucket


def drive(gate, rounds, rate, key="k", start=0):
    """``rounds`` decisions of ``gate`` for ``key``, each recorded at ``rate(drafted, i)`` = (tokens, seconds);
    returns the decisions."""
    out = []
    for i in range(start, start + rounds):
        drafted = gate.draft(key)
        gate.record(key, drafted, *rate(drafted, i))
        out.append(drafted)
    return out


def test_buckets_are_exact_to_eight_then_four_per_doubling():
    assert [bucket(n) for n in range(1, 9)] == list(range(1, 9))
    assert [bucket(n) for n in (9, 10, 11, 15, 16, 19, 20, 31, 32, 39, 40, 63, 64)] == \
        [8, 10, 10, 14, 16, 16, 20, 28, 32, 32, 40, 56, 64]


def test_arms_alternate_until_each_is_measured_then_the_faster_runs_and_the_slower_is_probed():
    gate = DraftGate(explore=4)
    # Drafting gives 1 token in 1.1 s, plain 1 token in 1 s: 0.91x, a lead below 1.2, so plain runs and drafting is
    # probed every 8th decision.
    slow = drive(gate, 200, lambda drafted, i: (1, 1.1 if drafted else 1.0))
    assert slow[:8] == [True, False] * 4
    assert [i + 1 for i, d in enumerate(slow[8:], start=8) if d] == list(range(16, 201, 8))
    assert gate.withheld == 200 - sum(slow)
    # Drafting twice as fast (a copying workload): it runs, and plain is probed every 32nd decision.
    gate = DraftGate(explore=4)
    fast = drive(gate, 200, lambda drafted, i: (2 if drafted else 1, 1.0))
    assert [i + 1 for i, d in enumerate(fast[8:], start=8) if not d] == list(range(32, 201, 32))
    # A lead between 1.2 and 1.5: every 16th.
    gate = DraftGate(explore=4)
    mid = drive(gate, 100, lambda drafted, i: (1.3 if drafted else 1, 1.0))
    assert [i + 1 for i, d in enumerate(mid[8:], start=8) if not d] == [16, 32, 48, 64, 80, 96]


def test_the_gate_follows_a_change_of_workload_both_ways():
    gate = DraftGate()
    drive(gate, 100, lambda drafted, i: (3 if drafted else 1, 1.0))  # copying: drafting pays 3x
    # The prompts change: drafting now gives 1 token in 1.2 s. It is the arm that runs, so it is re-measured every
    # round, and plain takes over once the decayed sums have forgotten the 3x rounds (0.9^n of their weight left).
    after = drive(gate, 60, lambda drafted, i: (1, 1.2 if drafted else 1.0), start=100)
    switch = next(i for i in range(len(after)) if sum(after[i:]) <= len(after[i:]) // 8 + 1)
    assert 15 <= switch <= 30 and sum(after[-32:]) == 4  # (then drafting is a probe every 8th round)
    # And back: one probe that drafts 3 tokens a round is enough to hand the rounds back to drafting.
    back = drive(gate, 40, lambda drafted, i: (3 if drafted else 1, 1.0), start=160)
    first_probe = back.index(True)
    assert first_probe < 8 and all(back[first_probe:first_probe + 20])


def test_keys_are_measured_apart_and_bad_settings_are_refused():
    gate = DraftGate()
    drive(gate, 50, lambda drafted, i: (1, 2.0 if drafted else 1.0), key=(32, ("lookup",)))
    drive(gate, 50, lambda drafted, i: (4 if drafted else 1, 1.0), key=(1, ("lookup",)))
    rates = gate.rates()
    assert rates[(32, ("lookup",))] == pytest.approx((0.5, 1.0))
    assert rates[(1, ("lookup",))] == pytest.approx((4.0, 1.0))
    assert not gate.draft((32, ("lookup",))) or gate.turns[(32, ("lookup",))] % 8 == 0
    assert gate.draft((1, ("lookup",))) or gate.turns[(1, ("lookup",))] % 32 == 0
    for bad in ({"decay": 1.0}, {"decay": 0.0}, {"explore": 0}):
        with pytest.raises(ValueError):
            DraftGate(**bad)


def test_the_planner_withholds_drafts_that_measure_slower_and_the_tokens_stay_the_same(tiny, monkeypatch):
    """Rounds of four lookup generations with the server's k as a cap, on a curve where rows are free and at an α of
    0.9 (so the plan drafts the whole cap): told that drafted rounds take twice as long, the planner runs plain but for
    probes; every generation is still exactly its plain greedy decoding."""
    from speculate import SpeculativeDecoder
    from speculate.engine import step
    from speculate.policy import batch
    from speculate.policy.batch import BatchPlanner
    from speculate.spec import SpeculativeSpec

    monkeypatch.setattr(batch, "_alpha", lambda run: 0.9)

    target = tiny[0]
    prompts = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [7, 8, 9] * 4, [10, 11], [12, 13, 14, 12, 13, 14, 12]]
    decoder = SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="greedy", k=5))
    runs = [decoder.start(p, max_new_tokens=48) for p in prompts]
    for run in runs:
        run.k_is_cap = True
    planner = BatchPlanner(target)
    planner._curve = {1: 1.0, 2: 1.0, 256: 1.0}  # rows for free: the plan drafts the cap
    plans, recorded = [], 0
    while not all(run.done for run in runs):
        live = [run for run in runs if not run.done]
        ks = planner(live)
        plans.append(ks)
        drafted = planner._pending is not None and planner._pending[1]
        recorded += planner._pending is not None
        step(live, ks)
        planner.observe(live, 2.0 if drafted else 1.0)
    assert plans[0] is None  # (the first round feeds the prompts: nothing to plan)
    assert plans[1] == [5, 5, 5, 5] and plans[2] == [0, 0, 0, 0]  # exploring: as planned, then plain
    arms = planner.gate.arms[(4, ("lookup",))]
    assert arms[True].rounds >= 4 and arms[False].rounds >= 4
    assert recorded == sum(arm.rounds for both in planner.gate.arms.values() for arm in both.values())
    late = [ks for ks in plans[10:] if ks is not None and len(ks) == 4]
    assert len(late) >= 16 and sum(any(ks) for ks in late) <= len(late) // 8 + 1
    assert all(ks in ([5] * 4, [0] * 4) for ks in late) and planner.gate.withheld >= len(late) - len(late) // 8 - 1
    for run, prompt in zip(runs, prompts):
        plain = SpeculativeDecoder(target, SpeculativeSpec("none", verifier="greedy")).generate(
            prompt, max_new_tokens=48, chat=False)
        assert run.generation.token_ids == plain.token_ids


def test_a_batch_of_one_is_gated_and_prefill_rounds_are_not_measured(tiny):
    from speculate import SpeculativeDecoder
    from speculate.policy.batch import BatchPlanner
    from speculate.spec import SpeculativeSpec

    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k=5))
    planner = BatchPlanner(tiny[0])
    alone = decoder.start([3], max_new_tokens=20)
    alone.k_is_cap = True
    assert planner([alone]) == [5] and planner._pending == ((1, ("lookup",)), True, 0)  # its own policy's k
    planner.observe([alone], 1.0)
    assert planner([alone]) == [0]  # exploring: the plain round
    named = decoder.start([3], max_new_tokens=20)  # a k the request named is not the planner's
    assert planner([named]) is None
    prefilling = decoder.start(list(range(3, 40)), max_new_tokens=20, prefill_chunk=8)
    assert prefilling.prefilling
    planner([alone, prefilling])
    assert planner._pending is None  # a round with a prefill chunk does not time decoding
