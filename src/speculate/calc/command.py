"""``speculate calc``: the command-line face of :mod:`speculate.policy` (arguments, checks, printed report).

Four calculations, one per invocation:

- ``--alpha A --speed-ratio S [--k K] [--curve FILE]``: the lesson's approximation and the exact model,
  with a table over k = 1..20 (lesson, "Expected speedup", Exercise 2).
- ``--p-target ... --p-draft ...``: α and the residual distribution (Exercise 1).
- ``--profile [--model M] [--draft-model M2] ...``: measure T(n)/T(1) (and c) here; best k per α.
- ``--eps-chinchilla --params N --tokens D``: Consultant Decoding's eq. 9 estimate of ε.

Bad input raises SpeculateError: one line on stderr, exit code 2 (see :func:`speculate.cli.main`).
"""

from __future__ import annotations

import math
import re
import sys

from ..errors import SpeculateError
from ..policy.profile import load_profile, measure_profile, save_profile
from ..policy.scaling import chinchilla_terms
from ..policy.speedup import (acceptance_rate, best_k, check_distribution, expected_tokens, lesson_speedup,
                      residual_distribution, speedup, verify_cost)

#: The acceptance rates ``--profile`` recommends a k for.
PROFILE_ALPHAS = (0.6, 0.7, 0.8, 0.9)
TABLE_K = 20

# flag → argparse dest, per calculation; the first flag of each names it
MODES = {
    "--alpha": ("alpha", "k", "speed_ratio", "curve"),
    "--p-target/--p-draft": ("p_target", "p_draft"),
    "--profile": ("profile", "model", "draft_model", "dtype", "context", "repeats", "max_n", "save"),
    "--eps-chinchilla": ("eps_chinchilla", "params", "tokens"),
    "--from-results": ("from_results", "costs"),
    "--eps-auto": ("eps_auto", "model", "dtype", "calibration"),
}
_TRIGGERS = {"--alpha": ("alpha",), "--p-target/--p-draft": ("p_target", "p_draft"), "--profile": ("profile",),
             "--eps-chinchilla": ("eps_chinchilla",), "--from-results": ("from_results",),
             "--eps-auto": ("eps_auto",)}


def add_arguments(parser) -> None:
    """The ``calc`` subcommand's flags (every default None, so that misplaced flags can be refused)."""
    from ..models import ALIASES, DEFAULT_MODEL, DTYPES  # read at run time: precisions may be added

    a = parser.add_argument_group("speedup model (lesson, 'Expected speedup')")
    a.add_argument("--alpha", type=float, help="per-token acceptance rate α in [0, 1]")
    a.add_argument("--k", type=int, help="draft length to report in detail (>= 1; the table covers 1..20)")
    a.add_argument("--speed-ratio", type=float, metavar="S",
                   help="how many times faster one draft forward is than one target forward (> 0; c = 1/S; "
                        "'inf' for prompt lookup, c = 0)")
    a.add_argument("--curve", metavar="FILE",
                   help="use the measured T(n)/T(1) of a profile saved with --profile --save, not a flat one")
    d = parser.add_argument_group("acceptance of one token (lesson, Exercise 1)")
    d.add_argument("--p-target", metavar="P,P,...", help="target distribution (the lesson's q), comma-separated")
    d.add_argument("--p-draft", metavar="P,P,...", help="draft distribution (the lesson's p), comma-separated")
    p = parser.add_argument_group("cost curve measured on this machine")
    p.add_argument("--profile", action="store_true", default=None,
                   help="time one target forward over n = 1..MAX_N new tokens (and one draft forward)")
    p.add_argument("--model", help=f"target model: an alias ({', '.join(ALIASES)}) or a local Hugging Face "
                                   f"folder (default {DEFAULT_MODEL})")
    p.add_argument("--draft-model", help="also measure this draft model's cost ratio c")
    p.add_argument("--dtype", choices=list(DTYPES), help="weight precision (default fp32)")
    p.add_argument("--context", type=int, help="cached tokens before the timed forwards (default 200)")
    p.add_argument("--repeats", type=int, help="timed passes; the median is kept (default 5)")
    p.add_argument("--max-n", type=int, help="largest n timed (default 16, so k up to 15)")
    p.add_argument("--save", metavar="FILE", help="write the profile as JSON (for recommend_k / load_profile)")
    r = parser.add_argument_group("prediction against a bench run")
    r.add_argument("--from-results", metavar="DIR",
                   help="a `speculate bench` output folder: fit α per method from its rounds, take T(n)/T(1) and c "
                        "from the run's profile, and print predicted against measured speedup")
    r.add_argument("--costs", choices=["calibration", "samples"],
                   help="where the costed model's drafter and engine times come from: each method's calibration "
                        "generation before the samples (default: a prediction), or the samples' own split (an "
                        "account of where their time went)")
    e = parser.add_argument_group("Consultant Decoding's ε (paper eq. 9, Chinchilla; or calibrated)")
    e.add_argument("--eps-auto", action="store_true", default=None,
                   help="ε as --eps auto sets it: the target's (--model) mean NLL on a calibration text, with the "
                        "Chinchilla estimate beside it")
    e.add_argument("--calibration", metavar="FILE", help="calibration text for --eps-auto (default: the shipped one)")
    e.add_argument("--eps-chinchilla", action="store_true", default=None,
                   help="estimate the converged loss L(N, D) = E + A/N^α + B/D^β")
    e.add_argument("--params", metavar="N", help="parameter count, e.g. 135e6 or 135M")
    e.add_argument("--tokens", metavar="D", help="training tokens, e.g. 2e12 or 2T")


