"""Whether a lower precision is still the model: its whole greedy answers against fp32's, not per-position averages.

Speculative decoding reproduces its target exactly, so a precision that breaks the target breaks every answer
exactly. An average over positions cannot see that: int8 once agreed with fp32 on 92 % of MT-Bench positions while
answering MT-Bench question 81 with "La la la ..." (one flipped first token, then a loop). What this module
compares, per prompt, between a reference (fp32) and a candidate (int8, q4) of the same model:

* the candidate's teacher-forced NLL of the reference's own greedy answer, minus the reference's (nats per token;
  the mean over prompts and the worst prompt): how much less likely the candidate finds fp32's answer;
* the first position where the two greedy answers differ, and whether they are equal;
* (the benchmark only) ROUGE-L of the candidate's answer against the reference's (``bench.metrics.rouge_l``);
* :func:`degenerate`: a repeated n-gram filling the answer. The gate's hard rule is that the candidate never
  degenerates where the reference does not.

:func:`gate` runs at conversion time on :data:`GATE_PROMPTS` (loader.py: a failing conversion is used but not
cached, with a warning); ``python -m speculate.bench.precision`` runs the same comparison over the shipped
datasets (docs/benchmarks.md, "No precision may break the model").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import torch

from ..text import encode_prompt

# Short prompts that have shown a precision's failure: MT-Bench question 81 (int8 answered "La la la ..."), the
# capital of France (q4 with 8-bit activations answered "L'Étoile, la Marseillaise ..."), a GSM8K question and a
# copy prompt.
GATE_PROMPTS = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
    "must-see attractions.",
    "What is the capital of France?",
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends "
    "every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. How much "
    "in dollars does she make every day at the farmers' market?",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
)
GATE_TOKENS = 32  # new tokens per gate prompt: enough for a loop to show, ~10 s for the default model's gate
# The gate's limits on the mean and the worst prompt's NLL gap (nats per token of fp32's answer). Measured on the
# default model (docs/benchmarks.md): int8 0.007 / 0.035 and q4 ~0.002 / ~0.01 with their wide activations; the
# 8-bit activations that broke answers gave 0.014 / 0.054. The limits catch a broken conversion (a wrong scale,
# a lost layer: gaps of whole nats), not the last percent.
MAX_MEAN_GAP, MAX_WORST_GAP = 0.1, 0.5


def degenerate(ids: list[int], min_tokens: int = 16, share: float = 0.5, max_n: int = 8) -> bool:
    """Whether one n-gram (n ≤ ``max_n``) repeated at least 4 times covers ``share`` of the answer's tokens: "la la
    la ...", a line repeated to the end. Answers shorter than ``min_tokens`` are never degenerate."""
    if len(ids) < min_tokens:
        return False
    for n in range(1, max_n + 1):
        grams = Counter(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
        gram, count = grams.most_common(1)[0]
        if count < 4:
            continue
        covered = set()
        for i in range(len(ids) - n + 1):
            if tuple(ids[i:i + n]) == gram:
                covered.update(range(i, i + n))
        if len(covered) >= share * len(ids):
            return True
    return False


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter length where one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def answer_nll(model, prompt_ids: list[int], answer_ids: list[int]) -> torch.Tensor:
    """NLL (nats) of each answer token given the prompt and the answer before it, teacher-forced in one forward.
    ``model``: a Hugging Face model (its own forward), or a lean cache (models/fast.py FastKVModel: the engine's own
    arithmetic, what it serves; bf16's differs from Hugging Face's, which computes in bf16), reset here."""
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)])
    if isinstance(model, torch.nn.Module):
        logits = model(input_ids=ids).logits[0]
    else:
        model.reset(ids.shape[1])
        logits = model.forward(ids[0])
    logits = logits[len(prompt_ids) - 1: -1].float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(answer_ids), reduction="none")


