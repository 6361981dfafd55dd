"""An owned forward of Llama-family targets over a static KV cache (gpt-fast style): the decode step without
transformers' per-call machinery (mask builders, cache objects, output dataclasses, hooks).

Families: `llama` (SmolLM2, Llama 2/3), `mistral` (no sliding window set), `qwen2` (q/k/v biases) and `qwen3` (per-head
q/k RMSNorm). Every other architecture, a sliding window, or a RoPE type other than default / linear / llama3 runs the
HF forward (`engine/runner.py HFRunner`), and `owned_reason` says why.

The equations are HF's own, in HF's operation order (fp32 results match HF's forward to rounding noise; the tests
compare logits and greedy outputs):
    x_0 = E[t]                                   (Gemma-style embedding scale: not a supported family)
    a = x + W_o attn(rope(W_q n(x)), rope(W_k n(x)), W_v n(x))      n = RMSNorm, weight * x / sqrt(mean(x^2) + eps)
    x' = a + W_down(silu(W_gate n(a)) * W_up n(a))
    logits = W_lm n_final(x_L)
The weights are the HF model's own tensors: q/k/v and gate/up are concatenated once into fused matrices and the HF
modules' parameters become views of them, so memory is not doubled and the HF forward (profiling, batched decoding,
heads that read the embedding) sees the same numbers.

Self-speculative drafts (drafters/self_spec.py) run the same weights with a `SkipSet` of sublayers left out
(`OwnedLlama.draft`), over the same cache: they read the kept columns the full passes wrote and write their own keys
/ values only at columns >= `length`, which the next full forward writes over before it reads them.

Shapes: n tokens of one forward, S cached columns, C cache capacity, H query heads, G key/value heads, hd head dim,
D hidden, V vocab (V' a draft's vocabulary rows), L layers.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specheads.infer.engine import kernels
from specheads.utils import SpecheadsError

log = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
PREFILL_ROWS = 64  # bf16 kernels: forwards of more token rows (prefill) attend with PyTorch's SDPA, not attend_bf16  # position-independent inverse frequencies: a table is exact


def owned_reason(model) -> str:
    """Why the owned forward cannot run `model` ("" = it can)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "")
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not one of the owned families ({', '.join(FAMILIES)})"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind == "mistral"):
        return "sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ROPE_TYPES:
        return f"RoPE type {rope_type!r}"
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return "an MLP other than SwiGLU without bias"
    if getattr(cfg, "attention_bias", False) and kind != "qwen2":
        return "attention biases"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:  # target.device_map split it: the owned forward keeps every weight on one device
        return f"split across {len(devices)} devices (target.device_map): the HF forward runs it"
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    for layer in getattr(dec, "layers", None) or []:  # adapters (peft LoRA) or hooks change what a module computes
        mods = [getattr(layer.self_attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        mods += [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not torch.nn.Linear or m._forward_hooks or m._forward_pre_hooks for m in mods):
            return "a projection that is not a plain Linear (adapters or hooks)"
    return ""


@dataclass
class _Layer:
    ln_in: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2G) hd, D]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [hd] (qwen3)
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [D, H hd]
    ln_post: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2 I, D]
    down: torch.Tensor  # [D, I]


def _fuse(mods: list[torch.nn.Linear]) -> torch.Tensor:
    """One [sum out, in] matrix; each module's weight becomes a view of its rows (no second copy kept)."""
    fused = torch.cat([m.weight.data for m in mods], dim=0)
    row = 0
    for m in mods:
        rows = m.weight.shape[0]
        m.weight.data = fused[row:row + rows]
        row += rows
    return fused


def _fuse_bias(mods: list[torch.nn.Linear]) -> torch.Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    fused = torch.cat([m.bias.data for m in mods])
    row = 0
    for m in mods:
        m.bias.data = fused[row:row + m.bias.shape[0]]
        row += m.bias.shape[0]
    return fused