def run(args) -> int:
    mode = _mode(args)
    return {"--alpha": _alpha, "--p-target/--p-draft": _distributions, "--profile": _profile,
            "--eps-chinchilla": _chinchilla, "--from-results": _from_results, "--eps-auto": _eps_auto}[mode](args)


def _mode(args) -> str:
    given = {dest for dests in MODES.values() for dest in dests if getattr(args, dest, None) is not None}
    modes = [m for m, triggers in _TRIGGERS.items() if given & set(triggers)]
    if not modes:
        raise SpeculateError("calc needs one of --alpha, --p-target/--p-draft, --profile, --eps-chinchilla, "
                             "--from-results, --eps-auto")
    if len(modes) > 1:
        raise SpeculateError(f"{' and '.join(modes)} are separate calculations: give one")
    mode = modes[0]
    stray = sorted(given - set(MODES[mode]))
    if stray:
        flag = "--" + stray[0].replace("_", "-")
        raise SpeculateError(f"{flag} does not apply to {mode}")
    return mode


def _num(x: float, digits: int = 4) -> str:
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}g}"


# --- --alpha: the lesson's approximation against the exact model -----------------------------------------

def _alpha(args) -> int:
    alpha = args.alpha
    if not 0.0 <= alpha <= 1.0:
        raise SpeculateError(f"--alpha must be in [0, 1], got {alpha:g}")
    if args.speed_ratio is None:
        raise SpeculateError("--alpha needs --speed-ratio S (the draft is S times faster than the target; "
                             "inf for prompt lookup)")
    s = args.speed_ratio
    if not s > 0.0:
        raise SpeculateError(f"--speed-ratio must be > 0, got {s:g}")
    c = 0.0 if math.isinf(s) else 1.0 / s
    if args.k is not None and args.k < 1:
        raise SpeculateError(f"--k must be >= 1, got {args.k}")
    curve, curve_name = None, "flat cost curve, T(n) = T(1)"
    k_max = TABLE_K
    if args.curve is not None:
        prof = load_profile(args.curve)
        curve, k_max = prof.curve, min(TABLE_K, prof.max_n - 1)
        curve_name = f"T(n)/T(1) measured on {prof.model or '?'} ({args.curve})"
        if args.k is not None and args.k > prof.max_n - 1:
            raise SpeculateError(f"--k {args.k} needs T({args.k + 1}), but the profile stops at n = {prof.max_n}")

    cost_c = "0 (a free drafter, e.g. prompt lookup)" if c == 0 else f"1/s = {_num(c)}"
    out = [f"α = {_num(alpha)}, draft speed ratio s = {_num(s)}: c = {cost_c} target forwards per drafted token",
           f"cost model: {curve_name}"]
    if args.k is not None:
        k = args.k
        num, den = 1 + k * alpha, 1 + k / s
        e = expected_tokens(alpha, k)
        t = verify_cost(curve, k + 1)
        out += ["", f"k = {k}:",
                f"  lesson's approximation  (1 + kα)/(1 + k/s) = {_num(num)}/{_num(den)} = "
                f"{_num(lesson_speedup(alpha, k, s))}×",
                f"  exact model             E(α,k) = (1 − α^(k+1))/(1 − α) = {_num(e)} tokens per target call",
                f"                          E/(T(k+1)/T(1) + k·c) = {_num(e)}/({_num(t)} + {_num(k * c)}) = "
                f"{_num(speedup(alpha, k, c, curve))}×"]
    out += ["", "   k   E(α,k)    1+kα   cost T(k+1)/T(1)+k·c    exact   lesson"]
    for k in range(1, k_max + 1):
        cost = verify_cost(curve, k + 1) + k * c
        out.append(f"{k:4d} {expected_tokens(alpha, k):8.3f} {1 + k * alpha:7.2f} {cost:22.3f} "
                   f"{speedup(alpha, k, c, curve):7.3f}× {lesson_speedup(alpha, k, s):7.3f}×")
    kb, sb = best_k(curve, alpha, c, k_max=k_max)
    out.append(f"best k (exact): {kb}, {_num(sb)}×" + ("  (no k pays: plain decoding is faster)" if sb <= 1 else ""))
    k0 = args.k if args.k is not None else 4
    if alpha > 0 and k0 < TABLE_K <= k_max:
        out += ["", _why_not_linear(alpha, k0, TABLE_K, s, c, curve)]
    print("\n".join(out))
    return 0


