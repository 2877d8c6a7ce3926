"""k by batch size (speculate/policy/batch.py): the planner's choices on constructed cost curves and acceptance rates."""

from __future__ import annotations

import pytest

from speculate.policy.batch import interpolate, plan
from speculate.policy.speedup import expected_tokens


def chain(k):
    return k + 1


def choose(alphas, curve, k_max=8, fixed=None, costs=None):
    n = len(alphas)
    return plan(list(alphas), fixed or [None] * n, [k_max] * n, [chain] * n, costs or [0.0] * n, curve)


def rate(ks, alphas, curve):
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks)) / interpolate(curve, sum(k + 1 for k in ks))


def test_interpolation_is_exact_at_the_points_linear_between_and_extrapolated_past_them():
    curve = {1: 1.0, 2: 1.2, 4: 1.5, 8: 3.5}
    assert interpolate(curve, 4) == 1.5
    assert interpolate(curve, 3) == pytest.approx(1.35)
    assert interpolate(curve, 6) == pytest.approx(2.5)
    assert interpolate(curve, 12) == pytest.approx(5.5)  # the last segment's slope, continued


def test_a_free_verification_drafts_to_the_limit_and_a_linear_one_not_at_all():
    flat = {1: 1.0, 2: 1.0, 256: 1.0}
    assert choose([0.7, 0.5, 0.9], flat) == [8, 8, 8]
    linear = {1: 1.0, 2: 2.0, 256: 256.0}  # every row costs a full step: no draft can pay for itself
    assert choose([0.7, 0.5, 0.9], linear) == [0, 0, 0]


def test_drafts_shrink_as_the_batch_grows_and_go_to_the_likeliest_generations():
    # A CPU-like curve: rows are nearly free up to 8, then cost grows linearly.
    curve = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.4, 32: 4.4, 64: 8.4, 128: 16.4, 256: 32.4}
    totals = [sum(choose([0.8] * n, curve)) / n for n in (1, 4, 16)]
    assert totals[0] > totals[1] > totals[2]
    ks = choose([0.9, 0.3, 0.9, 0.3], curve)
    assert ks[0] == ks[2] > ks[1] == ks[3]  # the same α gets the same k; the likelier, more


def test_the_greedy_choice_is_no_worse_than_any_uniform_k():
    curve = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6, 16: 2.5, 32: 4.5, 64: 8.5, 128: 16.5, 256: 32.5}
    for alphas in ([0.8] * 8, [0.95, 0.2, 0.6, 0.6, 0.85, 0.4], [0.5] * 16):
        ks = choose(alphas, curve)
        best_uniform = max(rate([k] * len(alphas), alphas, curve) for k in range(9))
        assert rate(ks, alphas, curve) >= best_uniform - 1e-9


def test_fixed_lengths_are_kept_and_their_rows_counted():
    curve = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.4, 32: 4.4, 64: 8.4, 128: 16.4, 256: 32.4}
    ks = plan([0.8, 0.8], [30, None], [0, 8], [chain, chain], [0.0, 0.0], curve)
    # The fixed generation keeps its 30; the other's k is the best given those 31 rows (here: more than alone,
    # since the big forward makes each extra row relatively cheap).
    def with_fixed(k):
        return (expected_tokens(0.8, 30) + expected_tokens(0.8, k)) / interpolate(curve, 31 + k + 1)
    assert ks[0] == 30 and ks[1] == max(range(9), key=with_fixed)
    # A prefill chunk (α None: no token this round) is a fixed block of rows.
    assert plan([None, 0.8], [127, None], [0, 8], [chain, chain], [0.0, 0.0], curve)[0] == 127
    # A draft that costs time of its own (a draft model: c per token) is drafted less.
    assert sum(choose([0.8] * 4, curve, costs=[0.3] * 4)) < sum(choose([0.8] * 4, curve))


