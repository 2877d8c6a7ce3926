"""An independent draft model that shares the target's tokenizer, with its own KV cache.

Each proposal feeds the committed tokens the draft model has not seen yet (the whole prompt at the
first round, then one or two tokens), then drafts k tokens autoregressively, each drawn from the
draft's logits warped exactly like the target's (Sampling), whose rows are returned as p_draft.
After the verdict its cache is rolled back to the accepted prefix.
"""

from __future__ import annotations

import torch

from ..errors import SpeculateError
from ..models.kv import KVModel, PrefixReuse
from ..sampling import warp
from ..verifiers.base import sample_from
from .base import Draft, Drafter


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, draft_model, target_model=None):
        if target_model is not None:
            check_same_tokenizer(draft_model.tokenizer, target_model.tokenizer)
        self.model = draft_model  # read by --k auto for the draft's cost ratio c
        self.kv = KVModel(draft_model)
        self.held = PrefixReuse()

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.held.start(self.kv, prompt_ids, len(prompt_ids) + 256, self.reuse_prefix)

    def relative_cost(self):
        return None  # measured with the target: the draft model's forwards have their own fixed costs

    @torch.inference_mode()
    def propose(self, tokens, k):
        self.base = len(tokens)  # update() keeps the cache up to here plus what it accepts
        self.held.follow(tokens)  # the cache holds a prefix of these (the engine's list, kept growing)
        if k == 0:  # the budget's last token: nothing to draft (update keeps the cache as it is)
            return Draft(torch.empty(0, dtype=torch.long))
        unseen = torch.tensor(tokens[self.kv.length:], dtype=torch.long)
        drafted, rows = [], []
        for i in range(k):
            logits = self.kv.forward(unseen, last=1)[-1:]
            probs = warp(logits, self.sampling)
            token = (probs.argmax(-1) if self.sampling.greedy
                     else torch.tensor([sample_from(probs[0], self.generator)]))
            drafted.append(token)
            rows.append(probs)
            unseen = token
        # The last drafted token was never fed: the cache holds prefix + first k-1 drafts.
        return Draft(torch.cat(drafted), torch.cat(rows))

    def update(self, n_accepted, next_token):
        # Keep the prefix and the accepted drafts that are in the cache (at most k-1 of them).
        self.kv.keep(min(self.kv.length, self.base + n_accepted))


def check_same_tokenizer(draft_tok, target_tok) -> None:
    """Refuse a draft model whose tokenizer maps text to other ids: its drafts would be nonsense."""
    if draft_tok.get_vocab() != target_tok.get_vocab() or draft_tok.all_special_ids != target_tok.all_special_ids:
        raise SpeculateError("the draft model's tokenizer differs from the target's; a draft model must share "
                             "the target's tokenizer")
