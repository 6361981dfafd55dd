"""The one module that edits a transformers KV cache (a DynamicCache of transformers 5.x layer objects): the target's
(the engine, which regeneration runs too, the cost profile) and a head's own draft cache (P-EAGLE's `select_columns`, the drafters'
`drop_tail`). A leaf: it imports only utils, so heads/, infer/ and train/ all edit caches through it.

Every layer holds keys / values [B, H, S, hd]; S runs along dim -2. What the engine does to them:
- one row (`generate`): `prepare_cache` once (sliding-window layers keep a whole tree until pruned), the tree's
  `tree_attention_mask`, then after the forward `keep_accepted` (prefix + accepted nodes; crop() only removes a
  tail, it cannot drop rejected siblings in between); `drop_tail` rewinds a tail (a drafter's own cache);
  `select_columns` keeps chosen columns (a head's draft cache);
- many rows (`generate_batch`): `buffered_cache` / `new_batch_cache`, whose layers write each forward
  in place into buffers with spare columns (BufferedLayer: a rejected or finished column is simply overwritten
  later, as gpt-fast's KVCache does); `keep_accepted_rows`, `merge_caches` (rows joining, right-padded),
  `select_rows` (rows leaving, columns cut), `cache_columns`.
A transformers release that changes the layers' internals is met here and nowhere else.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from specheads.utils import SpecheadsError


# ------------------------------------------------------------------------------------------------ one row
def prepare_cache(cache) -> None:
    """Make sliding-window layers keep every entry of a forward until `keep_accepted` prunes them."""
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_sliding", False) and hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()


def _written(layer) -> torch.Tensor | None:
    """A layer's keys [B, H, S, hd], or None before any forward wrote it."""
    if not getattr(layer, "is_initialized", True) or layer.keys is None or not layer.keys.numel():
        return None
    return layer.keys


def keep_accepted(cache, num_nodes: int, accepted_nodes: list[int] | torch.Tensor) -> None:
    """Drop the rejected tree nodes: each layer keeps its prefix entries and the accepted ones (node order kept).
    The prefix is never copied: accepted entries move down into the first free slots (nothing moves when they
    already are the first A nodes, e.g. an accepted chain prefix) and the layer becomes a view of the first
    prefix + A entries (the next forward's torch.cat copies it once, as it always does)."""
    acc = [int(i) for i in accepted_nodes]
    a = len(acc)
    moved = acc != list(range(a))
    index: dict[torch.device, torch.Tensor] = {}  # the accepted nodes' offsets, sent once per device
    for layer in cache.layers:
        if _written(layer) is None:
            continue
        n_old = layer.keys.shape[-2] - num_nodes
        if moved:  # [..., n_old + acc, :] is gathered (a copy) before it is written, so overlap is safe
            dev = layer.keys.device
            if dev not in index:
                index[dev] = torch.tensor(acc, device=dev)
            src = index[dev] + n_old
            layer.keys[..., n_old:n_old + a, :] = layer.keys.index_select(-2, src)
            layer.values[..., n_old:n_old + a, :] = layer.values.index_select(-2, src)
        layer.keys = layer.keys[..., :n_old + a, :]
        layer.values = layer.values[..., :n_old + a, :]
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length = layer.cumulative_length - num_nodes + a
            w = layer.sliding_window - 1  # entries a sliding layer needs for the next forward
            layer.keys = layer.keys[:, :, -w:, :]
            layer.values = layer.values[:, :, -w:, :]


def drop_tail(cache, n: int) -> None:
    """Remove the last `n` entries of every layer (a drafter's rejected draft rows, a profiled forward). Sliding
    layers keep transformers' own bookkeeping (their crop: window and cumulative length); n <= 0 changes nothing."""
    if n <= 0:
        return
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.crop(-n)
        elif _written(layer) is not None:
            layer.keys, layer.values = layer.keys[..., :-n, :], layer.values[..., :-n, :]


def select_columns(cache, keep: torch.Tensor) -> None:
    """Keep only the cached positions `keep` ([M] long, ascending, absolute cache columns) in every layer, in place:
    a head's own draft cache after a tree step (P-EAGLE keeps its true rows, dropping the parallel-drafting ones).
    Sliding-window layers are refused (their bookkeeping is not positional)."""
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("select_columns: sliding-window cache layers are not supported")
        if _written(layer) is not None:
            idx = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


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


# ------------------------------------------------------------------------------------------------ many rows
@functools.lru_cache(maxsize=None)
def buffered_layer_class():
    """Defined on first use (transformers is imported lazily); one class for every cache."""
    from transformers.cache_utils import DynamicLayer

    class BufferedLayer(DynamicLayer):
        """A DynamicLayer whose keys / values are views [:, :, :S] of buffers with GROW spare columns: a forward
        writes its columns in place. DynamicLayer's torch.cat copies the whole cache every step, which at 64
        rows x 600 columns (bf16, 2 cores) costs as much as the attention itself (16 vs 16 ms a layer). A layer
        whose keys were replaced (rows selected or merged) starts a new buffer on its next write; a cut tail
        (a view of the same buffer) is written over in place."""

        GROW = 64  # spare columns: one copy per 64 steps instead of one per step

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            L, n = (self.keys.shape[-2] if self.keys.numel() else 0), key_states.shape[-2]
            buf_k, buf_v = getattr(self, "buf_k", None), getattr(self, "buf_v", None)
            if (buf_k is None or L + n > buf_k.shape[-2] or buf_k.shape[:2] != key_states.shape[:2]
                    or (L and (self.keys.data_ptr() != buf_k.data_ptr() or self.keys.stride() != buf_k.stride()))):
                shape = list(key_states.shape)  # the cache was replaced (rows selected, merged, cut) or is full
                shape[-2] = L + n + self.GROW
                buf_k, buf_v = key_states.new_empty(shape), value_states.new_empty(shape)
                if L:
                    buf_k[:, :, :L], buf_v[:, :, :L] = self.keys, self.values
                self.buf_k, self.buf_v = buf_k, buf_v
            buf_k[:, :, L:L + n], buf_v[:, :, L:L + n] = key_states, value_states
            self.keys, self.values = buf_k[:, :, :L + n], buf_v[:, :, :L + n]
            return self.keys, self.values

    return BufferedLayer