def test_the_servers_default_k_is_a_cap_the_planner_lowers_where_drafting_does_not_pay(tiny, seen):
    """A fixed k the request did not name (``Run.k_is_cap``, the server's --k) is planned like auto up to that k: no
    draft where every row costs a full step, the whole k where rows are free; a k the request named is kept, and so
    is a draft model's (its cost needs its own profile)."""
    from speculate import SamplingParams, SpeculativeDecoder
    from speculate.policy.batch import BatchPlanner
    from speculate.spec import SpeculativeSpec

    def runs(caps, drafter="lookup", draft_model=None):
        out = []
        for cap in caps:
            spec = SpeculativeSpec(drafter, verifier="greedy", k=5)
            # (a one-token prompt: nothing to prefill, no round yet, so the planner plans decoding rows at the prior α;
            # a longer prompt's first step would also be its first round, Run.joins)
            run = SpeculativeDecoder(tiny[0], spec, draft_model=draft_model).start([3], max_new_tokens=20)
            assert not run.prefilling
            run.k_is_cap = cap
            out.append(run)
        return out

    planner = BatchPlanner(tiny[0])
    planner._curve = {1: 1.0, 2: 2.0, 256: 256.0}  # every row a full step: drafting never pays
    assert planner(runs([True, True, True])) == [0, 0, 0]
    # The request that named k=5 keeps it; its 6 rows at α 0.6 make a draft of the others pay a little.
    lookup_c = runs([True])[0].drafter.relative_cost()
    assert planner(runs([True, False, True])) == plan([0.6] * 3, [None, 5, None], [5, 0, 5], [chain] * 3,
                                                      [lookup_c, 0.0, lookup_c], planner._curve) == [1, 5, 1]
    assert planner(runs([False, False])) is None  # nothing to plan: each keeps its own k
    assert planner(runs([True, True], "model", tiny[1])) is None  # a draft model's k is kept
    planner._curve = {1: 1.0, 2: 1.0, 256: 1.0}  # rows for free: the whole cap, never past it
    assert planner(runs([True, True, False])) == [5, 5, 5]
    planner._curve = {1: 1.0, 2: 2.0, 256: 256.0}
    seeded = runs([True, True])
    seeded[0].sampling = SamplingParams(temperature=0.8, seed=3, max_new_tokens=20)  # its draws follow its drafts
    ks = planner(seeded)
    assert ks[0] == 5 and ks[1] < 5  # (the other is planned: a draft of 1 pays beside 6 kept rows, as above)


def test_a_request_that_names_its_k_keeps_it_and_the_servers_default_is_a_cap(tiny_folders, tiny):
    from speculate.server import ServerConfig
    from speculate.server.decoders import Decoders
    from speculate.server.generation import build_decoder, open_run, prepare
    from speculate.server.schemas import CompletionRequest
    from speculate.spec import SpeculativeSpec

    config = ServerConfig(model=str(tiny_folders[0]), spec=SpeculativeSpec("lookup", k=4))

    def prepared(speculative=None):
        body = {"model": config.model, "prompt": [3, 4, 5], "max_tokens": 4}
        if speculative is not None:
            body["speculative"] = speculative
        return prepare(config, tiny[0], CompletionRequest.model_validate(body))[0]

    assert not prepared().k_named and not prepared({"drafter": "lookup"}).k_named
    assert prepared({"k": 4}).k_named and prepared({"k": 2}).spec.k == 2
    decoders = Decoders(lambda spec: build_decoder(tiny[0], None, spec), keep=2)
    assert open_run(prepared(), decoders)[0].k_is_cap
    assert not open_run(prepared({"k": 4}), decoders)[0].k_is_cap


