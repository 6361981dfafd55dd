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
The C++ is compiled once by torch.utils.cpp_extension into $SPECHEADS_CACHE/kernels (about 20-40 s, a log line
says so) and reused; without a compiler, ninja or AVX512-BF16, `bf16_ops()` returns None and the forward uses
`F.linear`. SPECHEADS_KERNELS=off turns it off.
"""
from __future__ import annotations

import functools
import logging
import os
import weakref

import torch
import torch.nn.functional as F

from specheads.utils import cache_root

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

// MT token rows against one weight row w [K]: per output four fp32 accumulator chains over k (k mod 128 in
// 32-lane groups; the tail joins the first), added as (a0 + a1) + (a2 + a3), then reduced across lanes. The order
// is the same for every MT, so an output does not depend on how many token rows share the call. A whole weight
// row is read front to back, which the hardware prefetcher streams at the memory's speed (interleaving 4-8 rows
// reached half of it), and each 64-byte load of it serves all MT token rows.
template <int MT>
static inline void dot_rows(const uint16_t* w, const uint16_t* x, int64_t K, float* out) {
  __m512 a[MT][4];
  for (int i = 0; i < MT; ++i)
    for (int c = 0; c < 4; ++c) a[i][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128)
    for (int c = 0; c < 4; ++c) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * c);
      for (int i = 0; i < MT; ++i)
        a[i][c] = _mm512_dpbf16_ps(a[i][c], wv, (__m512bh)_mm512_loadu_si512(x + i * K + k + 32 * c));
    }
  for (; k < K; k += 32) {
    __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int i = 0; i < MT; ++i) a[i][0] = _mm512_dpbf16_ps(a[i][0], wv, (__m512bh)_mm512_loadu_si512(x + i * K + k));
  }
  for (int i = 0; i < MT; ++i)
    out[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[i][0], a[i][1]), _mm512_add_ps(a[i][2], a[i][3])));
}

// y [M, N] = x [M, K] . w [N, K]^T in bf16, fp32 accumulation; K % 32 == 0 (checked in Python). Threads split the
// weight rows; each row is streamed once from memory and then read from L1 for the other token rows.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    float out[4];
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* wr = wp + n * K;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {
        dot_rows<4>(wr, xp + m * K, K, out);
        for (int i = 0; i < 4; ++i) yp[(m + i) * N + n] = at::BFloat16(out[i]);
      }
      for (; m + 2 <= M; m += 2) {
        dot_rows<2>(wr, xp + m * K, K, out);
        for (int i = 0; i < 2; ++i) yp[(m + i) * N + n] = at::BFloat16(out[i]);
      }
      if (m < M) {
        dot_rows<1>(wr, xp + m * K, K, out);
        yp[m * N + n] = at::BFloat16(out[0]);
      }
    }
  });
  return y;
}

// The packed layout for decoding: w [N, K] -> [ceil(N / R), K / 2, R, 2] for blocks of R = 32 or 64 output rows:
// per block, per pair of k, the R rows' pairs side by side (rows past N are zero). A block is then one contiguous
// stream, and one 64-byte load carries 16 outputs' next pair for `vdpbf16ps` against a token's pair broadcast to
// every lane: no per-output reduction across lanes, and each weight load serves several token rows from registers
// (the row-major kernel above loads a token row's vector for every product, and was load-bound beyond 2 rows: 4
// rows cost 1.4x one row, against 1.0x here; scripts/bench_kernels.py). R = 32 for matrices of under 1024 rows, so
// that two threads split even the 576-row ones evenly (18 blocks, not 9).
torch::Tensor pack_bf16(torch::Tensor w) {
  const int64_t N = w.size(0), K2 = w.size(1) / 2, R = N < 1024 ? 32 : 64, NB = (N + R - 1) / R;
  auto out = torch::zeros({NB, K2, R, 2}, w.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < R && b * R + r < N; ++r)
        for (int64_t kp = 0; kp < K2; ++kp) dst[(b * K2 + kp) * R + r] = src[(b * R + r) * K2 + kp];
  });
  return out;
}

// MT token rows x one packed block of 16 J outputs (MT J <= 16 accumulators): one fp32 lane per output summing its
// k pairs in order, the same order for every MT and J, so an output does not depend on the token rows beside it.
template <int MT, int J>
static inline void packed_block(const uint32_t* wb, const uint32_t* x, int64_t K2, float* out) {
  __m512 acc[MT][J];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh w[J];
    for (int j = 0; j < J; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wb + kp * 16 * J + 16 * j);
    for (int i = 0; i < MT; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * K2 + kp]));
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xb);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(out + i * 16 * J + 16 * j, acc[i][j]);
}

template <int J>
static inline void packed_rows(const uint32_t* wb, const uint32_t* x, int64_t K2, int64_t mt, float* out) {
  constexpr int G = 16 / J;  // token rows per pass
  switch (mt < G ? mt : G) {
    case 8: packed_block<(G >= 8 ? 8 : 1), J>(wb, x, K2, out); break;
    case 7: packed_block<(G >= 7 ? 7 : 1), J>(wb, x, K2, out); break;
    case 6: packed_block<(G >= 6 ? 6 : 1), J>(wb, x, K2, out); break;
    case 5: packed_block<(G >= 5 ? 5 : 1), J>(wb, x, K2, out); break;
    case 4: packed_block<4, J>(wb, x, K2, out); break;
    case 3: packed_block<3, J>(wb, x, K2, out); break;
    case 2: packed_block<2, J>(wb, x, K2, out); break;
    default: packed_block<1, J>(wb, x, K2, out);
  }
}

// y [M, N] = x [M, K] . w [N, K]^T from pack_bf16(w); threads split the blocks; token rows go 4 (64-row blocks) or
// 8 (32-row blocks) at a time, a block's later passes reading it from L2.
torch::Tensor linear_packed_bf16(torch::Tensor x, torch::Tensor wp, int64_t N) {
  const int64_t M = x.size(0), K2 = x.size(1) / 2, NB = wp.size(0), R = wp.size(2), G = R == 32 ? 8 : 4;
  auto y = torch::empty({M, N}, x.options());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* w = reinterpret_cast<const uint32_t*>(wp.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float out[256];
    for (int64_t b = b0; b < b1; ++b) {
      const uint32_t* wb = w + b * K2 * R;
      const int64_t rows = std::min<int64_t>(R, N - b * R);
      for (int64_t m = 0; m < M; m += G) {
        const int64_t mt = std::min<int64_t>(G, M - m);
        if (R == 32) packed_rows<2>(wb, xp + m * K2, K2, mt, out);
        else packed_rows<4>(wb, xp + m * K2, K2, mt, out);
        for (int64_t i = 0; i < mt; ++i)
          for (int64_t r = 0; r < rows; ++r) yp[(m + i) * N + b * R + r] = at::BFloat16(out[i * R + r]);
      }
    }
  });
  return y;
}
"""

