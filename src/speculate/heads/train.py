"""Training the draft heads on the self-distillation data (heads/data.py), on CPU.

Medusa: batches of random positions t; head i's label is the token at t+2+i (answer tokens only),
cross-entropy per head weighted 0.8^i (Medusa-1), through the target's frozen LM head.
EAGLE: batches of whole sequences (right-padded, causal); the pair at t is [embedding of token t+1,
f_t] (f_t with a little uniform noise, as EAGLE does), the head predicts f̂_{t+1}; loss = smooth-L1
(f̂_{t+1}, f_{t+1}) + 0.1 · cross-entropy(LM head(f̂_{t+1}), token t+2) on answer tokens. With
``unroll`` = n > 1 (EAGLE-3's training-time test, :meth:`EagleHead.unroll`) the head also drafts n − 1
more steps on its own predictions, and pass m's loss (against f_{t+m} and token t+m+1) is added with
weight 0.8^(m−1), as drafting at depth m runs.

With an FR-Spec vocabulary subset the LM head is cut to those rows in training too (labels outside
it are skipped), which is most of the cost. AdamW, warm-up then cosine decay, gradient clipping;
a tqdm bar with the running loss and ETA; a checkpoint (weights, optimizer, step, RNG) every
``checkpoint_every`` steps in ``out_dir/checkpoint.pt``, written atomically, from which a rerun with
the same settings resumes at the saved step.

Held-out top-1 (5 % of the sequences, never trained on) is measured at every checkpoint and at the end,
and the heads of the best measurement are the ones returned: an earlier shipped EAGLE head (1,024 prompts,
16 passes) reached top-1 0.95 on its training sequences and 0.46 on held-out ones, so later steps can be worse.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import SpeculateError
from .data import DistillData
from .eagle import EagleHead
from .medusa import MedusaHeads, subset_weight

CHECKPOINT = "checkpoint.pt"
EAGLE_LOSS = (1.0, 0.1)  # (feature smooth-L1, token cross-entropy): EAGLE-1's weights


def make_heads(kind: str, loaded, n_heads: int = 4, vocab: torch.Tensor | None = None,
               feature_layers: tuple[int, ...] = ()):
    cfg = loaded.model.config
    if kind == "medusa":
        return MedusaHeads(cfg.hidden_size, n_heads, 1, vocab)
    if kind == "eagle":
        return EagleHead.for_target(cfg, vocab, feature_layers)
    raise SpeculateError(f"unknown head kind '{kind}'; choose medusa or eagle")


class _Batches:
    """Index tensors over the concatenated data, built once."""

    def __init__(self, data: DistillData, n_heads: int, label_map: torch.Tensor, holdout: float = 0.05,
                 feature_layers: tuple[int, ...] = ()):
        self.data, self.label_map = data, label_map
        # EAGLE with fused features: the columns of data.taps that hold the head's layers, in its order.
        self.tap_columns = data.tap_columns(feature_layers)
        n_seq = data.starts.numel()
        n_hold = max(1, int(n_seq * holdout)) if n_seq > 1 else 0
        self.train_seqs = torch.arange(n_hold, n_seq)
        self.eval_seqs = torch.arange(0, n_hold)
        seq_of = torch.repeat_interleave(torch.arange(n_seq), data.lengths)
        pos = torch.arange(data.ids.numel()) - data.starts[seq_of]
        self.pos, self.len, self.plen = pos, data.lengths[seq_of], data.prompt_lengths[seq_of]
        # Medusa: positions whose head-0 label (t+2) is an answer token.
        ok = (pos + 2 < self.len) & (pos + 2 >= self.plen)
        in_eval = seq_of < n_hold
        self.medusa_train = torch.nonzero(ok & ~in_eval).flatten()
        self.medusa_eval = torch.nonzero(ok & in_eval).flatten()
        self.n_heads = n_heads

    def medusa(self, index: torch.Tensor):
        """(hidden [B, H] fp32, labels [B, K] in subset ids, -100 where none)."""
        d = self.data
        hidden = d.hidden[index].float()
        labels = torch.full((index.numel(), self.n_heads), -100, dtype=torch.long)
        for i in range(self.n_heads):
            target = index + 2 + i
            ok = (self.pos[index] + 2 + i) < self.len[index]
            lab = self.label_map[d.ids[target.clamp(max=d.ids.numel() - 1)]]
            labels[:, i] = torch.where(ok, lab, torch.full_like(lab, -100))
        return hidden, labels

    def eagle(self, seqs: torch.Tensor, embed: torch.Tensor, max_len: int, generator):
        """(emb [B, T, H], feat [B, T, H], target feat [B, T, H], reg mask [B, T], labels [B, T])."""
        d = self.data
        crops = []
        for s in seqs.tolist():
            start, n, p = int(d.starts[s]), int(d.lengths[s]), int(d.prompt_lengths[s])
            lo = 0
            if n > max_len + 1:  # a random window over the answer part
                lo = int(torch.randint(max(0, min(p, n - max_len - 1)), n - max_len, (1,), generator=generator))
            crops.append((start, lo, min(n, lo + max_len + 1), p))
        t = max(hi - lo for _, lo, hi, _ in crops) - 1
        b, h = len(crops), d.hidden.shape[1]
        width = h + (0 if self.tap_columns is None else self.tap_columns.numel())
        emb, feat, target = torch.zeros(b, t, h), torch.zeros(b, t, width), torch.zeros(b, t, h)
        reg = torch.zeros(b, t, dtype=torch.bool)
        labels = torch.full((b, t), -100, dtype=torch.long)
        for r, (start, lo, hi, p) in enumerate(crops):
            m = hi - lo - 1  # pairs at positions lo..hi-2
            rows = d.hidden[start + lo: start + hi].float()
            ids = d.ids[start + lo: start + hi]
            feat[r, :m, :h], target[r, :m] = rows[:m], rows[1:m + 1]
            if self.tap_columns is not None:
                feat[r, :m, h:] = d.taps[start + lo: start + hi - 1, self.tap_columns].float()
            emb[r, :m] = embed[ids[1:m + 1]].float()
            reg[r, :m] = True
            if m > 1:
                lab = self.label_map[ids[2:m + 1]]
                absolute = torch.arange(lo + 2, lo + m + 1)
                labels[r, : m - 1] = torch.where(absolute >= p, lab, torch.full_like(lab, -100))
        return emb, feat, target, reg, labels


def train_heads(kind: str, loaded, data: DistillData, out_dir: Path, steps: int, batch_size: int | None = None,
                lr: float | None = None, n_heads: int = 4, vocab_subset: int | None = 8192,
                checkpoint_every: int = 200, seed: int = 0, max_len: int = 384, progress: bool = True,
                log=None, stop_at: int | None = None, unroll: int = 1, feature_layers: tuple[int, ...] = (),
                loss_weights: tuple[float, float] = EAGLE_LOSS):
    """Train (or resume) heads of ``kind``; returns (heads in eval mode, metadata dict).

    ``feature_layers`` (EAGLE): target layers whose outputs the head also reads (:class:`EagleHead`); the
    data must hold them (``data.taps``).
    ``loss_weights`` (EAGLE): the feature and token terms' weights (:func:`_eagle_loss`).

    ``stop_at``: stop after that step with a checkpoint (a time-boxed run; rerun to resume) and
    return (None, {"stopped_at": step})."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = loaded.model
    vocab_size = int(model.get_output_embeddings().out_features)
    vocab = data.frequency_subset(vocab_subset, vocab_size) if vocab_subset and vocab_subset < vocab_size else None
    feature_layers = tuple(feature_layers) if kind == "eagle" else ()
    heads = make_heads(kind, loaded, n_heads, vocab, feature_layers)
    lm_weight = subset_weight(model.get_output_embeddings().weight.detach().float(), vocab)
    embed = model.get_input_embeddings().weight.detach()
    label_map = torch.full((vocab_size,), -100, dtype=torch.long)
    if vocab is None:
        label_map = torch.arange(vocab_size)
    else:
        label_map[vocab] = torch.arange(vocab.numel())
    batches = _Batches(data, n_heads if kind == "medusa" else 1, label_map, feature_layers=feature_layers)
    if kind == "medusa":
        batch_size = batch_size or 256
        lr = lr or 1e-3
        if batches.medusa_train.numel() == 0:
            raise SpeculateError("no answer tokens to train on (the answers are empty)")
    else:
        batch_size = batch_size or 8
        lr = lr or 5e-4
    params = [p for p in heads.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))

    gen = torch.Generator().manual_seed(seed)
    if unroll < 1:
        raise SpeculateError(f"unroll must be >= 1, got {unroll}")
    settings = {"kind": kind, "model": loaded.name, "n_heads": n_heads, "vocab_subset": vocab_subset,
                "batch_size": batch_size, "lr": lr, "seed": seed, "data": data.meta}
    if kind == "eagle" and unroll > 1:  # (absent when 1: checkpoints from before the option still resume)
        settings["unroll"] = unroll
    if feature_layers:  # (likewise)
        settings["feature_layers"] = list(feature_layers)
    loss_weights = tuple(float(w) for w in loss_weights)
    if kind == "eagle" and loss_weights != EAGLE_LOSS:  # (likewise)
        settings["loss_weights"] = list(loss_weights)
    start, earlier, began = 0, 0.0, time.perf_counter()
    ckpt = out_dir / CHECKPOINT
    # The best held-out measurement so far: {"step", "score", "heads"} (kept in the checkpoint), and all of them.
    best, curve = None, []

    def spent() -> float:  # training-loop seconds, summed over resumed runs
        return earlier + time.perf_counter() - began

    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state.get("settings") != settings:
            raise SpeculateError(f"{ckpt} was written with other settings ({_diff(state.get('settings'), settings)}); "
                                 f"delete it or use another --out")
        heads.load_state_dict(state["heads"])
        optim.load_state_dict(state["optim"])
        gen.set_state(state["rng"])
        start = int(state["step"])
        earlier = float(state.get("seconds", 0.0))
        best, curve = state.get("best"), list(state.get("curve", []))
        if log:
            log(f"resuming from {ckpt} at step {start}/{steps}")
    noise = _noise_scale(data, batches.tap_columns) if kind == "eagle" else None
    heads.train()
    bar = tqdm(total=steps, initial=start, desc=f"training {kind}", unit="step", disable=not progress)
    running = None
    step = start
    try:
        for step in range(start, steps):
            for group in optim.param_groups:
                group["lr"] = lr_at(step)
            if kind == "medusa":
                pick = batches.medusa_train[torch.randint(batches.medusa_train.numel(), (batch_size,), generator=gen)]
                loss, _ = _medusa_loss(heads, lm_weight, *batches.medusa(pick))
            else:
                seqs = batches.train_seqs[torch.randint(batches.train_seqs.numel(), (batch_size,), generator=gen)]
                emb, feat, target, reg, labels = batches.eagle(seqs, embed, max_len, gen)
                if noise is not None:
                    feat = feat + (torch.rand(feat.shape, generator=gen) * 2 - 1) * noise
                loss = _eagle_loss(heads, lm_weight, emb, feat, target, reg, labels, unroll, loss_weights)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            value = float(loss.detach())
            running = value if running is None else 0.95 * running + 0.05 * value
            bar.update(1)
            bar.set_postfix(loss=f"{running:.3f}")
            if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
                best, point = _measure(kind, heads, lm_weight, batches, embed, max_len, step + 1, best)
                if point is not None:
                    curve.append(point)
                    bar.set_postfix(loss=f"{running:.3f}", heldout=f"{point[1]:.3f}")
            if stop_at is not None and step + 1 >= stop_at and step + 1 < steps:
                save_checkpoint(ckpt, heads, optim, step + 1, gen, settings, spent(), best, curve)
                bar.close()
                return None, {"stopped_at": step + 1}
            if (step + 1) % checkpoint_every == 0 and step + 1 < steps:
                save_checkpoint(ckpt, heads, optim, step + 1, gen, settings, spent(), best, curve)
    except KeyboardInterrupt:  # keep what was done: rerunning the command resumes here
        save_checkpoint(ckpt, heads, optim, step, gen, settings, spent(), best, curve)
        bar.close()
        raise
    bar.close()
    # The training loop's seconds, as the final checkpoint keeps them: a rerun of a finished run reports the same
    # number (the evaluation below is not training, and timing it made the rerun's total drift either way).
    loop_seconds = earlier
    if steps > start:
        loop_seconds = spent()
        save_checkpoint(ckpt, heads, optim, steps, gen, settings, loop_seconds, best, curve)
    if best is not None:  # the best held-out measurement's weights (the last step's unless a later one was worse)
        heads.load_state_dict(best["heads"])
    heads.eval()
    metrics = evaluate(kind, heads, lm_weight, batches, embed, max_len)
    meta = {"steps": steps, "batch_size": batch_size, "lr": lr, "final_loss": running, **metrics,
            **({"unroll": unroll, "feature_layers": list(feature_layers), "loss_weights": list(loss_weights)}
               if kind == "eagle" else {}),
            "best_step": None if best is None else best["step"], "heldout_curve": curve,
            "data": data.meta, "vocab_subset": None if vocab is None else int(vocab.numel()),
            "vocab_coverage": _coverage(data, vocab), "train_seconds": round(loop_seconds, 1)}
    heads.requires_grad_(False)
    return heads, meta


