"""Self-distillation data for the draft heads: the target's own greedy answers to a prompt set, and
its final-normed hidden states over prompt + answer (what the heads see at drafting time).

Prompts (:func:`default_prompts`): GSM8K *train* questions (the benchmark uses the test split; read
from the package's ``speculate/data/gsm8k/train.jsonl`` or ``$SPECULATE_DATA``'s, see
:func:`speculate.bench.datasets.default_data_dir`), chat questions — 40 written here (not MT-Bench's
own), then ones the target writes itself (:func:`self_instruct_prompts`, Magpie: Xu et al. 2024) — and
rewrite / summarize / explain tasks over GSM8K train solutions, interleaved 1:2:1. Answers are
generated in batches with Hugging Face ``generate`` (left padding, greedy), then one teacher-forced
pass of the target (the KV model, one sequence at a time, no padding) gives the hidden rows.
Everything lands in one safetensors file, written atomically, keyed by model, prompt count and answer
length, so a rerun (or a resumed training) reuses it; the answers are also saved after every
generation batch, so an interrupted generation resumes at the next batch.

For fused EAGLE heads the pass also keeps the outputs of some decoder layers (``taps``); a cached
file without them gets one more teacher-forced pass over its sequences (:func:`with_taps`).

Sizes: rows are stored in fp16; N sequences of ~L tokens take N·L·H·2 bytes (512 × 300 × 576 × 2 ≈
180 MB for the default model).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculateError

QUESTIONS = [
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a short email to a colleague asking to move our meeting to Thursday.",
    "What are three tips for staying focused while studying?",
    "Describe the water cycle to a ten-year-old.",
    "Compare trains and planes for a 500 km trip: cost, time and comfort.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a simple recipe for pancakes.",
    "Why is the sky blue? Answer in a short paragraph.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five ways to save energy at home.",
    "Explain what a neural network is in simple terms.",
    "Write a short story about a robot who learns to paint.",
    "What should I pack for a weekend hiking trip?",
    "How do vaccines work?",
    "Suggest a name for a coffee shop and explain why.",
    "What are the pros and cons of working from home?",
    "Explain recursion with an example.",
    "Write a thank-you note to a teacher.",
    "How can I improve my sleep?",
    "Describe the main causes of the French Revolution.",
    "Write a SQL query that counts orders per customer.",
    "What is photosynthesis?",
    "Give three arguments for learning a second language.",
    "Explain the rules of chess briefly.",
    "Write a limerick about a cat.",
    "What is inflation and why does it matter?",
    "How does a bicycle stay upright?",
    "Plan a one-day visit to a museum with children.",
    "Explain the difference between weather and climate.",
    "Write a JavaScript function that reverses a string.",
    "What makes a good presentation?",
    "Describe how to change a flat tire.",
    "Explain what an API is to a non-programmer.",
    "Write a motivational message for someone starting a new job.",
    "What are the planets of the solar system, in order?",
    "How do I make a budget?",
    "Summarize the plot of Romeo and Juliet.",
    "Explain Newton's three laws of motion.",
    "What are some healthy breakfast ideas?",
]
TASKS = [
    "Rewrite in plain English: {text}",
    "Summarize in one sentence: {text}",
    "Explain this solution step by step: {text}",
    "Rewrite this more formally: {text}",
]


CHAT_SLOTS = (1, 2)  # of every four prompts: a GSM8K question (0), two chat questions, a task (3)


def default_prompts(n: int, seed: int = 0, data_dir: Path | None = None, chat: list[str] | None = None) -> list[str]:
    """``n`` prompts, in slots of four: a GSM8K train question, two chat questions, a rewrite/summarize
    task (chat questions instead of GSM8K ones when the data directory, a ``$SPECULATE_DATA`` or
    ``data_dir``, lacks gsm8k/train.jsonl). Chat questions: the written ones above, then ``chat`` (e.g.
    :func:`self_instruct_prompts`), then the written ones again, numbered."""
    rng = random.Random(seed)
    path = _gsm8k_train(data_dir)
    rows = []
    if path.is_file():
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rng.shuffle(rows)
    questions = QUESTIONS + list(chat or [])
    out, i, q = [], 0, 0
    while len(out) < n:
        slot = len(out) % 4
        if slot in CHAT_SLOTS or not rows:
            extra = q // len(questions)  # past the end: the written ones again, numbered (greedy: no repeats)
            out.append(questions[q % len(questions)] + (f" ({extra})" if extra else ""))
            q += 1
        elif slot == 0:
            out.append(rows[i % len(rows)]["question"])
            i += 1
        else:
            text = rows[i % len(rows)]["answer"].split("####")[0].strip()
            i += 1
            out.append(rng.choice(TASKS).format(text=re.sub(r"<<[^>]*>>", "", text)))
    return out[:n]


def _gsm8k_train(data_dir: Path | None = None) -> Path:
    """GSM8K's train split in ``data_dir``, else in the default data directory (the packaged copy)."""
    from ..bench.datasets import default_data_dir

    return (data_dir or default_data_dir()) / "gsm8k" / "train.jsonl"


