// Declarations shared by bf16_linear.cpp and bf16_fused.cpp (kernels.py builds both into one module; the
// sha256 of these files is part of its cache key, so an edit here compiles a new module).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w);
torch::Tensor pack_bf16(torch::Tensor w);
torch::Tensor linear_packed_bf16(torch::Tensor x, torch::Tensor wp, int64_t N);
torch::Tensor rms_bf16(torch::Tensor x, torch::Tensor w, double eps);
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
