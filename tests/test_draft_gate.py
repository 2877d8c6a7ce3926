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


def test_arms_alternate_until_each_is_measured_then_the_faster_runs_and_the_slower_is_probed_ever_less_often():
    gate = DraftGate(explore=4)
    # Drafting gives 1 token in 1.1 s, plain 1 token in 1 s: plain takes the lead at the 9th decision, and drafting is
    # probed 8 decisions later, then after 16, 32, and every 64 from then on.
    slow = drive(gate, 200, lambda drafted, i: (1, 1.1 if drafted else 1.0))
    assert slow[:8] == [True, False] * 4
    assert [i + 1 for i, d in enumerate(slow[8:], start=8) if d] == [16, 32, 64, 128, 192]
    assert gate.withheld == 200 - sum(slow) and gate.leader["k"] is False
    # Drafting twice as fast (a copying workload): it runs, and plain is probed on the same schedule.
    gate = DraftGate(explore=4)
    fast = drive(gate, 200, lambda drafted, i: (2 if drafted else 1, 1.0))
    assert [i + 1 for i, d in enumerate(fast[8:], start=8) if not d] == [16, 32, 64, 128, 192]
    assert gate.withheld == 4 + 5  # (the exploration's plain rounds, then the probes)


def test_the_gate_follows_a_change_of_workload_both_ways():
    gate = DraftGate()
    drive(gate, 300, lambda drafted, i: (3 if drafted else 1, 1.0))  # copying: drafting pays 3x, probes every 64
    # The prompts change: drafting now gives 1 token in 1.2 s. It is the arm that runs, so it is re-measured every
    # round, and plain takes over once the decayed sums have forgotten the 3x rounds (0.9^n of their weight left);
    # then drafting is probed 8 rounds later, and after 16.
    after = drive(gate, 60, lambda drafted, i: (1, 1.2 if drafted else 1.0), start=300)
    switch = next(i for i in range(len(after)) if not any(after[i:i + 7]))  # (an earlier plain round: a probe)
    assert 15 <= switch <= 30 and gate.leader["k"] is False
    assert [i - switch + 1 for i, d in enumerate(after) if d and i > switch] == [8, 24]
    # And back: the next probe that drafts 3 tokens a round hands the rounds back to drafting.
    back = drive(gate, 80, lambda drafted, i: (3 if drafted else 1, 1.0), start=360)
    first_probe = back.index(True)
    assert first_probe < 32 and all(back[first_probe:first_probe + 7]) and gate.leader["k"] is True


def test_keys_are_measured_apart_and_bad_settings_are_refused():
    gate = DraftGate()
    drive(gate, 50, lambda drafted, i: (1, 2.0 if drafted else 1.0), key=(32, ("lookup",)))
    drive(gate, 50, lambda drafted, i: (4 if drafted else 1, 1.0), key=(1, ("lookup",)))
    assert gate.rates() == {(32, ("lookup",)): pytest.approx((0.5, 1.0)), (1, ("lookup",)): pytest.approx((4.0, 1.0))}
    assert gate.leader == {(32, ("lookup",)): False, (1, ("lookup",)): True}
    for bad in ({"decay": 1.0}, {"decay": 0.0}, {"explore": 0}, {"first_probe": 0}, {"first_probe": 9,
                                                                                      "longest_wait": 8}):
        with pytest.raises(ValueError):
            DraftGate(**bad)


def test_the_planner_withholds_drafts_that_measure_slower_and_the_tokens_stay_the_same(tiny, seen, monkeypatch):
    """Rounds of four lookup generations with the server's k as a cap, on a curve where rows are free and at an α of
    0.9 (so the plan drafts the whole cap): told that drafted rounds take twice as long, the planner runs plain but for
    probes; every generation is still exactly its plain greedy decoding."""
    from speculate import SpeculativeDecoder
    from speculate.engine import step
    from speculate.policy import batch
    from speculate.policy.batch import BatchPlanner
    from speculate.spec import SpeculativeSpec

    monkeypatch.setattr(batch, "_alpha", lambda run: 0.9)  # (and, with `seen`, planned at that α from the first round)

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
    assert plans[0] == [0, 0, 0, 0]  # (the first round feeds the prompts, every run joining: none drafts)
    assert plans[1] == [5, 5, 5, 5] and plans[2] == [0, 0, 0, 0]  # exploring: as planned, then plain
    arms = planner.gate.arms[(4, ("lookup",))]
    assert arms[True].rounds >= 4 and arms[False].rounds >= 4
    assert recorded == sum(arm.rounds for both in planner.gate.arms.values() for arm in both.values())
    late = [ks for ks in plans[10:] if ks is not None and len(ks) == 4]
    assert len(late) >= 16 and sum(any(ks) for ks in late) <= 2  # (probes: 8 and 24 rounds after plain led)
    assert all(ks in ([5] * 4, [0] * 4) for ks in late) and planner.gate.withheld >= len(late) - 2
    for run, prompt in zip(runs, prompts):
        plain = SpeculativeDecoder(target, SpeculativeSpec("none", verifier="greedy")).generate(
            prompt, max_new_tokens=48, chat=False)
        assert run.generation.token_ids == plain.token_ids


def test_a_batch_of_one_keeps_its_own_policy_and_prefill_rounds_are_not_measured(tiny, seen):
    from speculate import SpeculativeDecoder
    from speculate.policy.batch import BatchPlanner
    from speculate.spec import SpeculativeSpec

    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k=5))
    planner = BatchPlanner(tiny[0])
    planner._curve = {1: 1.0, 2: 1.0, 256: 1.0}
    runs = [decoder.start([3], max_new_tokens=20) for _ in range(2)]
    for run in runs:
        run.k_is_cap = True
    assert planner(runs[:1]) == [5] and planner._pending is None  # alone: planned (rows free: the cap), not gated
    assert BatchPlanner(tiny[0], alone=False)(runs[:1]) is None  # (or left to its own policy)
    assert planner(runs) == [5, 5] and planner._pending == ((2, ("lookup",)), True, 0)
    planner.observe(runs, 1.0)
    assert planner(runs) == [0, 0]  # exploring: the plain round
    prefilling = decoder.start(list(range(3, 40)), max_new_tokens=20, prefill_chunk=8)
    assert prefilling.prefilling
    assert planner([*runs, prefilling])[2] is None
    assert planner._pending is None  # a round with a prefill chunk does not time decoding


def test_a_gate_switched_off_drafts_as_planned_and_still_times_both_arms(tiny):
    """``speculate serve --no-draft-gate``: the server's planner drafts whenever the plan does, and its rounds are still
    timed, for /metrics."""
    from speculate.server import ServerConfig
    from speculate.server.app import create_app

    off = DraftGate(enabled=False)
    drive(off, 40, lambda drafted, i: (1, 2.0 if drafted else 1.0))  # drafting twice as slow: the gate would withhold
    assert off.withheld == 0 and off.arms["k"][True].rounds == 40 and off.arms["k"][True].rate == pytest.approx(0.5)
    on = DraftGate()
    drive(on, 40, lambda drafted, i: (1, 2.0 if drafted else 1.0))
    assert on.withheld > 20
    for enabled in (True, False):
        app = create_app(ServerConfig(model=str(tiny[0].name), draft_gate=enabled), tiny[0])
        gate = app.state.planner.gate
        assert gate.enabled is enabled and app.state.metrics.gate is gate