_FUSED = r"""
// The small ops of a bf16 decoder layer, one call each instead of 5-10 PyTorch ops (each ~2-5 us of dispatch on a
// CPU; 30 layers x ~40 ops were a third of a decode step). Rounding to bf16 happens where HF's bf16 forward rounds.
static inline float bf(float v) { return static_cast<float>(at::BFloat16(v)); }

// 16 bf16 values <-> fp32 lanes; rounding to bf16 is to nearest even, as at::BFloat16(float).
static inline __m512 ld16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void st16(at::BFloat16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline __m512 bf16v(__m512 v) {  // round the lanes to bf16 and back
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// HF LlamaRMSNorm in bf16: w * bf16(x * rsqrt(mean(x^2) + eps)), the statistics in fp32; D % 16 == 0.
static void rms_rows(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t n, int64_t D,
                     double eps) {
  for (int64_t i = 0; i < n; ++i) {
    const at::BFloat16* r = x + i * D;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) { const __m512 v = ld16(r + d); ss = _mm512_fmadd_ps(v, v, ss); }
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / D + static_cast<float>(eps)));
    for (int64_t d = 0; d < D; d += 16)
      st16(out + i * D + d, _mm512_mul_ps(ld16(w + d), bf16v(_mm512_mul_ps(ld16(r + d), inv))));
  }
}

torch::Tensor rms_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  auto out = torch::empty_like(x);
  rms_rows(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), x.size(0),
           x.size(1), eps);
  return out;
}

// x += y (in place, bf16), then the RMSNorm of the new x: the residual add and the next norm in one call.
torch::Tensor add_rms_bf16(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps) {
  at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < x.numel(); i += 16) st16(xp + i, _mm512_add_ps(ld16(xp + i), ld16(yp + i)));
  return rms_bf16(x, w, eps);
}

static inline __m512 exp512(__m512 x);

// gu [n, 2I] = [gate | up] -> bf16(bf16(silu(gate)) * up); I % 16 == 0
torch::Tensor silu_mul_bf16(torch::Tensor gu) {
  const int64_t n = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({n, I}, gu.options());
  const at::BFloat16* g = gu.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < I; j += 16) {
      const __m512 a = ld16(g + i * 2 * I + j);
      const __m512 s = bf16v(_mm512_div_ps(a, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
      st16(o + i * I + j, _mm512_mul_ps(s, ld16(g + i * 2 * I + I + j)));
    }
  return out;
}

// qkv [n, (H + 2G) hd] bf16, cos / sin [n, hd] bf16: RoPE on q and k as HF computes it in bf16
// (bf16(bf16(x cos) + bf16(rotate_half(x) sin))); k and v are written as fp32 into the caches kc / vc [G, C, hd] at
// columns start..start+n; returns q [H, n, hd] fp32 for the attention.
torch::Tensor rope_write_bf16(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc,
                              torch::Tensor vc, int64_t start, int64_t H, int64_t G) {
  const int64_t n = qkv.size(0), hd = cos.size(1), half = hd / 2, C = kc.size(1), W = qkv.size(1);
  auto q = torch::empty({H, n, hd}, kc.options());
  const at::BFloat16* x = qkv.data_ptr<at::BFloat16>();
  const at::BFloat16* c = cos.data_ptr<at::BFloat16>();
  const at::BFloat16* s = sin.data_ptr<at::BFloat16>();
  float* qp = q.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const at::BFloat16* row = x + t * W;
    for (int64_t h = 0; h < H + G; ++h) {
      const at::BFloat16* v = row + h * hd;
      float* dst = h < H ? qp + (h * n + t) * hd : kp + ((h - H) * C + start + t) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        const float xv = static_cast<float>(v[d]);
        const float rv = d < half ? -static_cast<float>(v[d + half]) : static_cast<float>(v[d - half]);
        const float cs = static_cast<float>(c[t * hd + d]), sn = static_cast<float>(s[t * hd + d]);
        dst[d] = bf(bf(xv * cs) + bf(rv * sn));
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < hd; ++d)
        vp[(g * C + start + t) * hd + d] = static_cast<float>(row[(H + G + g) * hd + d]);
  }
  return q;
}

// e^x in 16 lanes (Cephes' polynomial after x = k ln2 + r, |r| <= ln2 / 2; relative error ~2e-7); -inf -> 0.
static inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 dead = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(~dead, y, k);
}

// Attention of q [H, n, hd] fp32 over the cache columns [0, end) of kc / vc [G, C, hd] fp32 (query head h reads
// key / value head h / (H / G)); allowed [n, end] bool (none: every column) -> [n, H hd] bf16; hd % 16 == 0.
// Softmax in fp32 with the row maximum subtracted. PyTorch's CPU attention costs ~80 us a layer for one query row
// over 300 keys; this one streams each key and value once per head for all query rows, in 16-lane vectors.
torch::Tensor attend_bf16(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, int64_t end,
                          c10::optional<torch::Tensor> allowed, double scale) {
  const int64_t H = q.size(0), n = q.size(1), hd = q.size(2), G = kc.size(0), C = kc.size(1), rep = H / G;
  const int64_t L = hd / 16;
  auto out = torch::empty({n, H * hd}, q.options().dtype(torch::kBFloat16));
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const bool* ap = allowed.has_value() ? allowed->data_ptr<bool>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {  // heads are independent: split over the threads
  std::vector<float> p(n * end), accb(n * hd), mx(n), sum(n);
  for (int64_t h = h0; h < h1; ++h) {  // keys and values are streamed once per head for all n query rows
    const float* K = kp + (h / rep) * C * hd;
    const float* V = vp + (h / rep) * C * hd;
    const float* Q = qp + h * n * hd;
    for (int64_t t = 0; t < n; ++t) mx[t] = -INFINITY, sum[t] = 0.f;
    for (int64_t j = 0; j < end; ++j)
      for (int64_t t = 0; t < n; ++t) {
        float& s = p[t * end + j];
        if (ap && !ap[t * end + j]) { s = -INFINITY; continue; }
        __m512 a = _mm512_setzero_ps();
        for (int64_t l = 0; l < L; ++l)
          a = _mm512_fmadd_ps(_mm512_loadu_ps(Q + t * hd + 16 * l), _mm512_loadu_ps(K + j * hd + 16 * l), a);
        s = _mm512_reduce_add_ps(a) * static_cast<float>(scale);
        mx[t] = std::max(mx[t], s);
      }
    for (int64_t t = 0; t < n; ++t) {  // p = exp(s - max) in place, 16 lanes at a time; masked columns give 0
      float* row = p.data() + t * end;
      const __m512 m = _mm512_set1_ps(mx[t]);
      __m512 tot = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 16 <= end; j += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
        _mm512_storeu_ps(row + j, e);
        tot = _mm512_add_ps(tot, e);
      }
      sum[t] = _mm512_reduce_add_ps(tot);
      for (; j < end; ++j) row[j] = row[j] == -INFINITY ? 0.f : std::exp(row[j] - mx[t]), sum[t] += row[j];
    }
    std::fill(accb.begin(), accb.end(), 0.f);
    for (int64_t j = 0; j < end; ++j) {
      const float* vj = V + j * hd;
      for (int64_t t = 0; t < n; ++t) {
        const __m512 ev = _mm512_set1_ps(p[t * end + j]);
        float* acc = accb.data() + t * hd;
        for (int64_t l = 0; l < L; ++l)
          _mm512_storeu_ps(acc + 16 * l, _mm512_fmadd_ps(ev, _mm512_loadu_ps(vj + 16 * l), _mm512_loadu_ps(acc + 16 * l)));
      }
    }
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < hd; ++d) op[t * H * hd + h * hd + d] = at::BFloat16(accb[t * hd + d] / sum[t]);
  }
  });
  return out;
}


static inline torch::Tensor lin(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& wp,
                                int64_t max_rows) {
  return x.size(0) <= max_rows ? linear_packed_bf16(x, wp, w.size(0)) : at::linear(x, w);
}

// Every decoder layer of a bf16 Llama-like target in one call: the Python loop's ~9 extension calls a layer cost
// ~1.5 ms of a ~12 ms one-token step in dispatch alone. w holds 10 tensors a layer: qkv [(H + 2G) hd, D], o,
// gate_up, down, the same four packed (pack_bf16; up to max_rows token rows), ln_post [D] and the next norm (the
// next layer's ln_in; the final norm after the last layer). x [n, D] is the residual (updated in place), xn its
// first norm; kc / vc [L, G, C, hd] the caches, written at columns start.. -> {the final norm of x, x after each
// layer in `want` (ascending layer ids 1..L-1)}. The same ops in the same order as OwnedLlama._layer_fused, so
// the two paths give the same numbers.
std::vector<torch::Tensor> stack_bf16(torch::Tensor x, torch::Tensor xn, std::vector<torch::Tensor> w,
                                      torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin,
                                      c10::optional<torch::Tensor> mask, int64_t start, int64_t H, int64_t G,
                                      double eps, double scale, std::vector<int64_t> want, int64_t max_rows) {
  const int64_t L = static_cast<int64_t>(w.size()) / 10, n = x.size(0);
  std::vector<torch::Tensor> out{xn};
  size_t wi = 0;
  for (int64_t i = 0; i < L; ++i) {
    const torch::Tensor* l = w.data() + 10 * i;
    auto k_i = kc.select(0, i), v_i = vc.select(0, i);
    auto q = rope_write_bf16(lin(xn, l[0], l[4], max_rows), cos, sin, k_i, v_i, start, H, G);  // [H, n, hd] fp32
    auto attn = attend_bf16(q, k_i, v_i, start + n, mask, scale);  // [n, H hd]
    xn = add_rms_bf16(x, lin(attn, l[1], l[5], max_rows), l[8], eps);
    xn = add_rms_bf16(x, lin(silu_mul_bf16(lin(xn, l[2], l[6], max_rows)), l[3], l[7], max_rows), l[9], eps);
    if (wi < want.size() && want[wi] == i + 1) { out.push_back(x.clone()); ++wi; }
  }
  out[0] = xn;
  return out;
}
"""