def test_a_fixed_k_runs_alpha_has_the_prior_so_one_rejected_draft_does_not_stop_its_drafts(tiny, seen):
    """A fixed-k run's α is its own statistics under AutoK's prior (0.6 over 4 pseudo-rounds): after one rejected draft
    it is 2.4 / 5, not 0, so a batch where drafting at that α pays plans it a draft again; its α then follows its own
    rounds."""
    from speculate import SpeculativeDecoder
    from speculate.policy.batch import BatchPlanner, _alpha
    from speculate.spec import SpeculativeSpec

    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k=5))
    runs = [decoder.start([3], max_new_tokens=20) for _ in range(2)]
    for run in runs:
        run.k_is_cap = True
    assert _alpha(runs[0]) == pytest.approx(0.6)
    runs[0].stats.rejected_rounds = 1  # (one draft, rejected)
    assert _alpha(runs[0]) == pytest.approx(2.4 / 5)
    runs[1].stats.accepted_draft_tokens, runs[1].stats.rejected_rounds = 30, 10
    assert _alpha(runs[1]) == pytest.approx(32.4 / 44)
    planner = BatchPlanner(tiny[0])
    # A curve where a row costs a fifth of a step: a draft at α 0.48 raises the batch's tokens per step (2 / 1.2 ->
    # 2.48 / 1.4); at α 0 it could not.
    planner._curve = {1: 1.0, 2: 1.2, 256: 52.0}
    ks = planner(runs)
    assert plan([0.0, 32.4 / 44], [None, None], [5, 5], [chain, chain], [0.0, 0.0], planner._curve)[0] == 0
    assert ks[0] >= 1 and ks == plan([2.4 / 5, 32.4 / 44], [None, None], [5, 5], [chain, chain], [0.0, 0.0],
                                     planner._curve)



def test_a_capped_k_alone_is_planned_as_in_a_batch_and_not_gated(tiny):
    """A batch of one with the server's k as a cap is planned (by default; ``alone=False``: its own policy, the whole
    cap every round): no draft on a curve where a row costs 0.7 of a step at the prior α, the whole cap where rows are
    free; never gated. An auto k alone is left to AutoK."""
    from speculate import SpeculativeDecoder
    from speculate.policy.batch import BatchPlanner, _alpha
    from speculate.spec import SpeculativeSpec

    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k=5))
    run = decoder.start([3], max_new_tokens=60)
    run.k_is_cap = True
    steep = {1: 1.0, 2: 1.7, 256: 180.0}
    for alone, want in ((False, None), (True, [0])):
        planner = BatchPlanner(tiny[0], alone=alone)
        planner.gate.draft = None  # (never asked: a batch of one is not gated)
        planner._curve = steep
        assert planner([run]) == want and planner._pending is None
    planner._curve = {1: 1.0, 2: 1.0, 256: 1.0}  # rows for free: the whole cap
    assert planner([run]) == [5]
    assert plan([_alpha(run)], [None], [5], [chain], [0.0], steep) == [0] and _alpha(run) == pytest.approx(0.6)
    # An auto k alone plans itself (AutoK, on its own finer curve): not planned here, alone=True or not.
    auto = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k="auto")).start([3],
                                                                                                    max_new_tokens=9)
    pair = BatchPlanner(tiny[0])
    pair._curve = steep
    assert planner([auto]) is None and pair([auto, run]) is not None