@dataclass(frozen=True)
class SkipSet:
    """The sublayers a self-speculative draft pass leaves out: the attention of decoder layers `attn` and the MLP of
    layers `mlp` (0-based). Text (`--skip-layers`): comma-separated `I` (both sublayers of layer I), `aI` (its
    attention), `mI` (its MLP), each also as a range `I-J`, `aI-J`, `mI-J`; "none" skips nothing."""

    attn: frozenset = frozenset()
    mlp: frozenset = frozenset()

    @classmethod
    def parse(cls, text: str, num_layers: int, flag: str = "--skip-layers") -> "SkipSet":
        raw = str(text).strip()
        attn: set[int] = set()
        mlp: set[int] = set()
        for item in ([] if raw in ("", "none") else raw.split(",")):
            item = item.strip()
            kind, body = (item[0], item[1:]) if item[:1] in ("a", "m") else ("", item)
            lo, sep, hi = body.partition("-")
            if not lo.isdigit() or (sep and not hi.isdigit()):
                raise SpecheadsError(f"{flag} {raw}: {item!r} is not I, aI, mI or a range I-J (layers 0.."
                                     f"{num_layers - 1}; e.g. m4-12,a9,20)")
            first, last = int(lo), int(hi) if sep else int(lo)
            if not 0 <= first <= last < num_layers:
                raise SpecheadsError(f"{flag} {raw}: {item!r} is outside the target's layers 0..{num_layers - 1}")
            span = range(first, last + 1)
            if kind != "m":
                attn.update(span)
            if kind != "a":
                mlp.update(span)
        if len(attn) == len(mlp) == num_layers:
            raise SpecheadsError(f"{flag} {raw}: skips every sublayer (the draft would be the embedding alone)")
        return cls(frozenset(attn), frozenset(mlp))

    def text(self) -> str:
        """The canonical text: whole layers first as ranges, then attention-only and MLP-only runs."""
        both = self.attn & self.mlp
        parts = [_runs(both, "")] + [_runs(s - both, k) for s, k in ((self.attn, "a"), (self.mlp, "m"))]
        return ",".join(p for p in parts if p) or "none"

    def units(self, num_layers: int) -> tuple[tuple[int, bool], ...]:
        """The kept sublayers in forward order: (layer, True = attention / False = MLP)."""
        return tuple((i, a) for i in range(num_layers) for a in (True, False)
                     if i not in (self.attn if a else self.mlp))

    def __len__(self) -> int:
        return len(self.attn) + len(self.mlp)


@functools.lru_cache(maxsize=64)
def _kept(skip: SkipSet, num_layers: int) -> tuple[tuple[int, bool], ...]:
    return skip.units(num_layers)  # once per set, not once per draft pass


def _runs(ids, prefix: str) -> str:
    out, ids = [], sorted(ids)
    while ids:
        j = 0
        while j + 1 < len(ids) and ids[j + 1] == ids[0] + j + 1:
            j += 1
        out.append(f"{prefix}{ids[0]}" + (f"-{ids[j]}" if j else ""))
        ids = ids[j + 1:]
    return ",".join(out)