_FUSED_DECL = """torch::Tensor rms_bf16(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_bf16(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
torch::Tensor silu_mul_bf16(torch::Tensor gu);
torch::Tensor rope_write_bf16(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor kc,
                              torch::Tensor vc, int64_t start, int64_t H, int64_t G);
torch::Tensor attend_bf16(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, int64_t end,
                          c10::optional<torch::Tensor> allowed, double scale);
std::vector<torch::Tensor> stack_bf16(torch::Tensor x, torch::Tensor xn, std::vector<torch::Tensor> w,
                                      torch::Tensor kc, torch::Tensor vc, torch::Tensor cos, torch::Tensor sin,
                                      c10::optional<torch::Tensor> mask, int64_t start, int64_t H, int64_t G,
                                      double eps, double scale, std::vector<int64_t> want, int64_t max_rows);
"""
FUSED = ("rms_bf16", "add_rms_bf16", "silu_mul_bf16", "rope_write_bf16", "attend_bf16", "stack_bf16")

VERSION = 13  # of the C++ above: a new one compiles into a folder of its own and re-keys the cost profiles

_CPP_DECL = """torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w);
torch::Tensor pack_bf16(torch::Tensor w);
torch::Tensor linear_packed_bf16(torch::Tensor x, torch::Tensor wp, int64_t N);
"""


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags and " avx512bw" in flags