def test_in_a_batch_a_planned_draft_is_cut_to_its_planned_depth_and_alone_or_named_it_is_not(tiny):
    """A drafter may propose past k (lookup's copies that grow). In a batch, a planned run's draft is cut to twice its
    planned k (the rows are the batch's: BatchPlanner.round); a k the request named keeps its whole draft, and so does a
    planned run alone, where growing copies pay. The answers are plain decoding's throughout."""
    import torch

    from speculate import SpeculativeDecoder
    from speculate.drafters.base import Draft
    from speculate.drafters.lookup import LookupDrafter
    from speculate.engine import step
    from speculate.policy.batch import BatchPlanner
    from speculate.spec import SpeculativeSpec

    class Overdraft(LookupDrafter):
        """Drafts ``answer``'s next 3·k tokens: always right, always three times deeper than asked."""

        name = "overdraft"

        def __init__(self, answer):
            super().__init__()
            self.answer = answer

        def propose(self, tokens, k):
            return Draft(torch.tensor(self.answer[len(tokens): len(tokens) + 3 * k], dtype=torch.long))

        def peek(self, tokens):
            return self.answer[len(tokens)] if len(tokens) < len(self.answer) else None

    target = tiny[0]
    prompts = [[3, 4, 5, 6] * 4, [7, 8, 9, 10, 11] * 3, [12, 13] * 5]
    lengths, capped = [60, 20, 20], [True, True, False]
    plain = SpeculativeDecoder(target, SpeculativeSpec("none", verifier="greedy"))
    answers = [p + plain.generate(p, max_new_tokens=n, chat=False).token_ids for p, n in zip(prompts, lengths)]
    runs = []
    for prompt, answer, n, cap in zip(prompts, answers, lengths, capped):
        decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=2), drafter=Overdraft(answer))
        runs.append(decoder.start(prompt, max_new_tokens=n))
        runs[-1].k_is_cap = cap
    planner = BatchPlanner(target)
    planner.gate.draft = lambda key: True  # (the plan alone, not the measured gate)
    planner._curve = {1: 1.0, 2: 1.0, 256: 1.0}  # rows for free: the whole cap, k = 2, every round
    seen = {"batch planned": [], "batch named": [], "alone planned": []}
    while not all(run.done for run in runs):
        live = [run for run in runs if not run.done]
        ks, depths = planner.round(live)
        before = [(run.prefilling, run.stats.drafted_tokens, run.budget) for run in live]
        step(live, ks, depths)
        for i, (run, (prefilling, drafted, budget)) in enumerate(zip(live, before)):
            if prefilling:
                continue
            where = "alone" if len(live) == 1 else "batch"
            seen[f"{where} {'planned' if run.k_is_cap else 'named'}"].append(
                (run.stats.drafted_tokens - drafted, ks and ks[i], depths and depths[i], budget))
    # Planned in a batch: cut to 2k = 4 (or the tokens left to draft); named beside it: 6 (3·k); alone: 6 again.
    assert seen["batch planned"] and all(d == min(4, b) and k == min(2, b) and depth == 2 * k
                                         for d, k, depth, b in seen["batch planned"])
    assert max(d for d, *_ in seen["batch planned"]) == 4
    assert seen["batch named"] and all(d == min(6, b) for d, _, _, b in seen["batch named"])
    assert seen["alone planned"] and all(d == min(6, b) and depth is None for d, _, depth, b in seen["alone planned"])
    assert max(d for d, *_ in seen["batch named"]) == 6 and max(d for d, *_ in seen["alone planned"]) == 6
    for run, answer in zip(runs, answers):
        assert run.tokens == answer


def test_the_server_measures_the_batch_curve_at_start_only_where_a_run_may_be_planned(tiny_folders, monkeypatch):
    """At start, `speculate serve` measures the batch cost curve where its default settings let the planner set k:
    a drafter of known cost with the default k as a cap (alone too), or --k auto in batches. Not for plain decoding,
    nor for a draft model's fixed k (kept as it is: policy/batch.py, ``_capped``), nor for --k auto alone (AutoK)."""
    from speculate.policy import auto
    from speculate.server import ServerConfig, load_models
    from speculate.spec import SpeculativeSpec

    measured = []
    monkeypatch.setattr(auto, "profile_for", lambda target, draft=None, batch=False, **kw: measured.append(batch))
    model, other = str(tiny_folders[0]), str(tiny_folders[1])
    cases = [(dict(spec=SpeculativeSpec("lookup", k=4)), True), (dict(spec=SpeculativeSpec("suffix")), True),
             (dict(spec=SpeculativeSpec("none")), False),
             (dict(spec=SpeculativeSpec("model", k=4), draft_model=other), False),
             (dict(spec=SpeculativeSpec("model", k=4), draft_model=other, max_batch=4), False),
             (dict(spec=SpeculativeSpec("model", k="auto"), draft_model=other, max_batch=4), True),
             (dict(spec=SpeculativeSpec("lookup", k="auto"), max_batch=1), False)]
    for settings, want in cases:
        measured.clear()
        load_models(ServerConfig(model=model, **{"max_batch": 1, **settings}))
        assert measured == ([True] if want else []), settings