def chat_slots(n: int, data_dir: Path | None = None) -> int:
    """How many of :func:`default_prompts`'s first ``n`` prompts are chat questions (all of them when
    the GSM8K file is absent)."""
    if not _gsm8k_train(data_dir).is_file():
        return n
    return sum(i % 4 in CHAT_SLOTS for i in range(n))


def self_instruct_prompts(loaded, n: int, seed: int = 0, batch_size: int = 32, max_new_tokens: int = 64,
                          progress: bool = True) -> list[str]:
    """``n`` user questions written by the target itself (Magpie, Xu et al. 2024): the chat template up to
    the start of a user turn, then sampled text (temperature 1, top-p 0.95) up to the end of that turn.
    Kept: turns that ended (EOS before ``max_new_tokens``), of 4 words or more, each once. The prompts
    follow the model's own idea of a user, so its answers to them are what it says in chat."""
    from tqdm import tqdm

    from ..text import eos_ids

    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None) or n <= 0:
        return []
    sentinel = "\x00SPECULATE\x00"
    text = tok.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    prefix = tok(text[: text.index(sentinel)], add_special_tokens=False)["input_ids"]
    eos = sorted(eos_ids(loaded))
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    out, seen = [], set()
    bar = tqdm(total=n, desc="writing chat prompts", unit="prompt", disable=not progress)
    try:
        for _ in range(max(4, 4 * n // batch_size + 4)):  # a bound: a model that never ends a turn stops here
            if len(out) >= n:
                break
            with torch.inference_mode():
                gen = loaded.model.generate(torch.tensor([prefix] * batch_size),
                                            attention_mask=torch.ones(batch_size, len(prefix), dtype=torch.long),
                                            do_sample=True, temperature=1.0, top_p=0.95, top_k=0,
                                            max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])
            for row in gen[:, len(prefix):].tolist():
                end = next((j for j, t in enumerate(row) if t in eos), None)
                if end is None:  # the turn did not end
                    continue
                question = tok.decode(row[:end], skip_special_tokens=True).strip()
                if len(question.split()) >= 4 and question not in seen and len(out) < n:
                    seen.add(question)
                    out.append(question)
                    bar.update(1)
    finally:
        torch.random.set_rng_state(generator_state)
        bar.close()
    return out


@dataclass
class DistillData:
    """Concatenated sequences: ``ids`` [N_tok] (prompt + answer of each), ``hidden`` [N_tok, H] fp16 (row
    t predicts token t+1 of its sequence), ``starts``/``lengths``/``prompt_lengths`` [N_seq]."""

    ids: torch.Tensor
    hidden: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    meta: dict
    # [N_tok, len(meta["feature_layers"])·H] fp16: those decoder layers' outputs, for fused EAGLE heads.
    taps: torch.Tensor | None = None

    def tap_columns(self, layers) -> torch.Tensor | None:
        """The columns of ``taps`` holding ``layers``' outputs, in that order (None for no layers)."""
        if not layers:
            return None
        have = list(self.meta.get("feature_layers", ()))
        missing = [i for i in layers if i not in have]
        if self.taps is None or missing:
            raise SpeculateError(f"the training data holds no outputs of layers {missing or list(layers)}; "
                                 f"rebuild it with those feature layers")
        h = self.hidden.shape[1]
        return torch.cat([torch.arange(have.index(i) * h, (have.index(i) + 1) * h) for i in layers])

    def answer_tokens(self) -> torch.Tensor:
        return torch.cat([self.ids[s + p: s + n] for s, n, p in
                          zip(self.starts.tolist(), self.lengths.tolist(), self.prompt_lengths.tolist())])

    def frequency_subset(self, size: int, vocab_size: int) -> torch.Tensor:
        """FR-Spec: the ``size`` most frequent token ids of the answers (then of the prompts, then the lowest
        ids), sorted by id."""
        counts = torch.bincount(self.answer_tokens(), minlength=vocab_size).double()
        counts += torch.bincount(self.ids, minlength=vocab_size).double() * 1e-3  # prompts break ties
        # Then lower ids first: BPE vocabularies number their tokens roughly by merge order (frequency).
        counts += torch.linspace(1e-6, 0, vocab_size, dtype=torch.float64)
        top = counts.topk(min(size, vocab_size)).indices
        return top.sort().values


def encode(tokenizer, prompt: str) -> list[int]:
    from ..text import encode_prompt

    return list(encode_prompt(tokenizer, prompt, None))


def generate_answers(loaded, prompts: list[str], max_new_tokens: int, batch_size: int = 16,
                     progress: bool = True, partial: Path | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) per prompt, with HF generate in left-padded batches (longest
    prompts together, to waste little on padding). An answer ends at (and keeps) EOS.

    ``partial``: a JSON file where the answers so far are saved (atomically) after every batch, and
    read back at the start, so an interrupted run resumes at the next batch."""
    from tqdm import tqdm

    from ..models.cache import atomic_write_text
    from ..text import eos_ids

    model, tok = loaded.model, loaded.tokenizer
    eos = sorted(eos_ids(loaded))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    encoded = [encode(tok, p) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    out: list = [None] * len(prompts)
    done = {}
    if partial is not None and partial.is_file():
        try:
            saved = json.loads(partial.read_text())
            if saved.get("max_new_tokens") == max_new_tokens:
                done = {tuple(pair[0]): pair[1] for pair in saved["pairs"]}
        except (ValueError, KeyError, TypeError):
            done = {}
    for i, ids in enumerate(encoded):
        if tuple(ids) in done:
            out[i] = (ids, done[tuple(ids)])
    order = [i for i in order if out[i] is None]
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(order), desc="generating answers", unit="prompt",
               disable=not progress)
    for b in range(0, len(order), batch_size):
        idx = order[b: b + batch_size]
        width = max(len(encoded[i]) for i in idx)
        input_ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):
            input_ids[row, width - len(encoded[i]):] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]):] = 1
        with torch.inference_mode():
            gen = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for row, i in enumerate(idx):
            answer = gen[row, width:].tolist()
            for j, t in enumerate(answer):
                if t in eos:
                    answer = answer[: j + 1]
                    break
            out[i] = (encoded[i], answer)
        bar.update(len(idx))
        if partial is not None:
            atomic_write_text(partial, json.dumps({"max_new_tokens": max_new_tokens,
                                                   "pairs": [pair for pair in out if pair is not None]}))
    bar.close()
    return out


def hidden_states(loaded, pairs, progress: bool = True, feature_layers=()) -> DistillData:
    """The teacher-forced pass: final-normed hidden rows over each prompt + answer (KVModel.hidden), and
    the outputs of ``feature_layers`` (``taps``, for fused EAGLE heads)."""
    from tqdm import tqdm

    from ..models.kv import KVModel

    kv = KVModel(loaded)
    kv.taps = tuple(feature_layers)
    h = int(loaded.model.config.hidden_size)
    ids, rows, taps, starts, lengths, plens = [], [], [], [], [], []
    at = 0
    for prompt, answer in tqdm(pairs, desc="hidden states", unit="seq", disable=not progress):
        seq = prompt + answer
        kv.reset(capacity=len(seq) + 1)
        kv.forward(torch.tensor(seq), last=1)
        wide = kv.hidden.to(torch.float16)
        rows.append(wide[:, :h])
        if feature_layers:
            taps.append(wide[:, h:])
        ids.append(torch.tensor(seq))
        starts.append(at), lengths.append(len(seq)), plens.append(len(prompt))
        at += len(seq)
    return DistillData(torch.cat(ids), torch.cat(rows), torch.tensor(starts), torch.tensor(lengths),
                       torch.tensor(plens), {"feature_layers": list(feature_layers)} if feature_layers else {},
                       torch.cat(taps) if feature_layers else None)


def with_taps(loaded, data: DistillData, feature_layers, progress: bool = True) -> DistillData:
    """``data`` with the outputs of ``feature_layers`` too: the teacher-forced pass again over its
    sequences (the answers are kept; ~8 min for the default recipe on two cores), keeping the layers it
    had. Unchanged when it holds them already."""
    have = list(data.meta.get("feature_layers", ())) if data.taps is not None else []
    if all(i in have for i in feature_layers):  # (none asked: nothing to add)
        return data
    layers = sorted(set(have) | set(feature_layers))
    pairs = [(data.ids[s: s + p].tolist(), data.ids[s + p: s + n].tolist()) for s, n, p in
             zip(data.starts.tolist(), data.lengths.tolist(), data.prompt_lengths.tolist())]
    out = hidden_states(loaded, pairs, progress, layers)
    out.meta = {**data.meta, **out.meta}
    return out


def save_data(path: Path, data: DistillData) -> None:
    from safetensors.torch import save_file

    from ..models.cache import atomic_path

    tensors = {"ids": data.ids, "hidden": data.hidden, "starts": data.starts, "lengths": data.lengths,
               "prompt_lengths": data.prompt_lengths}
    if data.taps is not None:
        tensors["taps"] = data.taps
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"meta": json.dumps(data.meta)})


def load_data(path: Path) -> DistillData | None:
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["meta"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        return DistillData(t["ids"], t["hidden"], t["starts"], t["lengths"], t["prompt_lengths"], meta, t.get("taps"))
    except Exception:  # missing, truncated or from another version: rebuild
        return None


def build_data(loaded, out_dir: Path, n_prompts: int, max_new_tokens: int, batch_size: int = 16,
               prompts: list[str] | None = None, progress: bool = True, feature_layers=()) -> DistillData:
    """The cached data in ``out_dir/data-<prompts>x<tokens>.safetensors``, built first when missing (or
    extended, :func:`with_taps`, when it lacks some of ``feature_layers``)."""
    path, key = _data_file(loaded, out_dir, n_prompts, max_new_tokens)
    data = load_data(path)
    if data is not None and all(data.meta.get(k) == v for k, v in key.items()):
        extended = with_taps(loaded, data, feature_layers, progress)
        if extended is not data:
            save_data(path, extended)
        return extended
    if prompts is None:
        prompts = _cached_prompts(loaded, path.with_suffix(".prompts.json"), n_prompts, progress)
    if not prompts:
        raise SpeculateError("no prompts to build training data from")
    partial = path.with_suffix(".answers.json")
    pairs = generate_answers(loaded, prompts, max_new_tokens, batch_size, progress, partial)
    data = hidden_states(loaded, pairs, progress, feature_layers)
    data.meta = {**key, **data.meta, "tokens": int(data.ids.numel()), "answer_tokens": int(data.answer_tokens().numel())}
    save_data(path, data)
    partial.unlink(missing_ok=True)
    path.with_suffix(".prompts.json").unlink(missing_ok=True)
    return data


def build_answers(loaded, out_dir: Path, n_prompts: int, max_new_tokens: int, batch_size: int = 16,
                  progress: bool = True) -> list[list[int]]:
    """The answers of :func:`build_data`'s data, without its hidden states (for the answer store,
    drafters/answer_store.py): read from the data file when it is built, else generated — resumable, and
    the answers stay cached in ``out_dir`` for a later :func:`build_data` to reuse."""
    from safetensors import safe_open

    path, key = _data_file(loaded, out_dir, n_prompts, max_new_tokens)
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["meta"])
            ids, starts, lengths, prompt_lengths = (f.get_tensor(name).tolist() for name in
                                                    ("ids", "starts", "lengths", "prompt_lengths"))
        if all(meta.get(k) == v for k, v in key.items()):
            return [ids[s + p: s + n] for s, n, p in zip(starts, lengths, prompt_lengths)]
    except Exception:  # missing, truncated or another version's: generate
        pass
    prompts = _cached_prompts(loaded, path.with_suffix(".prompts.json"), n_prompts, progress)
    pairs = generate_answers(loaded, prompts, max_new_tokens, batch_size, progress, path.with_suffix(".answers.json"))
    return [answer for _, answer in pairs]


def _data_file(loaded, out_dir: Path, n_prompts: int, max_new_tokens: int) -> tuple[Path, dict]:
    """Where the data of ``n_prompts`` answers of up to ``max_new_tokens`` lives, and the metadata it must have."""
    key = {"model": loaded.name, "prompts": n_prompts, "max_new_tokens": max_new_tokens,
           "hidden_size": int(loaded.model.config.hidden_size)}
    return Path(out_dir) / f"data-{n_prompts}x{max_new_tokens}.safetensors", key


def _cached_prompts(loaded, file: Path, n_prompts: int, progress: bool) -> list[str]:
    """:func:`default_prompts` with the target's own chat questions, kept in ``file`` until the data is
    built (sampling is seeded, but a resumed run must not depend on bit-identical sampling)."""
    from ..models.cache import atomic_write_text

    try:
        saved = json.loads(file.read_text())
        if len(saved) == n_prompts and all(isinstance(p, str) for p in saved):
            return saved
    except (OSError, ValueError):
        pass
    chat = self_instruct_prompts(loaded, max(chat_slots(n_prompts) - len(QUESTIONS), 0), progress=progress)
    prompts = default_prompts(n_prompts, chat=chat)
    file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(file, json.dumps(prompts))
    return prompts
