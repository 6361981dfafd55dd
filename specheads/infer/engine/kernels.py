"""bf16 matrix-vector kernels for the owned forward on CPUs with AVX512-BF16 (AMD Zen 4+, Intel Cooper Lake+).

Decoding reads every weight once per step for a handful of token rows (one token; a tree of up to ~32 nodes), so a
step is bound by how fast the weights stream from memory. PyTorch's bf16 `F.linear` reaches 8-12 GB/s for one row on
2 cores (oneDNN's pointwise path at best; measured by scripts/bench_kernels.py). Two kernels here, `vdpbf16ps` dot
products accumulated in fp32:
- `linear_bf16` over row-major weights: streams each weight row front to back once for all token rows (17-21 GB/s
  on one core, 36 GB/s on two for the SmolLM2 weights); load-bound beyond 2 token rows.
- `linear_packed_bf16` over `pack_bf16`'s layout (blocks of 32 or 64 output rows, k in pairs, the rows side by
  side): one contiguous stream per block, each weight load serving 4-8 token rows, so a tree of 4 costs what one
  token does. The owned forward decodes with it (`packed`: one copy per weight, made where it fits in memory); prefill
  rows (more than PACKED_MAX_ROWS) go to PyTorch's kernels over the row-major weights.

    y[m, n] = bf16( sum_k x[m, k] * w[n, k] )    accumulated in fp32, rounded to nearest even once

Each y[m, n] is summed in the same order whatever the number of token rows M or threads, so a product does not
depend on the rows beside it (the attention does: a tree's outputs in bf16 may still round otherwise than one token
decoded alone; fp32 targets use PyTorch's kernels and stay exact).
The C++ lives in csrc/ (bf16_ops.h, bf16_linear.cpp, bf16_fused.cpp; package data) and is compiled once by
kernel_cache into $SPECHEADS_CACHE/kernels/specheads_bf16-<key> (20-40 s, a log line says so), the key a sha256 of
the sources, torch and the compile flags (`build_key`; the cost profiles are keyed by it too, so new kernels
re-measure them). Each load checks the build's manifest and its .so's sha256 before mapping it: a truncated,
corrupt or foreign build is rebuilt with one warning; two processes starting at once build it once; a cache folder
that cannot be written gets a build for this process only. Without a compiler, ninja or AVX512-BF16, `bf16_ops()`
returns None (one line says so) and the forward uses PyTorch's ops; a failed build is recorded and later runs
skip it (one info line) until SPECHEADS_KERNELS_RETRY=1 or new sources / torch. SPECHEADS_KERNELS=off turns it off.
"""
from __future__ import annotations

import functools
import logging
import os
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from specheads.infer.engine import kernel_cache

log = logging.getLogger(__name__)

FUSED = ("rms_bf16", "add_rms_bf16", "silu_mul_bf16", "rope_write_bf16", "attend_bf16", "stack_bf16")

