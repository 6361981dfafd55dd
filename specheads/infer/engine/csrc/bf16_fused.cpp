// The fused layer ops of kernels.py (FUSED) and the module definition of every kernel.
#include "bf16_ops.h"
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

// The module kernels.py loads: every function above and in bf16_linear.cpp, exceptions as Python errors.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", torch::wrap_pybind_function(linear_bf16), "linear_bf16");
  m.def("pack_bf16", torch::wrap_pybind_function(pack_bf16), "pack_bf16");
  m.def("linear_packed_bf16", torch::wrap_pybind_function(linear_packed_bf16), "linear_packed_bf16");
  m.def("rms_bf16", torch::wrap_pybind_function(rms_bf16), "rms_bf16");
  m.def("add_rms_bf16", torch::wrap_pybind_function(add_rms_bf16), "add_rms_bf16");
  m.def("silu_mul_bf16", torch::wrap_pybind_function(silu_mul_bf16), "silu_mul_bf16");
  m.def("rope_write_bf16", torch::wrap_pybind_function(rope_write_bf16), "rope_write_bf16");
  m.def("attend_bf16", torch::wrap_pybind_function(attend_bf16), "attend_bf16");
  m.def("stack_bf16", torch::wrap_pybind_function(stack_bf16), "stack_bf16");
}
