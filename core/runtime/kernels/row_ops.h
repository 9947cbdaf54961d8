// Per-row glue of the decoder: RMSNorm, rotary embedding and the SiLU gate; with `bf16`, rounded where a bf16
// model rounds (round_bf16).
// Part of the CPU kernels, compiled as one translation unit from cpu.cpp, whose opening comment says how every
// kernel stays row-invariant.
#pragma once

#include "numerics.h"

namespace {

// The sum of x[i]^2 over i < n, in 16 lanes added in lane order. One compiled function, not inlined: every thread
// that normalises some columns of a row computes the row's sum whole, and all of them, whatever code surrounds the
// call, must get the same float.
__attribute__((noinline)) float sum_of_squares(const float* x, int64_t n) {
  float lane[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
#pragma omp simd
    for (int l = 0; l < 16; ++l) lane[l] += x[i + l] * x[i + l];
  for (int l = 0; i < n; ++i, ++l) lane[l] += x[i] * x[i];
  float s = 0.0f;
  for (int l = 0; l < 16; ++l) s += lane[l];
  return s;
}

// (The per-element loops below are instantiated for each rounding mode: with the mode a run-time test inside the
// loop, the compiler kept them scalar.)
// Columns [c0, c1) of the RMSNorm of the row x [H].
template <bool BF16>
void rms_norm_columns(const float* x, const float* w, int64_t H, float eps, int64_t c0, int64_t c1, float* out) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, H) / static_cast<float>(H) + eps);
  for (int64_t i = c0; i < c1; ++i) out[i] = store(w[i] * store(x[i] * inv, BF16), BF16);
}

void rms_norm_columns(const float* x, const float* w, int64_t H, float eps, int64_t c0, int64_t c1, float* out,
                      bool bf16) {
  bf16 ? rms_norm_columns<true>(x, w, H, eps, c0, c1, out) : rms_norm_columns<false>(x, w, H, eps, c0, c1, out);
}

void rms_norm(const float* x, const float* w, int64_t R, int64_t H, float eps, float* out, bool bf16) {
  for (int64_t r = 0; r < R; ++r) rms_norm_columns(x + r * H, w, H, eps, 0, H, out + r * H, bf16);
}

// Rotary embedding ("rotate half") of one head v [D] in place; cos/sin [D], the token's rows.
void rope_head(float* v, int64_t D, const float* c, const float* s, bool bf16) {
  const int64_t half = D / 2;
  float tmp[256];  // D <= 256 (with_head_size)
  for (int64_t i = 0; i < half; ++i) tmp[i] = store(store(v[i] * c[i], bf16) - store(v[i + half] * s[i], bf16), bf16);
  for (int64_t i = half; i < D; ++i) tmp[i] = store(store(v[i] * c[i], bf16) + store(v[i - half] * s[i], bf16), bf16);
  std::copy(tmp, tmp + D, v);
}

// Columns [c0, c1) of out [I] = silu(gate) * up, gate and up the two halves of gu [2 I].
template <bool BF16>
void silu_gate_columns(const float* gu, int64_t I, int64_t c0, int64_t c1, float* out) {
  const float* g = gu;
  const float* u = gu + I;
#pragma omp simd
  for (int64_t i = c0; i < c1; ++i) {
    const float e = exp_nonpositive(-std::fabs(g[i]));
    const float sig = g[i] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    out[i] = store(store(g[i] * sig, BF16) * u[i], BF16);
  }
}

void silu_gate_columns(const float* gu, int64_t I, int64_t c0, int64_t c1, float* out, bool bf16) {
  bf16 ? silu_gate_columns<true>(gu, I, c0, c1, out) : silu_gate_columns<false>(gu, I, c0, c1, out);
}

void silu_gate(const float* gu, int64_t R, int64_t I, float* out, bool bf16) {
  for (int64_t r = 0; r < R; ++r) silu_gate_columns(gu + r * 2 * I, I, 0, I, out + r * I, bf16);
}

}  // namespace
