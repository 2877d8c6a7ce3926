"""The speedup model against a ``speculate bench`` run (``speculate calc --from-results``).

Two predictions per speculative method and dataset, both from the acceptance the run measured (α̂, the
geometric MLE, :func:`~speculate.stats.alpha_mle`) and costs measured apart from the samples:

- **simple**: the lesson's exact model, E(α̂, k) / (T(k+1)/T(1) + k·c) (:func:`~speculate.policy.speedup.speedup`),
  with the profile's T(n) and c. It leaves out what the run pays beside the forwards it counts.
- **costed**: the wall time of the run predicted term by term (:func:`predict_seconds`):

      plain:   T_plain  = P + N_p·t_p                        (measured: the baseline)
      method:  T̂       = P + P_draft + (N / E(α̂, k) + G/2) · u·(v + k·c_eff + o_round)

  P is the target's prefill (the same work for every method; plain's, measured); t_p plain decoding's seconds
  per token on these samples; u = t_p / (1 + o_plain) one target forward at these samples' contexts; G the
  generations (each one's last round is cut short: half a round on average); the rest from the run's
  ``dataset_costs`` (each method's generations of a fixed request after the dataset's shared context, before its
  first sample and after every ``CALIBRATION_EVERY`` of them, pooled: bench/runner.py; runs from before that have
  one ``costs`` for all datasets, from the bare request), in units of plain decoding's target forward there, and
  from the profile:

  - v: the method's verification forward, T(k+1)/T(1) as the engine runs it on the machine as loaded as in the
    run (the profile's curve is measured apart, at a context of 200);

  - c_eff: the drafter's seconds per drafted token, relative to one target forward, as the engine runs it: the
    draft model's forward plus the catch-up rows it feeds (the correction or bonus token of the round before)
    plus warping and sampling each drafted row (the profile's c counts a bare one-row forward);
  - o_round and o_plain: the engine's own time per round and per plain token (verification, rollback, commit,
    detokenising): the wall time minus the prefill, the target's forwards and the drafter's;
  - P_draft: the draft model's prefill of every prompt (inside its first proposal), at the profile's rate
    per token, over the prompt tokens the cache did not keep.

The measured speedup is tokens/s over plain's tokens/s on the same samples (those one start of the bench timed for
both: bench/records.timed_together), as the report's.
"""

from __future__ import annotations

from collections import defaultdict

from ..bench.records import timed_together
from ..stats import alpha_mle, summed_stats
from ..policy.profile import Profile
from ..policy.speedup import expected_tokens, speedup

UNMODELLED = ("model+lookup",)  # drafters whose rounds mix two drafters: no prediction (see predictions())


def _turn_stats(record: dict):
    return [t["stats"] for t in record["turns"] if t.get("stats")]


def _total(records, key: str) -> float:
    return sum(s.get(key, 0) for r in records for s in _turn_stats(r))


def _k(spec: dict, drafted: float, rounds: float) -> int:
    """The method's k: fixed (a model drafter's), else the mean drafted per round (k = auto, and prompt lookup,
    which drafts less than k when it finds no match)."""
    from ..drafters import MODEL_DRAFTERS

    if isinstance(spec.get("k"), int) and spec.get("drafter") in MODEL_DRAFTERS:
        return spec["k"]
    return max(1, round(drafted / rounds)) if rounds else 1


def _forwards(spec: dict | None):
    """What fixes a method's forwards (the verification's rows, the drafter's work per drafted token): methods with
    the same key run the same ones and differ only in their verifier's own time. None: shared with no other
    (k = auto's rows vary with each method's acceptance)."""
    if not spec or spec.get("kind") != "engine" or not isinstance(spec.get("k"), int):
        return None
    return spec.get("drafter"), spec["k"], tuple(spec.get("options") or ())