def _why_not_linear(alpha: float, k: int, k_big: int, s: float, c: float, curve) -> str:
    """Exercise 2's 'why': E saturates, the draft cost does not."""
    e, e_big = expected_tokens(alpha, k), expected_tokens(alpha, k_big)
    cost, cost_big = (verify_cost(curve, n + 1) + n * c for n in (k, k_big))
    ex, ex_big = speedup(alpha, k, c, curve), speedup(alpha, k_big, c, curve)
    ls, ls_big = lesson_speedup(alpha, k, s), lesson_speedup(alpha, k_big, s)
    cap = (f"saturates below 1/(1 − α) = {_num(1 / (1 - alpha))} tokens per call" if alpha < 1
           else "grows as k + 1 only because α = 1")
    verdict = "slower than" if ex_big < ex else f"{_num(ex_big / ex)}× the speedup of"
    return "\n".join([
        f"Why k = {k_big} does not give {_num(k_big / k)}× the gain of k = {k}:",
        f"  E(α,k) {cap}: {_num(e)} at k = {k}, {_num(e_big)} at k = {k_big},",
        (f"  while a round's cost grows with k: {_num(cost)} → {_num(cost_big)} target forwards."
         if cost_big > cost else f"  and a round costs {_num(cost)} → {_num(cost_big)} target forwards."),
        f"  Exact: {_num(ex)}× → {_num(ex_big)}× (k = {k_big} is {verdict} k = {k}); the lesson's "
        f"approximation, linear in k: {_num(ls)}× → {_num(ls_big)}× "
        f"({_num(ls_big / ls)}×, not {_num(k_big / k)}×)."])


# --- --p-target / --p-draft: Exercise 1 ---------------------------------------------------------------

def _floats(text: str | None, flag: str) -> list[float]:
    if text is None:
        other = "--p-draft" if flag == "--p-target" else "--p-target"
        raise SpeculateError(f"{other} needs {flag} too")
    values = []
    for item in text.split(","):
        try:
            values.append(float(item))
        except ValueError:
            raise SpeculateError(f"{flag}: {item.strip()!r} is not a number (give comma-separated "
                                 f"probabilities, e.g. 0.6,0.1,0.3)") from None
    return values