def buffered_cache(model):
    """A DynamicCache for `model` whose plain layers write in place (BufferedLayer) -> (cache, mergeable). A model
    with sliding-window (or other non-plain) layers gets transformers' own layers and mergeable False: they keep
    only the last window, so rows of different lengths cannot share columns."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    if not all(type(x) is DynamicLayer for x in cache.layers):
        return cache, False
    layer_cls = buffered_layer_class()
    cache.layers = [layer_cls() for _ in cache.layers]
    return cache, True


def new_batch_cache(model):
    """The batched loop's cache (buffered_cache); sliding-window targets are refused, one clear error."""
    cache, mergeable = buffered_cache(model)
    if not mergeable:
        raise SpecheadsError("generate_batch: the target has sliding-window (or other non-plain) cache layers; "
                             "batched generation needs full-attention layers (use generate, one prompt at a time)")
    return cache


def cache_columns(cache) -> int:
    """Columns S of the batch cache (0 before any forward)."""
    keys = _written(cache.layers[0])
    return 0 if keys is None else int(keys.shape[2])


def keep_accepted_rows(cache, cols: int, lengths: Sequence[int], accepted: Sequence[Sequence[int]]) -> list[int]:
    """After a forward of N nodes over `cols` columns, keep each row's accepted nodes (indices, root first): row r's
    node accepted[r][j] moves from column cols + accepted[r][j] down to length_r + j (gathered before it is
    written, so overlaps are safe), then every layer is cut to the longest row. Returns the rows' new lengths."""
    B = len(lengths)
    a_max = max(len(a) for a in accepted)
    src = torch.tensor([[cols + a[min(j, len(a) - 1)] for j in range(a_max)] for a in accepted])  # [B, A]
    dst = torch.tensor([[length + min(j, len(a) - 1) for j in range(a_max)] for length, a in zip(lengths, accepted)])
    new = [length + len(a) for length, a in zip(lengths, accepted)]  # short rows repeat their last pair: same value
    moved = not torch.equal(src, dst)
    rows = torch.arange(B)[:, None]
    index: dict[torch.device, tuple] = {}  # (rows, src, dst) sent once per device
    for layer in cache.layers:
        keys, values = layer.keys, layer.values  # [B, H, cols + N, hd]
        if moved:
            if keys.device not in index:
                index[keys.device] = tuple(x.to(keys.device) for x in (rows, src, dst))
            r, s, d = index[keys.device]
            keys[r, :, d] = keys[r, :, s]  # [B, A, H, hd] gathered (a copy), then written
            values[r, :, d] = values[r, :, s]
        layer.keys, layer.values = keys[:, :, :max(new)], values[:, :, :max(new)]
    return new


def _pad_columns(x: torch.Tensor, cols: int) -> torch.Tensor:
    """x [b, H, S, hd] padded with zeros on the right to `cols` columns."""
    n = cols - x.shape[2]
    if n == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:2], n, x.shape[3])], dim=2)


def merge_caches(live, fresh, live_rows: int, fresh_rows: int) -> None:
    """Append `fresh`'s rows below `live`'s (in place in `live`), both padded with zeros on the right to the longer
    one's columns (the batched loop's rows are left-aligned: nothing moves, the masks hide the padding). A layer no
    forward has written yet (prompts of one token) counts as 0 columns."""
    for a, b in zip(live.layers, fresh.layers):
        ka, kb = _written(a), _written(b)
        if ka is None and kb is None:
            continue
        like = ka if ka is not None else kb  # [rows, H, cols, hd]
        cols = max(x.shape[2] for x in (ka, kb) if x is not None)

        def padded(layer, x, rows: int, values: bool) -> torch.Tensor:
            if x is None:
                return like.new_zeros(rows, like.shape[1], cols, like.shape[3])
            return _pad_columns(layer.values if values else x, cols)

        keys = torch.cat([padded(a, ka, live_rows, False), padded(b, kb, fresh_rows, False)])
        values = torch.cat([padded(a, ka, live_rows, True), padded(b, kb, fresh_rows, True)])
        if ka is None:
            a.lazy_initialization(keys, values)
        a.keys, a.values = keys, values


def select_rows(cache, keep: Sequence[int], stop: int | None = None) -> None:
    """Keep the rows `keep` (batch indices, in order; one copy) and the columns [0, stop) (a view): the batched
    loop cuts to its longest kept row."""
    for layer in cache.layers:
        if _written(layer) is None:
            continue
        sel = torch.as_tensor(keep, dtype=torch.long, device=layer.keys.device)
        layer.keys = layer.keys.index_select(0, sel)[:, :, :stop]
        layer.values = layer.values.index_select(0, sel)[:, :, :stop]