def _noise_scale(data: DistillData, tap_columns) -> torch.Tensor:
    """EAGLE's feature noise: uniform in ±0.1 std of each feature block (the final-normed row, then each
    tapped layer's output, whose scales differ), as a row [width]."""
    h = data.hidden.shape[1]
    blocks = [data.hidden[:4096].float()]
    if tap_columns is not None:
        taps = data.taps[:4096, tap_columns].float()
        blocks += list(taps.split(h, dim=1))
    return torch.cat([torch.full((h,), 0.1 * float(b.std())) for b in blocks])


def _measure(kind, heads, lm_weight, batches, embed, max_len, step, best):
    """Held-out top-1 now (the mean over Medusa's heads, over EAGLE's depths 1 and 2): returns the new
    best and the point [step, score] for the curve (None without held-out sequences)."""
    heads.eval()
    metrics = evaluate(kind, heads, lm_weight, batches, embed, max_len)
    heads.train()
    score = metrics.get("heldout_top1_by_depth", metrics.get("heldout_top1"))  # EAGLE: depths 1, 2; Medusa: heads
    if isinstance(score, list):
        score = None if None in score else sum(score) / len(score)
    if score is None:  # no held-out sequences (tiny data): nothing to choose by
        return best, None
    if best is None or score >= best["score"]:  # ties: the later (longer-trained) weights
        best = {"step": step, "score": score, "heads": {k: v.detach().clone() for k, v in heads.state_dict().items()}}
    return best, [step, round(score, 4)]


