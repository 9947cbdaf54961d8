// Arithmetic every kernel shares: explicit fmas, fp16 and bf16 conversions and rounding, the KV cache's element
// types, the packed weights' format codes, and e^x for x <= 0.
// Part of the CPU kernels, compiled as one translation unit from cpu.cpp, whose opening comment says how every
// kernel stays row-invariant.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

inline float fma_(float a, float b, float c) { return __builtin_fmaf(a, b, c); }

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// 16 fp16 values as floats (exact either way).
inline void halves_to_floats(const uint16_t* h, float* out) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))));
#elif defined(__F16C__)
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8))));
#else
  for (int i = 0; i < 16; ++i) out[i] = half_to_float(h[i]);
#endif
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 16 bf16 values as floats: a bf16 is the upper half of the float it stands for, so widening is a shift, exact.
inline void bf16_to_floats(const uint16_t* h, float* out) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
#elif defined(__AVX2__)
  for (int i = 0; i < 16; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#else
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
    std::memcpy(out + i, &bits, sizeof(bits));
  }
#endif
}

// An fp32 value rounded to the nearest bf16 (ties to even), as a float: PyTorch's float -> bfloat16 conversion
// (c10::BFloat16's round_to_nearest_even, NaN to its quiet NaN), so a value stored "in bf16" here is the one PyTorch
// stores. A bf16 model (Hugging Face's Llama / Qwen2 modeling in bf16, as core/runtime/model.py's PyTorch path runs
// it on CUDA) rounds its activations where it stores a tensor; the decoder in bf16 mode rounds at those points:
// - every linear layer's output: the fp32 accumulation over k (plus the bias) rounded once, as a bf16 GEMM with
//   fp32 accumulation does (q, k, v; the output projection; gate and up; down; the lm_head: bf16 logits);
// - RMSNorm: normalised in fp32, rounded (the cast back to the input's dtype), times the bf16 weight, rounded;
// - the rotary embedding: x * cos and rotate_half(x) * sin each rounded, their sum rounded (cos, sin bf16 values):
//   the keys that go into the cache and the queries;
// - attention's output (scores, softmax and the weighted sum of values in fp32 inside, as a fused attention does);
// - SiLU: silu(gate) rounded, times up, rounded;
// - each residual add.
// The embedding rows, the norms' weights and the cache's keys and values are bf16 values then (a bf16 cache holds
// them exactly; an fp32 one widened).
inline float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, sizeof(bits));
  return x;
}

// A value as a stack in bf16 mode stores it (rounded to bf16), or as it is.
inline float store(float x, bool bf16) { return bf16 ? round_bf16(x) : x; }

// ---------------------------------------------------------------------------------------------------------------
// KV cache elements: fp32, or bf16 (E = uint16_t, the bits), half the bytes a step reads. A key or value is rounded
// to bf16 once, where it is written (PyTorch's rounding, round_bf16), and widened exactly where it is read, or
// multiplied in bf16 pairs (kPairs).
// The bf16 bits of a float holding a bf16 value: its upper half, exactly.
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}
inline void put(float* p, float x) { *p = x; }
inline void put(uint16_t* p, float x) { *p = bf16_bits(round_bf16(x)); }
inline float widen(float x) { return x; }
inline float widen(uint16_t h) { return bf16_to_float(h); }

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 cache elements as floats: fp32 as they are, bf16 widened (a shift, exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// acc[r][x] = fma(s(r), b[8 x ..], acc[r][x]) for RB rows and W vectors of b (8 W cache elements), in 16 registers:
// with 4 vectors a row (at most 3 rows) the rows' broadcasts are held across the vectors, else the vectors across
// the rows.
template <int RB, int W, typename E, typename S>
__attribute__((always_inline)) inline void fma_tile(__m256 (&acc)[RB][W], const E* b, const S& s) {
  if constexpr (W == 4) {
    __m256 sr[RB];
    for (int r = 0; r < RB; ++r) sr[r] = _mm256_set1_ps(s(r));
    for (int x = 0; x < W; ++x) {
      const __m256 bx = load8(b + 8 * x);
      for (int r = 0; r < RB; ++r) acc[r][x] = _mm256_fmadd_ps(sr[r], bx, acc[r][x]);
    }
  } else {
    __m256 bx[W];
    for (int x = 0; x < W; ++x) bx[x] = load8(b + 8 * x);
    for (int r = 0; r < RB; ++r) {
      const __m256 sr = _mm256_set1_ps(s(r));
      for (int x = 0; x < W; ++x) acc[r][x] = _mm256_fmadd_ps(sr, bx[x], acc[r][x]);
    }
  }
}
#endif

// n (a multiple of 16) cache elements as floats: the elements themselves for fp32, else widened into `buf`.
template <typename E>
inline const float* widened(const E* p, int64_t n, float* buf) {
  if constexpr (std::is_same_v<E, float>) {
    return p;
  } else {
    for (int64_t i = 0; i < n; i += 16) bf16_to_floats(p + i, buf + i);
    return buf;
  }
}

// The cache's element type as the kernels take it: fp32 or bf16, keys and values alike.
template <typename F>
auto with_cache_type(const torch::Tensor& k, const torch::Tensor& v, const char* who, F f) {
  const auto t = k.scalar_type();
  TORCH_CHECK(t == v.scalar_type() && (t == at::kFloat || t == at::kBFloat16), who,
              ": keys and values both float32 or both bfloat16");
  if (t == at::kFloat) return f(float{});
  return f(uint16_t{});
}

// 4 consecutive int8 activations as one int32 (broadcast to every lane of an integer dot product).
inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

constexpr int64_t kCols = 16;   // output columns per packed tile
constexpr int64_t kBlock = 32;  // weights per quantization block (along k)
constexpr int kFmtF32 = 0, kFmtQ8_0 = 1, kFmtQ4_1 = 2, kFmtBF16 = 3;

// Quantized formats meet activations quantized per row; fp32 and bf16 weights meet the fp32 activations.
inline bool quantized(int fmt) { return fmt == kFmtQ8_0 || fmt == kFmtQ4_1; }

// ---------------------------------------------------------------------------------------------------------------
// exp(x) for x <= 0, written so the compiler vectorises it: e^x = 2^i * e^f with i = round(x log2 e), |f| <= ln(2)/2,
// e^f from its Taylor series to degree 8 (relative error < 1e-8, under float rounding).
constexpr float kMinExp = -87.0f;  // exp below this is under float's normal range: counted as 0

__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float t = (x > kMinExp ? x : kMinExp) * 1.44269504088896341f;
  const float i = __builtin_floorf(t + 0.5f);
  const float f = (t - i) * 0.693147180559945309f;
  float p = 1.0f / 40320.0f;
  p = fma_(p, f, 1.0f / 5040.0f);
  p = fma_(p, f, 1.0f / 720.0f);
  p = fma_(p, f, 1.0f / 120.0f);
  p = fma_(p, f, 1.0f / 24.0f);
  p = fma_(p, f, 1.0f / 6.0f);
  p = fma_(p, f, 0.5f);
  p = fma_(p, f, 1.0f);
  p = fma_(p, f, 1.0f);
  int32_t bits = (static_cast<int32_t>(i) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < kMinExp ? 0.0f : p * scale;
}

}  // namespace
