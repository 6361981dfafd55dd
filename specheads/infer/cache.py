"""Keep the cached prefix plus the accepted tree nodes in an HF DynamicCache (transformers 5.x layer objects).

After a tree forward every layer holds [prefix | N tree nodes] along the sequence dim (-2). `keep_accepted`
selects prefix + accepted nodes there (crop() only removes a tail, it cannot drop rejected siblings in between).
Sliding-window layers (Gemma 3 style) keep `cumulative_length` and hold at most window - 1 past entries: call
`prepare_cache(cache)` once before the first tree forward so they keep the full tree until pruned.
"""
from __future__ import annotations

import torch

from specheads.utils import SpecheadsError


def prepare_cache(cache) -> None:
    """Make sliding-window layers keep every entry of a forward until `keep_accepted` prunes them."""
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_sliding", False) and hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()


def keep_accepted(cache, num_nodes: int, accepted_nodes: list[int] | torch.Tensor) -> None:
    """Drop the rejected tree nodes: each layer keeps its prefix entries and the accepted ones (node order kept).
    The prefix is never copied: accepted entries move down into the first free slots (nothing moves when they
    already are the first A nodes, e.g. an accepted chain prefix) and the layer becomes a view of the first
    prefix + A entries (the next forward's torch.cat copies it once, as it always does)."""
    acc = [int(i) for i in accepted_nodes]
    a = len(acc)
    moved = acc != list(range(a))
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        n_old = layer.keys.shape[-2] - num_nodes
        if moved:  # [..., n_old + acc, :] is gathered (a copy) before it is written, so overlap is safe
            src = torch.tensor(acc, device=layer.keys.device) + n_old
            layer.keys[..., n_old:n_old + a, :] = layer.keys.index_select(-2, src)
            layer.values[..., n_old:n_old + a, :] = layer.values.index_select(-2, src)
        layer.keys = layer.keys[..., :n_old + a, :]
        layer.values = layer.values[..., :n_old + a, :]
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = layer.cumulative_length - num_nodes + a
            w = layer.sliding_window - 1  # entries a sliding layer needs for the next forward
            layer.keys = layer.keys[:, :, -w:, :]
            layer.values = layer.values[:, :, -w:, :]


def cache_len(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def tree_attention_mask(tree, cache, cache_len: int, dtype: torch.dtype, device=None):
    """The 4D float mask(s) for one tree forward over `cache`. Full-attention layers: tree.attention_mask
    [1,1,N,cache_len+N]. Sliding-window layers attend their last window-1 cached entries (what the layer returns)
    and only keys less than `sliding_window` positions back: [1,1,N,k+N]. A model with both layer types gets
    {"full_attention": ..., "sliding_attention": ...} (the transformers convention), one with only sliding layers
    gets the sliding mask."""
    full = tree.attention_mask(cache_len, dtype=dtype, device=device)
    sliding = [l for l in getattr(cache, "layers", []) if getattr(l, "is_sliding", False)]
    if not sliding:
        return full
    w = int(sliding[0].sliding_window)
    k_old = 0 if sliding[0].keys is None or not sliding[0].is_initialized else int(sliding[0].keys.shape[-2])
    k = min(k_old, w - 1, cache_len)  # cached entries the layer hands to attention
    d = tree.depth[:, None]  # [N, 1]
    j = torch.arange(k)[None]  # [1, k]: cached entry j sits at position cache_len - k + j
    near = (d + k - j) < w  # query position - key position < window
    allowed = torch.cat([near, tree.ancestors() & ((d - tree.depth[None]) < w)], dim=1)  # [N, k+N]
    sl = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))[None, None]
    sl = sl.to(device) if device is not None else sl
    if len(sliding) == len(cache.layers):
        return sl
    return {"full_attention": full, "sliding_attention": sl}


def new_batch_cache(model):
    """A DynamicCache whose layers write each forward in place (regeneration's BufferedLayer: spare columns, no
    copy of the whole cache per step). Sliding-window layers are refused: they keep only their window, so rows of
    different lengths cannot share columns."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from specheads.train.regenerate import _buffered_layer_class

    cache = DynamicCache(config=model.config)
    if not all(type(x) is DynamicLayer for x in cache.layers):
        raise SpecheadsError("generate_batch: the target has sliding-window (or other non-plain) cache layers; "
                             "batched generation needs full-attention layers (use generate, one prompt at a time)")
    cache.layers = [_buffered_layer_class()() for _ in cache.layers]
    return cache