def method_costs(costs: dict, method: str, specs: dict | None = None) -> dict | None:
    """From a run's ``costs`` (name → the stats of a calibration generation), each in units of plain decoding's
    target forward there: plain's engine time per token (``o_plain``), and this method's verification forward per
    round (``verify``: T(k+1)/T(1) as the engine runs it, on this machine as loaded as in the run), drafter time per
    drafted token (``c_eff``) and engine time per round (``o_round``). None without both generations.

    With ``specs`` (name → Method.to_dict()), ``verify`` and ``c_eff`` pool the calibrations of every method that
    runs the same forwards (:func:`_forwards`): one cost, measured over all their generations rather than two
    each. (Each method's own 7-row forward ranged 0.098-0.143 s over one calibration of a ten-method run while
    another process shared the machine; the samples' did not.)"""
    usable = lambda s: bool(s and s.get("target_calls") and "target_seconds" in s)  # noqa: E731
    plain, own = costs.get("plain"), costs.get(method)
    if not usable(plain) or not usable(own):
        return None
    key = _forwards((specs or {}).get(method))
    same = [s for n, s in costs.items() if key is not None and _forwards(specs.get(n)) == key and usable(s)] or [own]
    forwards = {k: sum(s.get(k, 0) for s in same) for k in ("target_seconds", "target_calls", "draft_seconds",
                                                            "drafted_tokens", "generations")}
    decode = lambda s: s["wall_seconds"] - s["prefill_seconds"]  # noqa: E731
    rounds, drafted = forwards["target_calls"], forwards["drafted_tokens"]
    t1 = plain["target_seconds"] / plain["target_calls"]
    # Each generation's first proposal holds the draft model's prefill of its prompt: left out of the per-token cost.
    firsts = forwards["generations"] or len(same)
    later = drafted * (rounds - firsts) / rounds if rounds > firsts else 0
    return {"o_plain": (decode(plain) - plain["target_seconds"]) / plain["new_tokens"] / t1,
            "verify": forwards["target_seconds"] / rounds / t1,
            "c_eff": forwards["draft_seconds"] / later / t1 if later else 0.0,
            "o_round": (decode(own) - own["target_seconds"] - own["draft_seconds"] - own["first_draft_seconds"])
            / own["target_calls"] / t1}


def predict_seconds(method_records: list[dict], plain_records: list[dict], alpha: float, k: int, cost: dict,
                    profile: Profile, draft_model: bool) -> float:
    """T̂ (module docstring): the predicted seconds of ``method_records``' generations, from plain's measured ones
    on the same samples, the fitted α and k, the calibration ``cost`` (:func:`method_costs`) and the profile."""
    new_plain = _total(plain_records, "new_tokens")
    prefill = _total(plain_records, "prefill_seconds")
    per_token = (_total(plain_records, "wall_seconds") - prefill) / new_plain
    u = per_token / (1 + cost["o_plain"])
    # A chain drafts k tokens a round; a tree of depth k more (model-tree's default: 2k nodes), and c_eff is the cost
    # of one drafted node: price the nodes drafted per round where there are more than k.
    calls = _total(method_records, "target_calls")
    nodes = max(k, _total(method_records, "drafted_tokens") / calls) if calls else k
    round_seconds = u * (cost["verify"] + nodes * cost["c_eff"] + cost["o_round"])
    draft_prefill = 0.0
    if draft_model and profile.draft_prefill_seconds:
        fresh = sum(s.get("prompt_tokens", 0) - s.get("reused_prompt_tokens", 0)
                    for r in method_records for s in _turn_stats(r))
        draft_prefill = profile.draft_prefill_seconds / profile.context * fresh
    # The last round of each generation is cut short by EOS, a stop string or the budget: half a round on average.
    generations = sum(len(_turn_stats(r)) for r in method_records)
    rounds = _total(method_records, "new_tokens") / expected_tokens(alpha, k) + generations / 2
    return prefill + draft_prefill + rounds * round_seconds


def _pooled_stats(records: list[dict]) -> dict:
    return summed_stats([s for r in records for s in _turn_stats(r)])


