"""CUDA graphs of the owned forward's decode and verify steps (gpt-fast's "reduce-overhead" idea, written out): on a
GPU a one-token step of a ~1B target is a few hundred small kernel launches whose CPU-side cost exceeds the work;
a captured graph replays them with one launch.

A graph fixes every shape and address, so the captured step differs from `OwnedLlama.forward` in three ways:
- n tokens are padded to a bucket (BUCKETS); pad rows attend to column 0 only and their outputs are dropped;
- attention reads the whole cache capacity C under a boolean mask [nb, C] (columns not yet written are masked out),
  instead of the first S + n columns;
- the cache columns, positions and mask are tensors copied into static buffers before each replay, and the keys /
  values are written with `index_copy_` at those columns.
The equations are the owned forward's (its `_rms`, `_rope`, `_mlp_unit`, HF's operation order); masked columns
add exact zeros, so fp32 greedy outputs equal HF's (the device check tests it, docs/gpu.md).

Shapes: nb bucket rows, C cache capacity, G key/value heads, H query heads, hd head dim, D hidden, V vocab.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from specheads.infer.engine.owned import OwnedLlama

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # tree sizes captured (a step of more nodes runs eagerly)
ROUND = 256  # cache capacity is rounded up to a multiple of this, so one capture serves requests of similar length


def bucket(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


class _Graph:
    """One captured step: nb rows, the feature `layers` asked for, the logit rows kept ("last" computes every row's
    logits and returns row n - 1: the bucket's last row is padding)."""

    @torch.inference_mode(False)  # normal tensors: the buffers are written whether or not a caller is in inference mode
    def __init__(self, m: OwnedLlama, nb: int, layers: tuple[int, ...], logit_rows: str):
        dev, C = m.device, m.k.shape[2]
        self.m, self.nb, self.layers, self.logit_rows = m, nb, layers, logit_rows
        self.tokens = torch.zeros(nb, dtype=torch.long, device=dev)
        self.positions = torch.zeros(nb, dtype=torch.long, device=dev)
        # warm-up and capture run the step on these buffers: its keys / values go to the cache's last nb columns,
        # free scratch (a step runs here only when length + nb fits below them), never the kept columns
        self.cols = torch.arange(C - nb, C, device=dev)
        self.mask = torch.zeros(nb, C, dtype=torch.bool, device=dev)
        self.mask[:, 0] = True
        self.graph = None
        if dev.type != "cuda":  # no capture: the static step runs eagerly (tests check its equations on a CPU),
            self._step()  # after the same warm-up write
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream (cuBLAS workspaces, SDPA's choice)
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()

    @torch.no_grad()
    def _step(self):
        """The static-shape forward -> (logits [nb | 1, V] | None, features [nb, F D] | None)."""
        m = self.m
        x = F.embedding(self.tokens, m.embed)  # [nb, D]
        cos, sin = m.cos.index_select(0, self.positions), m.sin.index_select(0, self.positions)  # [nb, hd]
        want = set(self.layers)
        states = {0: x.clone()} if 0 in want else {}
        mask = self.mask[None, None]  # [1, 1, nb, C]
        nb, H, G, hd = self.nb, m.H, m.G, m.hd
        for i, lay in enumerate(m.layers):
            qkv = F.linear(m._rms(x, lay.ln_in), lay.qkv, lay.qkv_bias)  # [nb, (H + 2G) hd]
            q, k, v = qkv.split((H * hd, G * hd, G * hd), dim=-1)
            q, k, v = q.view(nb, H, hd), k.view(nb, G, hd), v.view(nb, G, hd)
            if lay.q_norm is not None:
                q, k = m._rms(q, lay.q_norm), m._rms(k, lay.k_norm)
            q = m._rope(q.transpose(0, 1), cos, sin).to(m.cache_dtype)  # [H, nb, hd]
            m.k[i].index_copy_(1, self.cols, m._rope(k.transpose(0, 1), cos, sin).to(m.cache_dtype))
            m.v[i].index_copy_(1, self.cols, v.transpose(0, 1).to(m.cache_dtype))
            o = F.scaled_dot_product_attention(q[None], m.k[i][None], m.v[i][None], attn_mask=mask,
                                               scale=hd ** -0.5, enable_gqa=G != H)  # [1, H, nb, hd]
            x = x + F.linear(o[0].transpose(0, 1).reshape(nb, H * hd).to(m.dtype), lay.o)
            x = m._mlp_unit(lay, x)
            if i + 1 in want and i + 1 < len(m.layers):
                states[i + 1] = x
        x = m._rms(x, m.norm)
        states[len(m.layers)] = x
        feats = torch.cat([states[l] for l in self.layers], dim=-1) if self.layers else None
        if self.logit_rows == "none":
            return None, feats
        return F.linear(x, m.lm_head), feats  # every row: "last" is row n - 1, not the bucket's last

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None):
        """tokens [n], positions [n], allowed [n, n] (None: causal) written at columns [length, length + n)."""
        m, n, start = self.m, tokens.numel(), self.m.length
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.cols.copy_(torch.arange(start, start + self.nb, device=m.device))  # pad rows: the columns after
        self.mask.zero_()
        self.mask[:n, :start] = True
        self.mask[:n, start:start + n] = (allowed if allowed is not None else
                                          torch.ones(n, n, dtype=torch.bool, device=m.device).tril())
        self.mask[n:, 0] = True
        if self.graph is None:
            self.out = self._step()
        else:
            self.graph.replay()
        logits, feats = self.out  # the graph's own memory, written over by the next replay: copies go out
        if logits is not None:
            logits = (logits[n - 1:n] if self.logit_rows == "last" else logits[:n]).clone()
        return logits, (feats[:n].clone() if feats is not None else None)


class GraphedOwned:
    """OwnedLlama's forward through captured graphs where the step fits a bucket; prefill and larger trees eager.
    Captures are dropped when the cache is reallocated (its address is part of the graph)."""

    def __init__(self, m: OwnedLlama):
        self.m = m
        self.graphs: dict[tuple, _Graph] = {}
        self._cache_ptr = None

    def reset(self, capacity: int) -> None:
        need = -(-(capacity + BUCKETS[-1]) // ROUND) * ROUND  # pad rows write up to a bucket past the tree
        self.m.reset(need)  # the RoPE table too: no graph's positions outgrow it

    def forward(self, tokens, positions, allowed, layers=None, logit_rows="all"):
        m, n = self.m, tokens.numel()
        nb = bucket(n)
        if nb is None or m.length == 0 or m.length + nb > m.k.shape[2]:
            return m.forward(tokens, positions, allowed, layers, logit_rows)  # eager (may grow the cache)
        ptrs = (m.k.data_ptr(), m.v.data_ptr(), m.cos.data_ptr())
        if self._cache_ptr != ptrs:  # a captured graph reads these addresses
            self.graphs.clear()
            self._cache_ptr = ptrs
        key = (nb, tuple(layers or ()), logit_rows)
        g = self.graphs.get(key)
        if g is None:
            log.info("capturing a CUDA graph of the target step: %d rows, layers %s, logits %s", *key)
            g = self.graphs[key] = _Graph(m, *key)
        return g.run(tokens.to(m.device), positions.to(m.device), None if allowed is None else allowed.to(m.device))
