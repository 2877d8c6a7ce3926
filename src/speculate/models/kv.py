"""One model with its KV cache, addressed by position.

The cache holds the keys/values of positions 0..length-1. A forward writes the new tokens' entries at
the next positions; rolling back is forgetting positions (``keep``), not copying tensors. A *tree* of
drafts goes through the same forward with explicit position ids and an ancestor mask, and
``keep_path`` then keeps only the accepted branch. This file and ``fast.py`` (a lean path for
Llama-family models) are the only places that know how a model takes caches, masks and positions.
"""

from __future__ import annotations

import torch

from ..tree_shape import depths_and_ancestors
from .forward import Rows
from .loader import LoadedModel


def KVModel(loaded: LoadedModel, fast: bool = True):
    """The model with a KV cache: the lean Llama-family path (models/fast.py) where it applies, else
    the generic Hugging Face path. Both have reset / forward / keep / keep_path and equal logits."""
    from . import fast as fast_path

    if fast and fast_path.supports(loaded.model):
        return fast_path.FastKVModel(loaded)
    return HFKVModel(loaded)


def forward_many(items: list[Rows]) -> list[torch.Tensor | None]:
    """Each item's logits (``Rows.want``), computed in as few forwards as possible: the items whose caches belong
    to one lean model (the same loaded weights) share ONE forward (``LeanModel.forward_many``: linear layers
    and LM head once over all rows, attention per cache); the Hugging Face path runs each item alone."""
    from .fast import FastKVModel

    out: list = [None] * len(items)
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        key = id(item.kv.lean) if isinstance(item.kv, FastKVModel) else id(item.kv)
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        group = [items[i] for i in members]
        for i, logits in zip(members, group[0].kv.forward_many(group)):
            out[i] = logits
    return out


def position_bytes(loaded: LoadedModel) -> int:
    """Bytes of KV cache one position takes in :func:`KVModel`'s cache for ``loaded`` (keys and values, every layer):
    what the server's --kv-memory admission counts per token."""
    from . import fast as fast_path

    model, cfg = loaded.model, loaded.model.config
    layers, n_kv = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if fast_path.supports(model):
        _, _, attention, dtype = fast_path.cache_layout(model)
        head_dim += attention == "integer"  # (its scale column)
    else:
        dtype = model.dtype
    return layers * n_kv * head_dim * 2 * torch.empty((), dtype=dtype).element_size()


class HFKVModel:
    shares_prefixes = True  # (models/prefix_store.py: blocks copied out and in, export_block / import_block)

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.model.config
        self.vocab_size = int(self.model.get_output_embeddings().out_features)
        self.cache = None
        self.length = 0
        self.hidden = None  # after each forward: final-normed hidden rows [n_new, H] (the LM head's input)
        self.taps: tuple[int, ...] = ()  # decoder layers whose outputs follow them in ``hidden`` (EAGLE-3)
        self._mask_min = torch.finfo(self.model.dtype).min

    @property
    def nbytes(self) -> int:
        """Bytes of the cache held."""
        layers = self.cache.layers if self.cache is not None else ()
        return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if t is not None)

    @property
    def own_bytes(self) -> int:
        """(Every row is its own: blocks taken from the prefix store are copied in.)"""
        return self.nbytes

    def ensure(self, positions: int) -> None:
        """(A DynamicCache grows by each forward's rows: nothing to allocate ahead.)"""

    def reset(self, capacity: int = 0) -> None:
        """Start a new generation, the cache empty."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last: int = 0, tree_parents: list[int] | None = None) -> torch.Tensor:
        """Run ``tokens`` ([n] LongTensor) at positions length..length+n-1 and append their KV.

        Returns fp32 logits [rows, V]: every row when ``last`` is 0, else only the last ``last`` rows
        (prefill needs one row; the LM head over a whole prompt would cost more than the layers).

        ``tree_parents``: for a flattened draft tree, the index (into ``tokens``) of each node's parent,
        -1 for a child of the cached prefix. Node i then sits at position length + depth(i) - 1 (depth 1 for a
        child of the prefix, ``tree_shape.depths``) and attends to the prefix and to its ancestors only.
        """
        n = tokens.shape[0]
        kwargs = {}
        if tree_parents is None:
            positions = torch.arange(self.length, self.length + n)
        else:
            depth, allowed = depths_and_ancestors(tree_parents)
            positions = self.length + depth - 1  # (depth 1: a child of the cached prefix)
            mask = torch.zeros(1, 1, n, self.length + n, dtype=self.model.dtype)
            mask[0, 0, :, self.length:].masked_fill_(~allowed, self._mask_min)
            kwargs["attention_mask"] = mask
        out = self.model(
            input_ids=tokens[None], position_ids=positions[None], cache=self.cache, use_cache=True,
            logits_to_keep=last, output_hidden_states=True, **kwargs,
        )
        self.length += n
        # transformers 5: the last entry is the final-normed one; entry i + 1 is decoder layer i's output.
        self.hidden = out.hidden_states[-1][0]
        if self.taps:
            self.hidden = torch.cat([self.hidden, *(out.hidden_states[i + 1][0] for i in self.taps)], dim=-1)
        return out.logits[0].float()

    def forward_many(self, items: list[Rows]) -> list[torch.Tensor | None]:
        """:func:`forward_many` for this cache's items: one forward each (no batching on this path)."""
        out = []
        for item in items:
            logits = self.forward(item.tokens, last=1 if item.want == 0 else item.want or 0,
                                  tree_parents=item.tree_parents)
            out.append(None if item.want == 0 else logits)
        return out

    def keep(self, n_positions: int) -> None:
        """Forget every position >= n_positions (roll back rejected drafts)."""
        if n_positions < self.length:
            self.cache.crop(n_positions - self.length)  # transformers 5: a negative count to drop
            self.length = n_positions

    def keep_path(self, start: int, nodes: list[int]) -> None:
        """After a tree forward that began at position ``start``: keep the prefix and the KV of the
        accepted ``nodes`` (indices into that forward's tokens, root to leaf), in order."""
        index = torch.cat([torch.arange(start), start + torch.tensor(nodes, dtype=torch.long)])
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        self.length = start + len(nodes)

    def rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of positions start..start+n-1: keys and values [layers, kv heads, n, head dim]."""
        layers = self.cache.layers
        return (torch.stack([layer.keys[0, :, start: start + n] for layer in layers]),
                torch.stack([layer.values[0, :, start: start + n] for layer in layers]))

    def export_block(self, start: int, n: int):
        """Positions start..start+n-1, copied out for the prefix store (models/prefix_store.py)."""
        from .paged import CopiedBlock

        return CopiedBlock(*self.rows(start, n))

    def import_block(self, start: int, block, n: int | None = None) -> None:
        """:meth:`export_block`'s rows at positions start.. (its first ``n`` only, where given). A DynamicCache grows
        by appending: what it holds past ``start`` is dropped first, and blocks come in order."""
        if self.cache is None:
            self.reset()
        self.keep(start)
        n = block.values.shape[2] if n is None else n
        for i, (keys, values) in enumerate(zip(block.keys, block.values)):
            self.cache.update(keys[None, :, :n], values[None, :, :n], i)
        self.length = start + n
