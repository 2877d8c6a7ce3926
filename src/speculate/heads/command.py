"""``speculate train-heads``: build the self-distillation data, train Medusa heads or an EAGLE head on
the target's own hidden states, and save them (heads.safetensors + config.json) into ``--out``.

    speculate train-heads --kind medusa --model smollm2-135m-instruct --out heads/medusa
    speculate train-heads --kind eagle  --model smollm2-135m-instruct --out heads/eagle

The data (``--prompts`` answers of up to ``--max-new-tokens``) is cached in ``--out`` (or
``--data-dir``, to share it between kinds); training checkpoints there every ``--checkpoint-every``
steps, and rerunning the same command resumes from the last checkpoint. Bad input raises
SpeculateError: one line on stderr, exit code 2 (see :func:`speculate.cli.main`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..errors import SpeculateError

# The recipe of the shipped heads (docs/benchmarks.md, "Training the shipped heads"): 2,048 prompts; Medusa
# 2,000 steps, EAGLE 1,600 steps on two drafting steps each (--unroll 2).
DEFAULTS = {"prompts": 2048, "max_new_tokens": 160, "batch": 16, "medusa_steps": 2000, "eagle_steps": 1600,
            "heads": 4, "vocab_subset": 8192, "unroll": 2}


def add_data_arguments(parser, out_help: str) -> None:
    """The flags of the self-distillation data (the target answering a prompt set), shared with
    ``speculate train-answers`` (speculate/answers.py)."""
    from ..models import ALIASES, DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"target model: an alias ({', '.join(ALIASES)}) or a local Hugging Face folder "
                             f"(default {DEFAULT_MODEL})")
    parser.add_argument("--out", required=True, help=out_help)
    parser.add_argument("--data-dir", help="where to cache the self-distillation data (default: --out)")
    parser.add_argument("--prompts", type=int, default=DEFAULTS["prompts"],
                        help=f"prompts to answer for the training data (default {DEFAULTS['prompts']})")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"],
                        help=f"longest answer per prompt (default {DEFAULTS['max_new_tokens']})")
    parser.add_argument("--gen-batch", type=int, default=DEFAULTS["batch"],
                        help=f"prompts per generate() batch (default {DEFAULTS['batch']})")


def data_folders(args) -> tuple[Path, Path]:
    """(--out, --data-dir) after checking the data flags and creating both folders — before any model loads, so a
    mistake is one line, not a traceback later."""
    from ..models.cache import make_folder

    for flag, value in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--gen-batch", args.gen_batch)):
        if value < 1:
            raise SpeculateError(f"{flag} must be >= 1, got {value}")
    out = Path(args.out)
    data_dir = Path(args.data_dir) if args.data_dir else out
    for flag, folder in (("--out", out), ("--data-dir", data_dir)):
        make_folder(folder, flag)
    return out, data_dir


def log(msg: str) -> None:
    print(f"speculate: {msg}", file=sys.stderr, flush=True)


def add_arguments(parser) -> None:
    # "answers" is the former spelling of `speculate train-answers` (cli.py routes it there).
    parser.add_argument("--kind", required=True, choices=("medusa", "eagle", "answers"),
                        help="which heads to train (answers: the same as `speculate train-answers`)")
    add_data_arguments(parser, "output folder: the heads, the checkpoint and the data cache")
    parser.add_argument("--steps", type=int,
                        help=f"optimizer steps (default {DEFAULTS['medusa_steps']} for medusa, "
                             f"{DEFAULTS['eagle_steps']} for eagle; --epochs instead sets them from the data size)")
    parser.add_argument("--epochs", type=float, help="passes over the training data (instead of --steps)")
    parser.add_argument("--batch-size", type=int, help="training batch: positions (medusa, default 256) or "
                                                        "sequences (eagle, default 8)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default 1e-3 medusa, 5e-4 eagle)")
    parser.add_argument("--heads", type=int, default=DEFAULTS["heads"],
                        help=f"Medusa heads K (default {DEFAULTS['heads']})")
    parser.add_argument("--vocab-subset", type=int, default=DEFAULTS["vocab_subset"],
                        help="FR-Spec: draft over the N most frequent answer tokens only (0 = whole vocabulary; "
                             f"default {DEFAULTS['vocab_subset']})")
    parser.add_argument("--unroll", type=int, default=DEFAULTS["unroll"],
                        help="EAGLE: train on this many drafting steps, each on the head's own previous "
                             f"prediction (EAGLE-3's training-time test; 1 = EAGLE-1; default {DEFAULTS['unroll']})")
    parser.add_argument("--feature-layers", default="",
                        help="EAGLE: comma-separated decoder layers (0-based) whose outputs the head reads beside "
                             "the final hidden row (EAGLE-3's fused features, e.g. 2,15; default none: EAGLE-1's "
                             "input). The data gets one more teacher-forced pass for them")
    parser.add_argument("--loss-weights", default=None, metavar="FEATURE,TOKEN",
                        help="EAGLE: the weights of the feature (smooth-L1) and token (cross-entropy) losses "
                             "(default 1,0.1: EAGLE-1's)")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (default 200)")
    parser.add_argument("--fp32", action="store_true", help="store the heads in fp32 (default fp16: half the size)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the heads' initial weights and of the training batches' order")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from ..models import load_model
    from .data import build_data
    from .io import check_feature_layers, save_heads
    from .train import train_heads

    for flag, value, low in (("--heads", args.heads, 1), ("--checkpoint-every", args.checkpoint_every, 1),
                             ("--vocab-subset", args.vocab_subset, 0), ("--unroll", args.unroll, 1)):
        if value < low:
            raise SpeculateError(f"{flag} must be >= {low}, got {value}")
    if args.steps is not None and args.epochs is not None:
        raise SpeculateError("give --steps or --epochs, not both")
    if args.steps is not None and args.steps < 1 or args.epochs is not None and not args.epochs > 0:
        raise SpeculateError("--steps must be >= 1 and --epochs > 0")
    if args.batch_size is not None and args.batch_size < 1:
        raise SpeculateError("--batch-size must be >= 1")
    feature_layers = _layers(args.feature_layers, args.kind)
    loss_weights = _loss_weights(args.loss_weights, args.kind)
    progress = not args.quiet
    out, data_dir = data_folders(args)
    t0 = time.perf_counter()
    target = load_model(args.model, dtype="fp32", progress=progress)  # heads learn fp32's own features
    check_feature_layers(feature_layers, target, "--feature-layers")
    data = build_data(target, data_dir, args.prompts, args.max_new_tokens, args.gen_batch, progress=progress,
                      feature_layers=feature_layers)
    data_seconds = time.perf_counter() - t0
    log(f"data: {data.starts.numel()} sequences, {data.meta['tokens']} tokens ({data.meta['answer_tokens']} in "
        f"answers), hidden rows {data.hidden.numel() * 2 / 1e6:.0f} MB, ready after {data_seconds:.0f} s")
    steps = args.steps
    if steps is None:
        if args.epochs is not None:
            batch = args.batch_size or (256 if args.kind == "medusa" else 8)
            units = data.meta["answer_tokens"] if args.kind == "medusa" else data.starts.numel()
            steps = max(1, round(args.epochs * units / batch))
        else:
            steps = DEFAULTS[f"{args.kind}_steps"]
    heads, meta = train_heads(args.kind, target, data, out, steps, args.batch_size, args.lr, args.heads,
                              args.vocab_subset or None, args.checkpoint_every, args.seed, progress=progress, log=log,
                              unroll=args.unroll, feature_layers=feature_layers, loss_weights=loss_weights)
    # This run's data time plus the training loop's, summed over resumed runs (train_seconds).
    meta["train_seconds_total"] = round(data_seconds + meta["train_seconds"], 1)
    vocab_size = int(target.model.get_output_embeddings().out_features)
    import torch

    save_heads(out, heads, target.name, vocab_size, meta, torch.float32 if args.fp32 else torch.float16)
    log(f"saved {args.kind} heads to {out} (held-out top-1: {meta.get('heldout_top1')}, vocabulary coverage "
        f"{meta['vocab_coverage']:.1%}) in {meta['train_seconds_total']:.0f} s")
    return 0


def _layers(text: str, kind: str) -> tuple[int, ...]:
    """``--feature-layers`` as distinct non-negative layer indices, in the order given."""
    if not text.strip():
        return ()
    if kind != "eagle":
        raise SpeculateError("--feature-layers is for --kind eagle")
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpeculateError(f"--feature-layers wants comma-separated layer numbers, got '{text}'") from None
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise SpeculateError(f"--feature-layers wants distinct layer numbers >= 0, got '{text}'")
    return layers


def _loss_weights(text: str | None, kind: str) -> tuple[float, float]:
    """``--loss-weights FEATURE,TOKEN``: two numbers >= 0, not both 0."""
    from .train import EAGLE_LOSS

    if text is None:
        return EAGLE_LOSS
    if kind != "eagle":
        raise SpeculateError("--loss-weights is for --kind eagle")
    try:
        weights = tuple(float(x) for x in text.split(","))
    except ValueError:
        weights = ()
    if len(weights) != 2 or min(weights) < 0 or max(weights) == 0:
        raise SpeculateError(f"--loss-weights wants two numbers >= 0 (feature, token), not both 0; got '{text}'")
    return weights