class OwnedLlama:
    """The fused weights, the RoPE table and the static cache of one target; one request at a time.

    cache: k, v [L, G, C, hd]; columns [0, length) hold the kept sequence, a forward writes its n tokens at
    [length, length + n) and `keep` moves the accepted ones down (rejected columns are simply written over later)."""

    def __init__(self, model, use_kernels: bool = True):
        cfg = model.config
        dec = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.eps = float(cfg.rms_norm_eps)
        self.H, self.G = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H)
        self.embed = dec.embed_tokens.weight
        self.norm = dec.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        self.rotary = dec.rotary_emb
        self.layers = []
        for layer in dec.layers:
            at, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight, _fuse([at.q_proj, at.k_proj, at.v_proj]),
                _fuse_bias([at.q_proj, at.k_proj, at.v_proj]),
                getattr(getattr(at, "q_norm", None), "weight", None), getattr(getattr(at, "k_norm", None), "weight", None),
                at.o_proj.weight, layer.post_attention_layernorm.weight, _fuse([mlp.gate_proj, mlp.up_proj]),
                mlp.down_proj.weight))
        self.dtype, self.device = self.embed.dtype, self.embed.device
        weights = [self.lm_head] + [w for lay in self.layers for w in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        self.ops = kernels.bf16_ops() if use_kernels and all(kernels.usable(w) for w in weights) else None  # bf16 +
        # AVX512-BF16 (use_kernels False: --compile off, PyTorch's ops only)
        self.kernel = None if self.ops is None else self.ops.linear_bf16
        self.fused = self.ops is not None and self.hd % 16 == 0 and self.hd <= 1024 and all(
            lay.q_norm is None and lay.ln_in.numel() % 16 == 0 and lay.down.shape[1] % 16 == 0
            for lay in self.layers)
        # the whole stack in one compiled call (kernels.stack_bf16) where no layer has a q/k/v bias: 10 tensors
        # a layer, the last one the norm that follows it
        nxt = [lay.ln_in for lay in self.layers[1:]] + [self.norm]
        # the decode step's matrices in the kernels' packed layout (a second copy, made where it fits; prefill rows
        # keep the row-major ones): None where any is missing
        self.packed = {id(w): kernels.packed(w) for w in weights} if self.ops is not None else {}
        mats = lambda lay: (lay.qkv, lay.o, lay.gate_up, lay.down)  # noqa: E731
        whole = self.fused and all(lay.qkv_bias is None for lay in self.layers) and all(
            p is not None for p in self.packed.values())
        self._flat = [t for lay, after in zip(self.layers, nxt)
                      for t in (*mats(lay), *(self.packed[id(w)] for w in mats(lay)), lay.ln_post, after)] \
            if whole else None
        # the cache and the attention run in fp32 on a CPU: PyTorch's bf16 attention for one query row costs 9x its
        # fp32 one (372 vs 43 us a layer over 300 keys, one thread), and the cache is small beside the weights
        self.cache_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        self.k = self.v = None
        self.cos = self.sin = torch.empty(0)
        self.length = 0

    # ------------------------------------------------------------------------------------------------ cache
    @torch.inference_mode(False)  # normal tensors: written in place whether or not a caller is in inference mode
    def reset(self, capacity: int) -> None:
        """An empty cache with room for `capacity` columns (kept from the last request when it is large enough)."""
        self.length = 0
        if self.k is None or self.k.shape[2] < capacity:
            self.k = self.v = None  # the old cache's memory is free for the new one
            self.k, self.v = self._columns(capacity), self._columns(capacity)
        self._rope_table(capacity)

    def _columns(self, capacity: int) -> torch.Tensor:
        """A zero key or value cache [L, G, capacity, hd]; an allocation that fails is one SpecheadsError that says
        how large the cache was to be (never the allocator's message from deep inside a step)."""
        shape = (len(self.layers), self.G, capacity, self.hd)
        try:
            return torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        except (RuntimeError, OverflowError) as e:  # torch.OutOfMemoryError is a RuntimeError
            gib = 2 * len(self.layers) * self.G * capacity * self.hd * self.cache_dtype.itemsize / 2 ** 30
            raise SpecheadsError(f"the target's KV cache cannot hold {capacity} columns ({gib:.1f} GiB of keys and "
                                 f"values on {self.device}): {str(e).splitlines()[0][:120]}; lower --max-new-tokens "
                                 "or shorten the prompt") from None

    @torch.inference_mode(False)
    def _grow(self, need: int, upto: int | None = None) -> None:
        """Room for `need` columns; columns [0, upto) are copied over (default the kept ones: a draft pass also
        keeps its step's earlier draft columns)."""
        cap = self.k.shape[2]
        if need <= cap:
            return
        new, upto = max(need, 2 * cap), self.length if upto is None else upto
        for name in ("k", "v"):
            old = getattr(self, name)
            buf = self._columns(new)
            buf[:, :, :upto] = old[:, :, :upto]
            setattr(self, name, buf)

    def _rope_table(self, positions: int) -> None:
        """cos / sin [P, hd] for positions 0..P-1, computed by the model's own rotary module (its inv_freq and
        attention scaling), in the model's dtype as HF applies them."""
        if self.cos.shape[0] >= positions:
            return
        pos = torch.arange(max(positions, 2 * self.cos.shape[0]), device=self.device)[None]
        x = torch.empty(1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(x, pos)
        self.cos, self.sin = cos[0], sin[0]

    def keep(self, num_nodes: int, accepted: list[int]) -> None:
        """After a forward of `num_nodes` at [length, length + num_nodes): keep the accepted nodes (root first) as
        the next columns; nothing moves when they are already the first A nodes (a chain prefix)."""
        a = len(accepted)
        if accepted != list(range(a)):
            src = torch.tensor(accepted, device=self.device) + self.length
            self.k[:, :, self.length:self.length + a] = self.k.index_select(2, src)
            self.v[:, :, self.length:self.length + a] = self.v.index_select(2, src)
        self.length += a

    def drop(self, n: int) -> None:
        self.length = max(0, self.length - max(n, 0))

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A copy of the kept columns (the skip-set search keeps one per calibration prompt)."""
        return self.k[:, :, :self.length].clone(), self.v[:, :, :self.length].clone(), self.length

    def restore(self, snap: tuple[torch.Tensor, torch.Tensor, int], room: int = 0) -> None:
        """The kept columns of `snapshot`, with room for `room` more."""
        k, v, length = snap
        self.reset(length + room)
        self.k[:, :, :length], self.v[:, :, :length] = k, v
        self.length = length

    # ------------------------------------------------------------------------------------------------ draft cost
    def unit_weights(self, layer: int, attention: bool) -> int:
        """Weight elements a sublayer reads: q/k/v and o, or gate/up and down."""
        lay = self.layers[layer]
        return lay.qkv.numel() + lay.o.numel() if attention else lay.gate_up.numel() + lay.down.numel()

    def draft_share(self, skip: SkipSet, head_rows: int | None = None) -> float:
        """A draft pass's cost in one-token target forwards, modelled as the weights it reads over those a full pass
        reads (decoding one token streams every weight once): the kept sublayers plus `head_rows` rows of the
        lm_head (None: all V)."""
        L, D = len(self.layers), self.lm_head.shape[1]
        full = sum(self.unit_weights(i, a) for i in range(L) for a in (True, False)) + self.lm_head.numel()
        kept = sum(self.unit_weights(i, a) for i, a in skip.units(L)) + D * (head_rows or self.lm_head.shape[0])
        return kept / full

    # ------------------------------------------------------------------------------------------------ forward
    def _linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, in] . w [out, in]^T (+ b): the bf16 kernel where it runs (engine/kernels.py), else PyTorch's."""
        wp = self.packed.get(id(w))
        if self.kernel is None or x.shape[0] > (kernels.MAX_ROWS if wp is None else kernels.PACKED_MAX_ROWS):
            return F.linear(x, w, b)
        y = self.kernel(x.contiguous(), w) if wp is None else self.ops.linear_packed_bf16(x.contiguous(), wp, w.shape[0])
        return y if b is None else y + b

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(dt)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _attend(self, i: int, lay: _Layer, x: torch.Tensor, cos, sin, mask, start: int) -> torch.Tensor:
        """x [n, D] normed -> attention output [n, H hd]; writes this layer's keys / values at [start, start + n)."""
        n, H, G, hd = x.shape[0], self.H, self.G, self.hd
        qkv = self._linear(x, lay.qkv, lay.qkv_bias)  # [n, (H + 2G) hd]
        q, k, v = qkv.split((H * hd, G * hd, G * hd), dim=-1)
        q, k, v = q.view(n, H, hd), k.view(n, G, hd), v.view(n, G, hd)
        if lay.q_norm is not None:
            q, k = self._rms(q, lay.q_norm), self._rms(k, lay.k_norm)
        q = self._rope(q.transpose(0, 1), cos, sin).to(self.cache_dtype)  # [H, n, hd]
        k = self._rope(k.transpose(0, 1), cos, sin)  # [G, n, hd]
        end = start + n
        self.k[i, :, start:end] = k
        self.v[i, :, start:end] = v.transpose(0, 1)
        keys, values = self.k[i, :, :end], self.v[i, :, :end]  # [G, S + n, hd]
        o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                           scale=hd ** -0.5, enable_gqa=G != H)  # [1, H, n, hd]
        return o[0].transpose(0, 1).reshape(n, H * hd).to(self.dtype)

    def _attn_unit(self, i: int, lay: _Layer, x: torch.Tensor, cos, sin, mask, start: int) -> torch.Tensor:
        """x + attention sublayer (PyTorch ops, HF's order: fp32 targets, the exactness path)."""
        return x + self._linear(self._attend(i, lay, self._rms(x, lay.ln_in), cos, sin, mask, start), lay.o)

    def _mlp_unit(self, lay: _Layer, x: torch.Tensor) -> torch.Tensor:
        """x + MLP sublayer (PyTorch ops)."""
        gate, up = self._linear(self._rms(x, lay.ln_post), lay.gate_up).chunk(2, dim=-1)
        return x + self._linear(F.silu(gate) * up, lay.down)

    def _layer(self, i: int, lay: _Layer, x: torch.Tensor, cos, sin, mask, start: int) -> torch.Tensor:
        """One decoder layer in PyTorch ops, HF's order (fp32 targets: the exactness path)."""
        return self._mlp_unit(lay, self._attn_unit(i, lay, x, cos, sin, mask, start))

    def _attn_fused(self, i: int, lay: _Layer, xn: torch.Tensor, cos, sin, mask, start: int) -> torch.Tensor:
        """The bf16 attention sublayer's output [n, D] on the compiled ops (kernels.FUSED), xn its input norm;
        writes this layer's keys / values at [start, start + n)."""
        ops, n, hd = self.ops, xn.shape[0], self.hd
        qkv = self._linear(xn, lay.qkv, lay.qkv_bias)  # [n, (H + 2G) hd]
        q = ops.rope_write_bf16(qkv, cos, sin, self.k[i], self.v[i], start, self.H, self.G)  # [H, n, hd] fp32
        if n > PREFILL_ROWS:  # a prefill: PyTorch's blocked attention (the kernel computes all n x S scores one by
            # one: 2.2x slower than HF's whole forward at 1,024 tokens, docs/results/prefill-paths)
            end = start + n
            o = F.scaled_dot_product_attention(q[None], self.k[i, :, :end][None], self.v[i, :, :end][None],
                                               attn_mask=mask, scale=hd ** -0.5,
                                               enable_gqa=self.G != self.H)  # [1, H, n, hd]; mask [n, S + n]
            attn = o[0].transpose(0, 1).reshape(n, self.H * hd).to(self.dtype)
        else:
            attn = ops.attend_bf16(q, self.k[i], self.v[i], start + n, mask, hd ** -0.5)  # [n, H hd]
        return self._linear(attn, lay.o)

    def _mlp_fused(self, lay: _Layer, xn: torch.Tensor) -> torch.Tensor:
        return self._linear(self.ops.silu_mul_bf16(self._linear(xn, lay.gate_up)), lay.down)

    def _layer_fused(self, i: int, lay: _Layer, x: torch.Tensor, xn: torch.Tensor, cos, sin, mask, start: int
                     ) -> torch.Tensor:
        """One bf16 decoder layer on the compiled ops (kernels.FUSED): x [n, D] the residual (updated in place
        after attention), xn its RMSNorm -> the MLP's output, which the caller adds with the next norm."""
        xn = self.ops.add_rms_bf16(x, self._attn_fused(i, lay, xn, cos, sin, mask, start), lay.ln_post, self.eps)
        return self._mlp_fused(lay, xn)

    def _stack(self, x: torch.Tensor, cos, sin, mask, start: int, want: set[int]) -> tuple[torch.Tensor, dict]:
        """Every layer, then the final norm -> (normed x [n, D], {layer id: hidden state} for `want`)."""
        states = {0: x.clone()} if 0 in want else {}
        last = len(self.layers)
        if not self.fused:
            for i, lay in enumerate(self.layers):
                x = self._layer(i, lay, x, cos, sin, mask, start)
                if i + 1 in want:
                    states[i + 1] = x
            return self._rms(x, self.norm), states
        x = x.contiguous()
        xn = self.ops.rms_bf16(x, self.layers[0].ln_in, self.eps)
        if self._flat is not None and x.shape[0] <= PREFILL_ROWS:  # one compiled call for every layer, the same ops
            # as the loop below (a prefill's attention runs on PyTorch's, in the loop)
            keep = sorted(i for i in want if 0 < i < last)
            out = self.ops.stack_bf16(x, xn, self._flat, self.k, self.v, cos.contiguous(), sin.contiguous(), mask,
                                      start, self.H, self.G, self.eps, self.hd ** -0.5, keep, kernels.PACKED_MAX_ROWS)
            states.update(zip(keep, out[1:]))
            return out[0], states
        for i, lay in enumerate(self.layers):
            y = self._layer_fused(i, lay, x, xn, cos, sin, mask, start)
            nxt = self.layers[i + 1].ln_in if i + 1 < last else self.norm
            xn = self.ops.add_rms_bf16(x, y, nxt, self.eps)  # x += y in place; the next layer's input norm
            if i + 1 in want and i + 1 < last:
                states[i + 1] = x.clone()
        return xn, states

    def _stack_units(self, x: torch.Tensor, cos, sin, mask, start: int, units) -> torch.Tensor:
        """The kept sublayers `units` (SkipSet.units) in order, then the final norm -> normed x [n, D]. In the
        fused path each output is added with the next kept sublayer's input norm (as _stack does)."""
        if not self.fused:
            for i, attn in units:
                lay = self.layers[i]
                x = self._attn_unit(i, lay, x, cos, sin, mask, start) if attn else self._mlp_unit(lay, x)
            return self._rms(x, self.norm)
        norms = [self.layers[i].ln_in if attn else self.layers[i].ln_post for i, attn in units] + [self.norm]
        x = x.contiguous()
        xn = self.ops.rms_bf16(x, norms[0], self.eps)
        for j, (i, attn) in enumerate(units):
            lay = self.layers[i]
            y = self._attn_fused(i, lay, xn, cos, sin, mask, start) if attn else self._mlp_fused(lay, xn)
            xn = self.ops.add_rms_bf16(x, y, norms[j + 1], self.eps)  # x += y in place; the next sublayer's norm
        return xn

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None,
                layers: list[int] | None = None, logit_rows: str = "all"):
        """tokens [n] at `positions` [n], written at cache columns [length, length + n) (`length` is not advanced:
        `keep` does that). allowed [n, n] bool: which of this forward's tokens each token sees (itself and its
        ancestors); None = causal. -> (logits [n, V] | [1, V] | None by logit_rows all / last / none, the hidden
        states of `layers` concatenated [n, F D] | None; layer ids as HF's output_hidden_states)."""
        n, start = tokens.numel(), self.length
        self._grow(start + n)
        self._rope_table(int(positions.max()) + 1)
        cos, sin = self.cos[positions], self.sin[positions]  # [n, hd]
        mask = None
        if n > 1:
            if allowed is None:
                allowed = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device), allowed.to(self.device)], 1)
        x = F.embedding(tokens.to(self.device), self.embed)  # [n, D]
        x, states = self._stack(x, cos, sin, mask, start, set(layers or ()))
        states[len(self.layers)] = x
        feats = torch.cat([states[l] for l in layers], dim=-1) if layers else None
        if logit_rows == "none":
            return None, feats
        rows = x[-1:] if logit_rows == "last" else x
        return self._linear(rows, self.lm_head), feats

    @torch.no_grad()
    def draft(self, tokens: torch.Tensor, offset: int, skip: SkipSet, prefix: int | None = None,
              head: torch.Tensor | None = None, logit_rows: str = "last") -> torch.Tensor:
        """A self-speculative draft pass (drafters/self_spec.py): the target with the sublayers of `skip` left out,
        over this cache. tokens [n] are this step's draft inputs offset .. offset + n - 1 (the root is input 0), at
        positions prefix + offset .., written at columns length + offset .. of the kept attention sublayers only:
        never below `length` (the kept sequence stays the full passes' own), and the next full forward writes its
        tree over them before it reads them (`length` is not advanced). Each input reads the kept prefix [0, prefix)
        (default every kept column; the skip-set search reads shorter ones of a cached sequence) and this step's
        draft columns [length, its own]. -> logits [V'] of the last input over `head` rows [V', D] (None: the
        lm_head, V' = V); logit_rows "all": [n, V'], every input's (a teacher-forced pass)."""
        n, base = tokens.numel(), self.length
        prefix = base if prefix is None else prefix
        if not 0 <= prefix <= base or offset < 0:
            raise ValueError(f"draft: prefix {prefix} / offset {offset} outside the kept {base} columns")
        start = base + offset
        end = start + n
        self._grow(end, upto=start)
        positions = torch.arange(prefix + offset, prefix + offset + n, device=self.device)
        self._rope_table(prefix + offset + n)
        mask = None
        if n > 1 or prefix < base:  # [n, end]: the prefix, this step's earlier drafts, causal among the n inputs
            mask = torch.zeros(n, end, dtype=torch.bool, device=self.device)
            mask[:, :prefix] = True
            mask[:, base:start] = True
            mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        x = F.embedding(tokens.to(self.device), self.embed)  # [n, D]
        x = self._stack_units(x, self.cos[positions], self.sin[positions], mask, start, _kept(skip, len(self.layers)))
        logits = self._linear(x if logit_rows == "all" else x[-1:], self.lm_head if head is None else head)
        return logits if logit_rows == "all" else logits[0]