def _medusa_loss(heads, lm_weight, hidden, labels):
    logits = heads.logits(hidden, lm_weight)  # [B, K, S]
    losses = []
    for i in range(labels.shape[1]):
        ok = labels[:, i] >= 0
        losses.append(F.cross_entropy(logits[ok, i], labels[ok, i]) if ok.any() else logits.sum() * 0)
    weights = torch.tensor([0.8 ** i for i in range(len(losses))])
    return (torch.stack(losses) * weights).sum() / weights.sum(), logits


def _eagle_loss(head, lm_weight, emb, feat, target, reg, labels, unroll: int = 1, weights=EAGLE_LOSS):
    """Pass m (0-based) row r predicts f_{r+m+1} and token r+m+2: compared with row r+m of the
    pass-1 targets; rows whose target lies past the sequence drop out with the shift. ``weights``: the
    feature and token terms' (EAGLE-3 drops the feature term: its head's output need not be a target
    feature, only a good input to the LM head and to the next step)."""
    feature_w, token_w = weights
    total, norm = 0.0, 0.0
    for m, out, tgt, ok_reg, lab in _aligned(head.unroll(emb, feat, unroll), target, reg, labels):
        loss = feature_w * F.smooth_l1_loss(out[ok_reg], tgt[ok_reg]) if ok_reg.any() else out.sum() * 0
        ok = lab >= 0
        if ok.any():
            loss = loss + token_w * F.cross_entropy(F.linear(out[ok], lm_weight), lab[ok])
        total, norm = total + 0.8 ** m * loss, norm + 0.8 ** m
    return total / norm


