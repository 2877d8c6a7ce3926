"""``speculate train-answers``: the retrieval drafter's answer store for a target — the target's own greedy answers
to the self-distillation prompt set (no hidden states, no training), as an n-gram table (drafters/answer_store.py).

    speculate train-answers --model smollm2-135m-instruct --out answers/

It shares the heads' data (heads/data.py): answers cached in ``--out`` (or ``--data-dir``) are read, not generated
again, and a later ``speculate train-heads`` on the same data reuses them. Why a command of its own, above both
packages: an answer store is not a head, and with its builder here neither ``heads`` nor ``drafters`` imports the
other's commands.
"""

from __future__ import annotations

from .drafters.answer_store import FILE, save_store
from .heads.command import add_data_arguments, data_folders, log


def add_arguments(parser) -> None:
    add_data_arguments(parser, f"output folder: the store ({FILE}) and the cached answers")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from .heads.data import build_answers
    from .models import load_model

    out, data_dir = data_folders(args)
    progress = not args.quiet
    target = load_model(args.model, dtype="fp32", progress=progress)  # the model's own fp32 answers
    answers = build_answers(target, data_dir, args.prompts, args.max_new_tokens, args.gen_batch, progress)
    meta = {"model": target.name, "vocab_size": int(target.model.get_output_embeddings().out_features),
            "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
            "answer_tokens": sum(len(a) for a in answers)}
    save_store(out / FILE, answers, meta)
    log(f"saved the answer store ({len(answers)} answers, {meta['answer_tokens']} tokens) to {out / FILE}")
    return 0