def mean_answer_nll(model, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """The mean of :func:`answer_nll` (0 for an empty answer: an end token first is nothing to score)."""
    return float(answer_nll(model, prompt_ids, answer_ids).mean()) if answer_ids else 0.0


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with the model's own forward and cache (Hugging Face's), up to an end token."""
    out = model.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_new_tokens, do_sample=False,
                         num_beams=1, pad_token_id=next(iter(eos), 0), eos_token_id=sorted(eos) or None)
    ids = out[0, len(prompt_ids):].tolist()
    return ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))]


@dataclass
class Answer:
    """One precision's greedy answer to one prompt, and its NLL of the reference answer's tokens (mean, nats)."""

    ids: list[int]
    nll_of_reference: float


@dataclass
class Row:
    """One prompt, reference against candidate."""

    prompt: str
    nll_gap: float  # candidate's mean NLL of the reference answer − the reference's own
    first_difference: int
    equal: bool
    degenerate: bool
    reference_degenerate: bool

    @property
    def broken(self) -> bool:
        return self.degenerate and not self.reference_degenerate


def compare(prompt: str, reference: Answer, candidate: Answer) -> Row:
    """One prompt's :class:`Row`."""
    return Row(prompt=prompt, nll_gap=round(candidate.nll_of_reference - reference.nll_of_reference, 5),
               first_difference=first_difference(candidate.ids, reference.ids), equal=candidate.ids == reference.ids,
               degenerate=degenerate(candidate.ids), reference_degenerate=degenerate(reference.ids))


@dataclass
class Verdict:
    """The gate's result over some prompts: ``passed``, and why not."""

    passed: bool
    reasons: list[str]
    mean_gap: float
    worst_gap: float
    rows: list[Row]

    def to_dict(self) -> dict:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}


def verdict(rows: list[Row], close: int = 0) -> Verdict:
    """Pass when no candidate answer degenerates where the reference's does not, and the NLL gaps stay within
    :data:`MAX_MEAN_GAP` (mean) and :data:`MAX_WORST_GAP` (worst prompt); with ``close`` > 0, also when every answer
    keeps the reference's first ``close`` tokens (or all of it). ``close`` is for a precision over fp32's own
    weights (q4a8), whose answers should not leave fp32's at once: the NLL limits pass SmolLM2 at q4a8 answering
    "L'Étoile" for the capital of France (a first difference at token 0, a worst gap of 0.04)."""
    gaps = [r.nll_gap for r in rows]
    mean_gap, worst_gap = sum(gaps) / max(len(gaps), 1), max(gaps, default=0.0)
    reasons = [f"a degenerate answer where fp32's is not: {r.prompt[:60]!r}" for r in rows if r.broken]
    reasons += [f"an answer that leaves fp32's at token {r.first_difference} (of the first {close}): "
                f"{r.prompt[:60]!r}" for r in rows if r.first_difference < close and not r.equal]
    if mean_gap > MAX_MEAN_GAP:
        reasons.append(f"mean NLL gap {mean_gap:.3f} nats/token > {MAX_MEAN_GAP}")
    if worst_gap > MAX_WORST_GAP:
        reasons.append(f"worst prompt's NLL gap {worst_gap:.3f} nats/token > {MAX_WORST_GAP}")
    return Verdict(not reasons, reasons, round(mean_gap, 5), round(worst_gap, 5), rows)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt as the engine sends it: the chat template's user turn where the tokenizer has one."""
    return encode_prompt(tokenizer, prompt)


def end_tokens(model, tokenizer) -> set[int]:
    """The ids that end an answer: the generation config's and the tokenizer's end tokens."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def reference_answers(model, tokenizer, prompts=GATE_PROMPTS, max_new_tokens: int = GATE_TOKENS) -> list[Answer]:
    """The reference model's greedy answers (take them before the model is converted in place)."""
    eos = end_tokens(model, tokenizer)
    out = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt)
        answer = greedy(model, ids, max_new_tokens, eos)
        out.append(Answer(answer, mean_answer_nll(model, ids, answer)))
    return out


def gate(model, tokenizer, references: list[Answer], prompts=GATE_PROMPTS,
         max_new_tokens: int = GATE_TOKENS, close: int = 0) -> Verdict:
    """The converted ``model`` against the reference's answers to the same prompts (``close``: :func:`verdict`)."""
    eos = end_tokens(model, tokenizer)
    rows = []
    for prompt, ref in zip(prompts, references):
        ids = prompt_ids(tokenizer, prompt)
        candidate = Answer(greedy(model, ids, max_new_tokens, eos), mean_answer_nll(model, ids, ref.ids))
        rows.append(compare(prompt, ref, candidate))
    return verdict(rows, close)
