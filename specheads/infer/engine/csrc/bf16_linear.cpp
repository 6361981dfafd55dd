// The matrix-vector kernels of kernels.py (its docstring says what they are for and how fast they run).
#include "bf16_ops.h"

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