def _distributions(args) -> int:
    p_target = _floats(args.p_target, "--p-target")
    p_draft = _floats(args.p_draft, "--p-draft")
    check_distribution(p_target, "--p-target")
    check_distribution(p_draft, "--p-draft")
    alpha = acceptance_rate(p_target, p_draft)
    residual = residual_distribution(p_target, p_draft)
    print(f"α = Σ min(p_draft, p_target) = {_num(alpha, 6)}  (probability that a token drawn from p_draft "
          f"is accepted)")
    if residual is None:
        print("residual normalize(max(0, p_target − p_draft)): none — p_draft equals p_target, nothing is "
              "ever rejected")
    else:
        print(f"residual normalize(max(0, p_target − p_draft)) = ({', '.join(_num(r, 6) for r in residual)})  "
              f"(a distribution; its mass before normalising is 1 − α = {_num(1 - alpha, 6)})")
    return 0


# --- --profile: measured cost curve and the best k per α -----------------------------------------------

def _profile(args) -> int:
    from ..models import DEFAULT_MODEL, load_model

    context = 200 if args.context is None else args.context
    repeats = 5 if args.repeats is None else args.repeats
    max_n = 16 if args.max_n is None else args.max_n
    for flag, v, low in (("--context", context, 1), ("--repeats", repeats, 1), ("--max-n", max_n, 2)):
        if v < low:
            raise SpeculateError(f"{flag} must be >= {low}, got {v}")
    dtype = args.dtype or "fp32"
    target = load_model(args.model or DEFAULT_MODEL, dtype=dtype)
    draft = load_model(args.draft_model, dtype=dtype) if args.draft_model else None
    print(f"measuring T(n) for n = 1..{max_n} on {target.name} ({repeats} repeats)...", file=sys.stderr, flush=True)
    prof = measure_profile(target, draft, context=context, max_n=max_n, repeats=repeats)
    print(format_profile(prof))
    if args.save:
        path = save_profile(prof, args.save)
        print(f"saved to {path}")
    return 0


def format_profile(prof) -> str:
    """The curve, c, and the best k for each α in :data:`PROFILE_ALPHAS`, as printed by ``--profile``."""
    out = [f"T(n)/T(1) on {prof.model} ({prof.dtype}, {prof.threads} threads) after a {prof.context}-token "
           f"context, median of {prof.repeats} repeats:",
           "    n   ms/forward   T(n)/T(1)"]
    for n, ratio in prof.curve.items():
        out.append(f"{n:5d} {prof.target_seconds[n] * 1e3:12.2f} {ratio:11.2f}")
    columns = [("prompt lookup (c = 0)", 0.0)]
    if prof.c is not None:
        out.append(f"draft {prof.draft_model}: {prof.draft_seconds * 1e3:.2f} ms per single-token forward, "
                   f"c = {prof.c:.3f} of a target forward")
        columns.append((f"draft model (c = {prof.c:.3f})", prof.c))
    out += ["", f"best k by the exact model E(α,k)/(T(k+1)/T(1) + k·c), k = 1..{prof.max_n - 1}:",
            ("    α   " + "".join(f"{name:<28}" for name, _ in columns)).rstrip()]
    for alpha in PROFILE_ALPHAS:
        cells = []
        for _, c in columns:
            k, s = best_k(prof, alpha, c)
            cells.append(f"k = {k}, {s:.2f}×" + (" (none pays)" if s <= 1 else ""))
        out.append(f"  {alpha:.1f}   " + "".join(f"{cell:<28}" for cell in cells).rstrip())
    return "\n".join(out)


# --- --from-results: the model against a bench run (calc/results.py) ------------------------------------------