@functools.lru_cache(maxsize=None)
def _module():
    """The compiled extension, or None (no AVX512-BF16, no compiler / ninja, or SPECHEADS_KERNELS=off)."""
    if os.environ.get("SPECHEADS_KERNELS", "auto").lower() in ("off", "0", "no"):
        return None
    if not _cpu_has_avx512_bf16():
        log.info("bf16 kernel: this CPU has no AVX512-BF16; the owned forward uses PyTorch's bf16 linear")
        return None
    try:
        from torch.utils import cpp_extension

        build = cache_root() / "kernels" / f"bf16-v{VERSION}-torch{torch.__version__.replace('+', '_')}"
        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            log.info("bf16 kernel: compiling once into %s (20-40 s)", build)
        return cpp_extension.load_inline(
            name=f"specheads_bf16_v{VERSION}", cpp_sources=[_CPP_DECL + _FUSED_DECL + _SOURCE + _FUSED],
            functions=["linear_bf16", "pack_bf16", "linear_packed_bf16", *FUSED],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"],
            extra_ldflags=["-fopenmp"],  # at::parallel_for is OpenMP pragmas in a header: without it, one thread
            build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no ninja, headers missing: the forward still runs on PyTorch's kernels
        log.warning("bf16 kernel: could not be built (%s); the owned forward uses PyTorch's bf16 linear",
                    str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
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