def predictions(run: dict, records: list[dict], costs_from: str = "calibration") -> list[dict]:
    """Per engine method and dataset of a bench run (and ``all``: every dataset's seconds summed), the simple and
    the costed model's speedup beside the measured one (the module docstring), on the samples both the method and
    plain finished. ``model+lookup`` is left out: its rounds are of two kinds (lookup's, free and of their own
    length, and the draft model's), which one α and one c do not describe. ``costed`` is None for a run without
    calibration costs (before they were recorded). ``costs_from="samples"``: the drafter's and engine's times from
    the samples' own split instead (per dataset), an account of where their time went rather than a prediction."""
    from ..drafters import MODEL_DRAFTERS

    prof = Profile.from_dict(run["profile"])
    specs, costs, dataset_costs = run.get("methods", {}), run.get("costs", {}), run.get("dataset_costs", {})
    by = defaultdict(dict)  # (method, dataset) → id → record
    for r in records:
        if _turn_stats(r) or r["method"] == "plain":
            by[r["method"], r["dataset"]][r["id"]] = r
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    out = []
    for method, spec in specs.items():
        if spec.get("kind") != "engine" or spec.get("drafter") in UNMODELLED:
            continue
        drafts_with_model = spec.get("drafter") in MODEL_DRAFTERS
        rows = {}  # dataset → (tokens, seconds, plain's tokens, plain's seconds, predicted seconds, α, k)
        used = {}  # dataset → the method's records those rows count
        for d in datasets:
            # The samples whose seconds one start timed for both, and, where the run names the start that measured
            # this dataset's calibration costs, that start's only: a resumed run's latest calibration prices its
            # own samples, not an earlier start's on another machine or under another load.
            costs_start = run.get("dataset_costs_started", {}).get(d)
            ids = sorted(i for i in set(by.get((method, d), {})) & set(by.get(("plain", d), {}))
                         if timed_together(by[method, d][i], by["plain", d][i])
                         and (costs_from == "samples" or costs_start is None
                              or by[method, d][i].get("started") == costs_start))
            recs, plain = [by[method, d][i] for i in ids], [by["plain", d][i] for i in ids]
            rounds, drafted = _total(recs, "target_calls"), _total(recs, "drafted_tokens")
            alpha = alpha_mle(_total(recs, "accepted_draft_tokens"), _total(recs, "rejected_rounds"))
            if alpha is None or not rounds:
                continue
            # The method's own k, also beyond the profile's T(n) (the costed model prices the verification from
            # the calibration; only the simple model needs T(k+1) from the profile).
            k = _k(spec, drafted, rounds)
            if costs_from == "samples":
                cost = method_costs({"plain": _pooled_stats(plain), method: _pooled_stats(recs)}, method)
            else:  # the dataset's own calibration; else the run's one for all datasets (older runs)
                cost = method_costs(dataset_costs.get(d, {}), method, specs) or method_costs(costs, method, specs)
            predicted = None if cost is None else predict_seconds(recs, plain, alpha, k, cost, prof, drafts_with_model)
            rows[d] = (_total(recs, "new_tokens"), _seconds(recs), _total(plain, "new_tokens"), _seconds(plain),
                       predicted, alpha, k)
            used[d] = recs
        if len(rows) > 1:  # every dataset at its own contexts, α and k; the seconds summed
            sums = [sum(v[i] for v in rows.values()) for i in range(4)]
            predicted = None if any(v[4] is None for v in rows.values()) else sum(v[4] for v in rows.values())
            recs = [r for d in rows for r in used[d]]
            alpha = alpha_mle(_total(recs, "accepted_draft_tokens"), _total(recs, "rejected_rounds"))
            rows["all"] = (*sums, predicted, alpha, _k(spec, _total(recs, "drafted_tokens"),
                                                        _total(recs, "target_calls")))
        for d, (tokens, seconds, p_tokens, p_seconds, predicted, alpha, k) in rows.items():
            measured = (tokens / seconds) / (p_tokens / p_seconds)
            costed = None if predicted is None else (tokens / predicted) / (p_tokens / p_seconds)
            simple = None if alpha is None or k >= prof.max_n else speedup(
                alpha, k, (prof.c or 0.0) if drafts_with_model else 0.0, prof.curve)  # (T(k+1): n ≤ max_n)
            out.append({"method": method, "dataset": d, "alpha": None if alpha is None else round(alpha, 4), "k": k,
                        "c": round(prof.c or 0.0, 3) if drafts_with_model else 0.0,
                        "c_eff": None if cost is None else round(cost["c_eff"], 3),
                        "simple": None if simple is None else round(simple, 3),
                        "costed": None if costed is None else round(costed, 3), "measured": round(measured, 3),
                        "error_simple": None if simple is None else round(measured / simple - 1, 3),
                        "error": None if costed is None else round(measured / costed - 1, 3)})
    return out


def _seconds(records) -> float:
    return sum(t["seconds"] for r in records for t in r["turns"])