def _from_results(args) -> int:
    from pathlib import Path

    from ..bench.records import RUN_FILE, SAMPLES_FILE, read_records, read_run_file
    from .results import UNMODELLED, predictions

    folder = Path(args.from_results)
    if not (folder / RUN_FILE).is_file() or not (folder / SAMPLES_FILE).is_file():
        raise SpeculateError(f"--from-results: {folder} is not a `speculate bench` output folder "
                             f"(no {RUN_FILE} / {SAMPLES_FILE})")
    run = read_run_file(folder)
    if run is None or not isinstance(run.get("profile"), dict) or not isinstance(run.get("methods"), dict):
        raise SpeculateError(f"--from-results: {folder / RUN_FILE} is unreadable or damaged")
    preds = predictions(run, read_records(folder / SAMPLES_FILE, repair=False), args.costs or "calibration")
    if not preds:
        raise SpeculateError(f"--from-results: {folder} has no speculative method with finished samples"
                             f" that the model describes (it leaves out {', '.join(UNMODELLED)})")
    cell = lambda v, fmt, unit="": "—" if v is None else format(v, fmt) + unit  # noqa: E731
    print(f"{'method':<46} {'dataset':<10} {'alpha':>6} {'k':>3} {'c':>6} {'c_eff':>6} {'simple':>8} "
          f"{'costed':>8} {'measured':>9} {'error':>7} {'(simple)':>8}")
    for p in preds:
        print(f"{p['method']:<46} {p['dataset']:<10} {cell(p['alpha'], '6.3f'):>6} {cell(p['k'], '3d'):>3} "
              f"{p['c']:6.3f} {cell(p['c_eff'], '6.3f'):>6} {cell(p['simple'], '7.2f', '×'):>8} "
              f"{cell(p['costed'], '7.2f', '×'):>8} {p['measured']:8.2f}× {cell(p['error'], '+7.1%'):>7} "
              f"{cell(p['error_simple'], '+8.1%'):>8}")
    print("simple: E(α, k) / (T(k+1)/T(1) + k·c); costed: the run's seconds predicted term by term from its "
          "calibration costs (calc/results.py); error: measured ÷ predicted − 1")
    if not (run.get("costs") or run.get("dataset_costs")) and args.costs != "samples":
        print("this run has no calibration costs (older runs did not record them): the costed model needs a rerun")
    left_out = sorted({name for name, spec in run.get("methods", {}).items() if spec.get("drafter") in UNMODELLED})
    if left_out:
        print(f"not predicted (rounds of two drafters, which one alpha and c do not describe): {', '.join(left_out)}")
    return 0


def _eps_auto(args) -> int:
    from pathlib import Path

    from ..models import DEFAULT_MODEL, load_model
    from ..policy.auto import calibrate_eps, calibration_text, chinchilla_eps, mean_nll

    text = calibration_text()
    if args.calibration:
        try:
            text = Path(args.calibration).read_text(encoding="utf-8")
        except OSError as e:
            raise SpeculateError(f"--calibration: cannot read {args.calibration}: {e.strerror}") from None
    loaded = load_model(args.model or DEFAULT_MODEL, dtype=args.dtype or "fp32")
    eps = calibrate_eps(loaded, text)
    tokens = mean_nll(loaded, text)[1]
    print(f"eps auto for {loaded.name} ({loaded.dtype}): {eps:.3f} nats per token (the target's mean NLL over "
          f"{tokens} tokens of {'the shipped calibration text' if not args.calibration else args.calibration})")
    chin = chinchilla_eps(loaded)
    print("Chinchilla estimate (paper eq. 9): " + (f"{chin:.3f}" if chin is not None else
                                                    "n/a (training-token count unknown for this model)"))
    return 0


# --- --eps-chinchilla: Consultant Decoding eq. 9 ------------------------------------------------------

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _count(text: str | None, flag: str) -> float:
    if text is None:
        raise SpeculateError(f"--eps-chinchilla needs {flag}")
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", text)
    try:
        value = float(m.group(1)) * _SUFFIX.get(m.group(2).lower(), 1.0) if m else float("nan")
    except ValueError:
        value = float("nan")
    if not 0.0 < value < math.inf:
        raise SpeculateError(f"{flag} must be a positive number such as 135e6 or 135M, got {text!r}")
    return value


def _chinchilla(args) -> int:
    n = _count(args.params, "--params")
    d = _count(args.tokens, "--tokens")
    e, size, data = chinchilla_terms(n, d)
    loss = e + size + data
    print(f"L(N, D) = E + A/N^α + B/D^β = {e:.2f} + {size:.3f} + {data:.3f} = {loss:.3f} nats per token  "
          f"(N = {n:.4g} parameters, D = {d:.4g} tokens; Consultant Decoding eq. 9)")
    print(f"as Consultant Decoding's threshold: --verifier consultant --eps {loss:.2f} "
          f"(the paper rounds its models' estimates to ε = 2.0)")
    return 0