# The C++ in csrc/ (shipped as package data), built by kernel_cache into $SPECHEADS_CACHE/kernels/specheads_bf16-<key>
EXTENSION = kernel_cache.Extension(
    name="specheads_bf16", files=tuple(Path(__file__).with_name("csrc") / f
                                       for f in ("bf16_ops.h", "bf16_linear.cpp", "bf16_fused.cpp")),
    cflags=("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"),
    ldflags=("-fopenmp",),  # at::parallel_for is OpenMP pragmas in a header: without it, one thread
    cpu_flags=("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    names=("linear_bf16", "pack_bf16", "linear_packed_bf16", *FUSED), label="bf16 kernel", duration="20-40 s",
    fallback="the owned forward uses PyTorch's ops (about a third of the speed)")


@functools.lru_cache(maxsize=None)
def build_key() -> str:
    """16 hex digits of the kernels' build key (kernel_cache.build_key: a sha256 of the C++ sources, torch and the
    flags), or "unreadable" where the sources are missing. The cost profiles' machine key holds it: new kernels
    compile into a folder of their own and re-measure the profiles."""
    try:
        return kernel_cache.build_key(EXTENSION)[:16]
    except (OSError, ValueError):
        return "unreadable"


def _cpu_has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512bw"} <= kernel_cache.cpu_flags()


@functools.lru_cache(maxsize=None)
def _module():
    """The compiled extension, or None (SPECHEADS_KERNELS=off, no AVX512-BF16, no compiler / ninja, a failed build;
    each but the first says so in one line)."""
    if os.environ.get("SPECHEADS_KERNELS", "auto").lower() in ("off", "0", "no"):
        return None
    if not _cpu_has_avx512_bf16():
        log.info("bf16 kernel: this CPU has no AVX512-BF16; the owned forward uses PyTorch's bf16 linear")
        return None
    try:
        return kernel_cache.load(EXTENSION)
    except Exception as e:  # noqa: BLE001 - never the end of a run: PyTorch's ops do the same work
        log.warning("bf16 kernel: not loaded (%s: %s); %s", type(e).__name__, str(e).strip()[:200],
                    EXTENSION.fallback)
        return None


def bf16_ops():
    """The compiled module (`linear_bf16(x [M, K], w [N, K]) -> [M, N]` and the fused layer ops in FUSED), or None
    where it cannot run."""
    return _module()


MAX_ROWS = 16  # token rows up to which the row-major kernel beats PyTorch's bf16 linear (a prefill goes to oneDNN)
PACKED_MAX_ROWS = 32  # and the packed one (32 rows: ~0.6x of PyTorch's time on one core, scripts/bench_kernels.py)


def usable(w: torch.Tensor) -> bool:
    """Whether the kernel takes weight `w`: bf16, on the CPU, contiguous rows, K a multiple of 32."""
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous() and w.shape[-1] % 32 == 0


# id of a live weight -> (weak reference to it, its _version when packed, its packed copy). Keyed by the tensor
# object, not its address: a freed weight's address is reused by the next one allocated (a second model, a test's
# next tiny target), and a copy keyed by address would then multiply by stale weights. The entry goes with its weight.
_PACKED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def _free_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def packed(w: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of weight w (`pack_bf16`, made once and kept), or None: not usable, no kernel, or no room (a
    copy is made only while twice its size stays free, so a target near the memory's size decodes on the row-major
    kernel instead)."""
    ops = bf16_ops() if usable(w) else None
    if ops is None:
        return None
    entry = _PACKED.get(id(w))
    if entry is not None and entry[0]() is w and entry[1] == w._version:
        return entry[2]
    if 2 * w.numel() * w.element_size() > _free_bytes():
        return None
    if entry is None or entry[0]() is not w:
        weakref.finalize(w, _PACKED.pop, id(w), None)  # runs when w is freed, before its id can be reused
    _PACKED[id(w)] = (weakref.ref(w), w._version, ops.pack_bf16(w))
    return _PACKED[id(w)][2]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., in], w [out, in], b), on the bf16 kernel where it pays and no gradient is wanted: w usable,
    x bf16, at most PACKED_MAX_ROWS rows (MAX_ROWS unpacked). The serving path of a draft head (a handful of rows against its projections)."""
    rows = x.numel() // max(x.shape[-1], 1)
    ops = bf16_ops() if rows <= PACKED_MAX_ROWS and x.dtype == torch.bfloat16 and usable(w) else None
    if ops is None or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return F.linear(x, w, b)
    x2, wp = x.reshape(rows, x.shape[-1]).contiguous(), packed(w)
    if wp is None and rows > MAX_ROWS:
        return F.linear(x, w, b)
    y = ops.linear_bf16(x2, w) if wp is None else ops.linear_packed_bf16(x2, wp, w.shape[0])
    y = y.reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b


class KernelLinear(torch.nn.Linear):
    """An nn.Linear whose forward is `linear` above: same parameters and state dict; what `serve_linears` turns a
    served head's projections into."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def serve_linears(module: torch.nn.Module) -> int:
    """Run a served module's own bf16 nn.Linear layers (not hooked, not adapted) on the kernel: a draft head's pass
    streams its projections (EAGLE-3's fc, layer and V' lm_head) like the target's; its frozen target modules are
    not its submodules and stay as they are. -> how many were turned (0 where the kernel cannot run)."""
    if bf16_ops() is None:
        return 0
    turned = 0
    for m in module.modules():
        if type(m) is torch.nn.Linear and usable(m.weight) and not (m._forward_hooks or m._forward_pre_hooks):
            m.__class__ = KernelLinear
            turned += 1
    return turned