def test_a_run_that_joins_in_a_batch_drafts_no_deeper_than_the_plans_deepest(tiny, seen):
    """A run whose prompt completes this round drafts with it (``Run.joins``) but has no α to plan with: in a batch it
    drafts at most the plan's deepest k (none where the round is planned plain), cut to twice that; alone, or with a k
    the request named, it keeps its own."""
    from speculate import SpeculativeDecoder
    from speculate.policy.batch import BatchPlanner
    from speculate.spec import SpeculativeSpec

    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k=5))

    def run(prompt, cap=True):
        r = decoder.start(prompt, max_new_tokens=20)
        r.k_is_cap = cap
        return r

    # Two prompt tokens, none in: the first is its one prefill row, which goes in with its first draft (a longer rest
    # would be rows the plan counts as fixed, which make drafts beside them cheaper).
    joining = run([3, 4])
    assert joining.prefilling and joining.joins and joining.prefill_rows == 1 and joining.draft_length() == 5
    planner = BatchPlanner(tiny[0])
    planner.gate.draft = lambda key: True  # (the gate lets every planned draft through: the plan alone decides)
    planner._curve = {1: 1.0, 2: 2.0, 256: 256.0}  # every row a full step: no planned run drafts
    assert planner.round([run([3]), run([3]), joining]) == ([0, 0, 0], [0, 0, 0])
    planner._curve = {1: 1.0, 2: 1.0, 256: 1.0}  # rows for free: the planned runs draft the whole cap, so may it
    assert planner.round([run([3]), joining]) == ([5, 5], [10, 10])
    planner._curve = {1: 1.0, 2: 2.0, 256: 256.0}
    named = run([3, 4], cap=False)  # a k the request named is kept (None: its own, 5), and not cut
    ks, depths = planner.round([run([3]), named])
    assert ks[1] is None and depths[1] is None and named.draft_length() == 5
    assert planner.round([joining]) == (None, None)  # alone: nothing planned (a run that prefills plans itself)


def capped_lookup(tiny):
    """A lookup decoder at k = 5, a maker of its runs with the server's k as a cap, and a planner whose gate lets every
    planned draft through (the plan alone decides)."""
    from speculate import SpeculativeDecoder
    from speculate.policy.batch import BatchPlanner
    from speculate.spec import SpeculativeSpec

    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k=5))

    def run(prompt):
        r = decoder.start(prompt, max_new_tokens=20)
        r.k_is_cap = True
        return r

    planner = BatchPlanner(tiny[0])
    planner.gate.draft = lambda key: True
    return decoder, run, planner


def test_joining_runs_count_their_first_token_and_a_burst_of_them_drafts_nothing(tiny, seen):
    """The round in which a burst of requests gets its first tokens: a joining run yields its first token, so the plan
    counts it (its rows are not a cost without a return, which made drafts beside them look cheap), and where every
    run of a batch joins, none is planned and each drafts nothing (before: each at its own k)."""
    decoder, run, planner = capped_lookup(tiny)
    planner._curve = {1: 1.0, 2: 2.0, 256: 256.0}  # every row a full step: eight tokens in eight rows, no draft pays
    joiners = [run([3, 4]) for _ in range(7)]
    assert all(j.joins and j.prefill_rows == 1 for j in joiners)
    assert planner.round([run([3]), *joiners]) == ([0] * 8, [0] * 8)
    assert planner.round(joiners) == ([0] * 7, [0] * 7)  # nothing planned: the burst drafts nothing
    named = decoder.start([3, 4], max_new_tokens=20)  # (a k the request named: its own, as before)
    assert planner.round([named, *joiners[:2]]) == ([None, 0, 0], [None, 0, 0])


def test_in_a_batch_a_run_without_evidence_peeks_before_it_drafts(tiny):
    """A new run has no α of its own (no draft verified, no peek): in a batch it drafts nothing, so a burst's
    first-token round has plain's rows, and its drafter peeks (its first evidence); once it has evidence it is
    planned. Alone it is planned as before."""
    _, run, planner = capped_lookup(tiny)
    planner._curve = {1: 1.0, 2: 1.0, 256: 1.0}  # rows for free: any run with evidence drafts the cap
    runs = [run([3]), run([3])]  # (one prompt token: in with the first round, nothing to prefill)
    assert not any(r.prefilling for r in runs) and planner(runs) == [0, 0]
    runs[0].stats.peek(True)  # a round's peek: evidence (engine.py, Run.take)
    assert planner(runs) == [5, 0]
    runs[1].stats.peek(False)
    assert planner(runs) == [5, 5]  # (α 2.4 / 5 still drafts where rows are free)
    assert planner([run([3])]) == [5]  # alone: as before