def _aligned(passes, *per_row):
    """(m, pass m's rows, each of ``per_row`` [B, T, ...] shifted to match) for m = 0, 1, ...: row r of pass
    m (0-based) predicts what row r + m of pass 1 does; the last m rows have nothing to predict."""
    for m, out in enumerate(passes):
        yield (m, out[:, : out.shape[1] - m], *(x[:, m:] for x in per_row))


@torch.no_grad()
def evaluate(kind, heads, lm_weight, batches, embed, max_len) -> dict:
    """Top-1 accuracy on the held-out sequences (teacher-forced): per Medusa head, or EAGLE's next token."""
    if kind == "medusa":
        index = batches.medusa_eval[:4096]
        if index.numel() == 0:
            return {}
        hidden, labels = batches.medusa(index)
        pred = heads.logits(hidden, lm_weight).argmax(-1)
        acc = [float((pred[:, i] == labels[:, i])[labels[:, i] >= 0].float().mean()) for i in range(labels.shape[1])]
        return {"heldout_top1": [round(a, 4) for a in acc]}
    seqs = batches.eval_seqs[:32]
    if seqs.numel() == 0:
        return {}
    emb, feat, target, reg, labels = batches.eagle(seqs, embed, max_len, torch.Generator().manual_seed(0))
    by_depth = []  # depth 1 on the real features; depth 2 on the head's own first prediction
    for _, out, lab in _aligned(heads.unroll(emb, feat, 2), labels):
        pred, ok = F.linear(out, lm_weight).argmax(-1), lab >= 0
        by_depth.append(round(float((pred[ok] == lab[ok]).float().mean()), 4) if ok.any() else None)
    return {"heldout_top1": by_depth[0], "heldout_top1_by_depth": by_depth}


def _coverage(data: DistillData, vocab) -> float:
    """The share of answer tokens inside the drafting vocabulary."""
    if vocab is None:
        return 1.0
    answers = data.answer_tokens()
    return round(float(torch.isin(answers, vocab).float().mean()), 4) if answers.numel() else 1.0


def save_checkpoint(path: Path, heads, optim, step: int, gen, settings, seconds: float = 0.0, best=None,
                    curve=()) -> None:
    """``seconds``: time spent in the training loop so far, over every run that led here; ``best`` and
    ``curve``: the held-out measurements so far (see :func:`_measure`)."""
    from ..models.cache import atomic_path

    with atomic_path(path) as tmp:
        torch.save({"heads": heads.state_dict(), "optim": optim.state_dict(), "step": step, "rng": gen.get_state(),
                    "settings": settings, "seconds": seconds, "best": best, "curve": list(curve)}, tmp)


def _diff(old, new) -> str:
    if not isinstance(old, dict):
        return "unreadable"
    keys = [k for k in {**old, **new} if old.get(k) != new.get(k)]  # a setting only one side has counts too
    return ", ".join(f"{k}: {old.get(k)!r} → {new.get(k)!r}" for k in keys) or "unknown"
