// The CPU decoder's kernels: linear layers over packed fp32, bf16 or 4/8-bit weights, attention over the KV cache in
// each row's logical key order, and the per-row glue (RMSNorm, rotary embedding, SiLU gate, residuals), with a whole
// decoder stack in one call; beside it the step's smaller work: the draw, the drafts' ranking, the root head's step,
// embedding lookups and moving a verified path's keys and values into place. Activations are fp32 whatever the
// weights' format, or, for a bf16 model, rounded to bf16 where a bf16 model on CUDA stores them (round_bf16 lists
// where): the same numerics, computed here.
//
// Every kernel here is row-invariant by construction: a row's result is the same sequence of float operations
// whatever other rows share the call, however many threads run and wherever the row's keys sit in the cache. So a
// one-token step, a verified token tree and a prefill chunk give a position the same floats, and TokenSwift's
// tokens equal vanilla decoding's. How:
// - work is split over output columns (linear), (head, key chunk) tasks (attention) or a row's elements (the glue),
//   never inside a row's sum: a thread that normalises part of a row computes the row's sum of squares whole;
// - every multiply-add is an explicit fma, or a bf16 pair's dot product in a fixed order (kPairs) (the file is built
//   with -ffp-contract=off, so nothing else is fused);
// - bf16 weights and bf16 keys and values widen to fp32 exactly (a bf16 is a float's upper 16 bits) and then take
//   the fp32 arithmetic, or the pairs' products;
// - integer dot products (quantized weights) are exact, whatever instruction computes them;
// - a row's accumulator over k (or over keys) always runs in the same order, in one vector lane of its own;
// - reductions along a row (sums of squares, softmax sums) are per-row code with a fixed trip count, in one
//   compiled function where more than one thread computes them;
// - rounding to bf16 is a function of the one element it rounds.
// The file is compiled once per instruction set level (build.py): AVX-512 with VNNI, AVX2, or plain C++.
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
// Threads. A kernel's work is a range of tasks (a linear layer's tiles, attention's (head, chunk) pairs, rows), cut
// into one contiguous part per thread. A single kernel call runs its parts through at::parallel_for; the decoder
// stack runs all its layers in one OpenMP region whose threads (a Team) take their parts of each phase and meet at a
// barrier: starting a region for every phase (181 per forward) cost a sizeable share of a one-token step, the
// caches cold after each phase's stream. Inside the region a thread that has finished its part takes tasks from
// another's (run_tasks). Which thread computes a task never changes a float.

// A team thread's claim on its share of a phase's tasks, on a cache line of its own: the phase it is of (counted
// from 1 in the team's region, which has far fewer than 2^24 phases) and what is left of the share, [begin, end), in
// one word (24 | 20 | 20 bits), so a claim is one compare-and-swap.
struct alignas(64) Claim {
  std::atomic<uint64_t> word{0};
  static constexpr int64_t kMost = int64_t{1} << 20;  // tasks a phase may have to be claimed (else a fixed split)
  static uint64_t pack(uint64_t phase, int64_t begin, int64_t end) {
    return phase << 40 | static_cast<uint64_t>(begin) << 20 | static_cast<uint64_t>(end);
  }
  static uint64_t phase_of(uint64_t w) { return w >> 40; }
  static int64_t begin_of(uint64_t w) { return static_cast<int64_t>(w >> 20 & (kMost - 1)); }
  static int64_t end_of(uint64_t w) { return static_cast<int64_t>(w & (kMost - 1)); }
};

// Tasks a team's thread has taken from another thread's share, since the module was loaded (tests read it).
std::atomic<int64_t> tasks_taken{0};

struct Team {
  int id = 0, size = 1;
  Claim* claims = nullptr;  // one per thread, shared by the team (see run_tasks)
  mutable uint64_t phase = 0;  // the phases this thread has entered: the same count on every thread of the team
  void sync() const {
#ifdef _OPENMP
    if (size > 1) {
#pragma omp barrier
    }
#endif
  }
  static Team current(Claim* claims) {
#ifdef _OPENMP
    return {omp_get_thread_num(), omp_get_num_threads(), claims};
#else
    return {0, 1, claims};
#endif
  }
};

// Part `part` of `parts` of n equal-cost tasks.
inline std::pair<int64_t, int64_t> equal_part(int64_t n, int64_t part, int64_t parts) {
  return {n * part / parts, n * (part + 1) / parts};
}

// Part `part` of `parts` of tasks of unequal cost (cost[t]: the cost of the tasks before t; cost.back(), all of
// them): each cut where the cumulative cost comes nearest to an equal share.
inline std::pair<int64_t, int64_t> cost_part(const std::vector<int64_t>& cost, int64_t part, int64_t parts) {
  const int64_t tasks = static_cast<int64_t>(cost.size()) - 1;
  auto cut = [&](int64_t p) {
    if (p == 0) return int64_t{0};
    if (p == parts) return tasks;
    const int64_t total = cost.back();
    int64_t t = 0;
    while (cost[t] * parts < total * p) ++t;  // the first task at or past the share
    return t > 0 && total * p - cost[t - 1] * parts < cost[t] * parts - total * p ? t - 1 : t;
  };
  return {cut(part), cut(part + 1)};
}

// f(begin, end) over each thread's part (share(part, parts) -> [begin, end)): the team's, then a barrier, or, with no
// team, at::parallel_for's threads.
template <typename Share, typename F>
void run_parts(const Team* team, const Share& share, const F& f) {
  if (team != nullptr) {
    const auto [begin, end] = share(team->id, team->size);
    if (begin < end) f(begin, end);
    team->sync();
    return;
  }
  const int64_t parts = at::get_num_threads();
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t part = p0; part < p1; ++part) {
      const auto [begin, end] = share(part, parts);
      if (begin < end) f(begin, end);
    }
  });
}

// run_parts for tasks that may run in any grouping (each task's floats its own): a team's thread starts on its
// share, taking a quarter of what is left of it at a time from the front, and with none left takes half of what is
// left of another thread's share from the back, so a thread slowed this time (the memory's jitter, another process)
// does not leave the others waiting at the barrier. A share not yet begun is claimed as share() gives it: the
// barrier closing each phase means a claim of an earlier phase is spent.
template <typename Share, typename F>
void run_tasks(const Team* team, int64_t tasks, const Share& share, const F& f) {
  if (team == nullptr || team->size == 1 || tasks >= Claim::kMost)
    return run_parts(team, share, f);
  const uint64_t phase = ++team->phase & 0xFFFFFF;
  // [begin, end) taken from thread v's share: `front` (its own) a quarter of what is left, else half from the back
  auto take = [&](int v, bool front) -> std::pair<int64_t, int64_t> {
    std::atomic<uint64_t>& word = team->claims[v].word;
    uint64_t w = word.load(std::memory_order_acquire);
    while (true) {
      int64_t b, e;
      if (Claim::phase_of(w) == phase) {
        b = Claim::begin_of(w), e = Claim::end_of(w);
      } else {
        std::tie(b, e) = share(v, team->size);
      }
      if (b >= e) return {0, 0};
      const int64_t left = e - b;
      const int64_t cut = front ? b + (left + 3) / 4 : e - (left + 1) / 2;
      const uint64_t next = front ? Claim::pack(phase, cut, e) : Claim::pack(phase, b, cut);
      if (!word.compare_exchange_weak(w, next, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      if (front) return {b, cut};
      tasks_taken.fetch_add(e - cut, std::memory_order_relaxed);
      return {cut, e};
    }
  };
  for (int step = 0; step < team->size; ++step) {  // its own share first, then the others'
    const int v = (team->id + step) % team->size;
    for (auto [b, e] = take(v, step == 0); b < e; std::tie(b, e) = take(v, step == 0)) f(b, e);
  }
  team->sync();
}

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

// ---------------------------------------------------------------------------------------------------------------
// Activations for the integer dot products: each row of x in blocks of 32, q = round(x / d) with d = max|x| / 127,
// and per block d, the sum of q, and d * sum(q) (the min term of 4-bit weights).
struct QuantRows {
  int64_t rows = 0, k = 0, blocks = 0;
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> sum;

  void size_for(int64_t rows_, int64_t k_) {
    rows = rows_;
    k = k_;
    blocks = k / kBlock;
    q.resize(rows * k);
    d.resize(rows * blocks);
    ds.resize(rows * blocks);
    sum.resize(rows * blocks);
  }
};

// One block of 32: q = round(x / d) (ties to even) with d = max|x| / 127, the sum of q.
inline void quantize_block(const float* xb, int8_t* qb, float& d, int32_t& sum) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f), vid = _mm512_set1_ps(id);
  auto round_clamped = [&](__m512 v) {
    v = _mm512_roundscale_ps(_mm512_mul_ps(v, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
  };
  const __m512i qa = round_clamped(a), qb_ = round_clamped(b);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(qb_));
  d = amax / 127.0f;
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb_));
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], lanes = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    lanes = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), lanes);
  }
  float lane[8];
  _mm256_storeu_ps(lane, lanes);
  float amax = 0.0f;
  for (int l = 0; l < 8; ++l) amax = lane[l] > amax ? lane[l] : amax;
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f), vid = _mm256_set1_ps(id);
  __m256i q[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {  // rounded to nearest, ties to even, as nearbyint; then clamped
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    total = _mm256_add_epi32(total, q[i]);
  }
  // 32 int32 in -127..127 to int8, in order: packs interleave 128-bit lanes, the permute puts them back
  const __m256i words = _mm256_packs_epi32(q[0], q[1]), words2 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), bytes);
  int32_t t[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), total);
  sum = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
  d = amax / 127.0f;
#else
  float lane[16] = {};  // |x| maxima in 16 lanes, so the loop vectorises (a maximum is the same in any order)
  for (int i = 0; i < kBlock; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] = std::fabs(xb[i + l]) > lane[l] ? std::fabs(xb[i + l]) : lane[l];
  float amax = 0.0f;
  for (int l = 0; l < 16; ++l) amax = lane[l] > amax ? lane[l] : amax;
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    float v = std::nearbyint(xb[i] * id);
    v = std::min(127.0f, std::max(-127.0f, v));
    qb[i] = static_cast<int8_t>(v);
    sum += qb[i];
  }
  d = amax / 127.0f;
#endif
}

// Columns [c0, c1) (multiples of 32) of row r of x [out.rows, out.k] into `out` (sized by size_for): per block d,
// the sum of q, and d * sum(q) (the min term of 4-bit weights).
void quantize_columns(const float* x, int64_t r, int64_t c0, int64_t c1, QuantRows& out) {
  for (int64_t b = c0 / kBlock; b < c1 / kBlock; ++b) {
    const int64_t at = r * out.blocks + b;
    quantize_block(x + r * out.k + b * kBlock, &out.q[r * out.k + b * kBlock], out.d[at], out.sum[at]);
    out.ds[at] = out.d[at] * static_cast<float>(out.sum[at]);
  }
}

// Rows [r0, r1) of x, whole.
void quantize_rows(const float* x, int64_t r0, int64_t r1, QuantRows& out) {
  for (int64_t r = r0; r < r1; ++r) quantize_columns(x, r, 0, out.k, out);
}

// ---------------------------------------------------------------------------------------------------------------
// Linear layers. A packed weight holds ceil(N / 16) tiles of 16 output columns:
// - fp32: [T, K, 16] floats;
// - bf16: [T, K, 16] bf16 values, widened to fp32 in registers (half of fp32's bytes to read, the same arithmetic);
// - q8_0: int8 [T, K/32, 8, 16, 4] (per block, per group of 4 k: the 16 columns' 4 values), fp16 scales [T, K/32, 16];
// - q4_1: uint8 [T, K/32, 4, 16, 4], the low nibble holding k-group g, the high nibble k-group g + 4, fp16 scales
//   and mins [T, K/32, 16] (w = d * q + m, q in 0..15).
// Per (row, column) the result is sum over blocks, in order, of fma(isum, d_w * d_x, acc) (then fma(m_w, d_x * sum
// q_x, acc) for q4_1), isum being the block's exact integer dot product; for fp32 and bf16 weights an fma per k, in
// order (a bf16 tile computes exactly what an fp32 tile of the same weights, widened, computes).

struct Linear {
  int fmt;
  int64_t n, k;
  const float* f32 = nullptr;
  const uint16_t* bf16 = nullptr;
  const int8_t* q8 = nullptr;
  const uint8_t* q4 = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* m = nullptr;
  const float* bias = nullptr;
};

// fp32 or bf16 tile: out[r][c] = sum_k x[r][k] * w[k][c], RB rows, the tile's K x 16 weights read once for all of
// them. W is float or uint16_t (bf16 bits); a bf16 row of 16 weights is widened first, then multiplied as fp32.
template <int RB, typename W>
inline void dense_tile(const float* x, int64_t ldx, const W* w, int64_t K, float (&acc)[RB][kCols]) {
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
  float widened[kCols];
  for (int64_t k = 0; k < K; ++k) {
    const float* wk;
    if constexpr (std::is_same_v<W, float>) {
      wk = w + k * kCols;
    } else {
      bf16_to_floats(w + k * kCols, widened);
      wk = widened;
    }
    for (int r = 0; r < RB; ++r) {
      const float xk = x[r * ldx + k];
#pragma omp simd
      for (int c = 0; c < kCols; ++c) acc[r][c] = fma_(xk, wk[c], acc[r][c]);
    }
  }
}

// Integer dot products of RB quantized rows with one 32-block of a tile: isum[r][c]. The portable loops: a build
// for AVX2 or AVX-512 runs the register tiles below instead, whose integer sums are these.
template <int RB>
inline void q8_block(const int8_t* w, const QuantRows& x, int64_t r0, int64_t b, int32_t (&isum)[RB][kCols]) {
  for (int r = 0; r < RB; ++r) {
    const int8_t* xq = &x.q[(r0 + r) * x.k + b * kBlock];
    for (int c = 0; c < kCols; ++c) {
      int32_t s = 0;
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 4; ++j) s += static_cast<int32_t>(w[g * 64 + c * 4 + j]) * xq[g * 4 + j];
      isum[r][c] = s;
    }
  }
}

template <int RB>
inline void q4_block(const uint8_t* w, const QuantRows& x, int64_t r0, int64_t b, int32_t (&isum)[RB][kCols]) {
  for (int r = 0; r < RB; ++r) {
    const int8_t* xq = &x.q[(r0 + r) * x.k + b * kBlock];
    for (int c = 0; c < kCols; ++c) {
      int32_t s = 0;
      for (int g = 0; g < 4; ++g)
        for (int j = 0; j < 4; ++j) {
          const uint8_t byte = w[g * 64 + c * 4 + j];
          s += static_cast<int32_t>(byte & 0x0F) * xq[g * 4 + j] + static_cast<int32_t>(byte >> 4) * xq[(g + 4) * 4 + j];
        }
      isum[r][c] = s;
    }
  }
}

constexpr int64_t kAhead = 8;  // blocks of a quantized tile prefetched ahead (the register tiles below)

// One tile of a quantized weight, block by block, for the register tiles: a block's weights, fp16 scales and mins,
// and the block kAhead on requested while this one is multiplied, far enough ahead that memory's latency is
// hidden, not only the cache's.
template <bool Q4>
struct QuantTile {
  static constexpr int64_t bytes = Q4 ? 256 : 512;  // one block of the tile: 32 k x 16 columns
  int64_t blocks;
  const uint8_t* w;
  const uint16_t* d;
  const uint16_t* m;

  QuantTile(const Linear& L, int64_t t)
      : blocks(L.k / kBlock),
        w((Q4 ? L.q4 : reinterpret_cast<const uint8_t*>(L.q8)) + t * blocks * bytes),
        d(L.d + t * blocks * kCols),
        m(Q4 ? L.m + t * blocks * kCols : nullptr) {}

  const uint8_t* block(int64_t b) const { return w + b * bytes; }
  const uint16_t* scales(int64_t b) const { return d + b * kCols; }
  const uint16_t* mins(int64_t b) const { return m + b * kCols; }

  void fetch_ahead(int64_t b) const {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(block(b + kAhead) + line, 0, 3);
    __builtin_prefetch(scales(b + kAhead), 0, 3);
    if constexpr (Q4) __builtin_prefetch(mins(b + kAhead), 0, 3);
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The quantized tile with every accumulator in a register: the same arithmetic as tile_rows' portable loop (each
// block's exact integer dot product, then fma(isum, d_w * d_x, acc), then fma(m_w, d_x * sum q_x, acc) for q4_1).
template <int RB, bool Q4>
void quant_tile_avx512(const Linear& L, int64_t t, const QuantRows& xq, int64_t r0, float (&out)[RB][kCols]) {
  const QuantTile<Q4> tile(L, t);
  const int64_t B = tile.blocks;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = tile.block(b);
    tile.fetch_ahead(b);
    __m512i w[8];
    if constexpr (Q4) {
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(wb + g * 64);
        w[g] = _mm512_and_si512(v, low);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {  // dpbusd takes unsigned weights: (w + 128) . x = w . x + 128 * sum(x)
      for (int g = 0; g < 8; ++g) w[g] = _mm512_xor_si512(_mm512_loadu_si512(wb + g * 64), flip);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile.scales(b))));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (Q4) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile.mins(b))));
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xr = &xq.q[row * xq.k + b * kBlock];
      // two independent chains of dot products (integer sums: any order gives the same)
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(load4(xr + 4 * g)));
        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(load4(xr + 4 * g + 4)));
      }
      __m512i s = _mm512_add_epi32(s0, s1);
      if constexpr (!Q4) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * xq.sum[row * B + b]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xq.d[row * B + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
      if constexpr (Q4) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xq.ds[row * B + b]), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(out[r], acc[r]);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// The 8-bit tile on AVX2: the same arithmetic as tile_rows' portable loop, with a block's weights held in registers
// for all RB rows, one half-tile (8 columns) at a time. A product of two int8 can reach 2 * 128 * 127 per maddubs
// lane, so each is widened before the next is added: |w| times x signed as w.
template <int RB>
void q8_tile_avx2(const Linear& L, int64_t t, const QuantRows& xq, int64_t r0, float (&out)[RB][kCols]) {
  const QuantTile<false> tile(L, t);
  const int64_t B = tile.blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = tile.block(b);
    tile.fetch_ahead(b);
    for (int h = 0; h < 2; ++h) {
      __m256i w[8];  // |w|, shared by the rows; each row takes w's signs from the block (in L1 by then)
      for (int g = 0; g < 8; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + h * 32));
        w[g] = _mm256_sign_epi8(v, v);
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile.scales(b) + h * 8)));
      for (int r = 0; r < RB; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xr = &xq.q[row * xq.k + b * kBlock];
        __m256i s = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
          const __m256i signs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + h * 32));
          const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(load4(xr + 4 * g)), signs);
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w[g], xv), ones));
        }
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xq.d[row * B + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r][h]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(out[r], acc[r][0]);
    _mm256_storeu_ps(out[r] + 8, acc[r][1]);
  }
}

// G <= 4 rows of one 4-bit block of a tile, both half-tiles at once: each 4-k group's weights unpacked once for the
// G rows, each row's 4 k of x broadcast once for the 16 columns, and every row's sums in registers. A block's eight
// 4-k products are summed in int16 before widening: each maddubs lane is at most 2 * 15 * 128 in magnitude, so
// eight of them stay below 32768, exact. Then the same float arithmetic as tile_rows' portable loop.
template <int G>
inline void q4_rows_avx2(const uint8_t* wb, const __m256 (&dw)[2], const __m256 (&mw)[2], const QuantRows& xq,
                         int64_t row0, int64_t b, __m256 (*acc)[2]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int8_t* xr[G];
  for (int r = 0; r < G; ++r) xr[r] = &xq.q[(row0 + r) * xq.k + b * kBlock];
  __m256i p[G][2];
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {  // k 4g .. 4g + 3 in the low nibbles, 16 + 4g .. in the high ones
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + g * 64 + 32));
    const __m256i l0 = _mm256_and_si256(v0, low), l1 = _mm256_and_si256(v1, low);
#pragma GCC unroll 4
    for (int r = 0; r < G; ++r) {
      const __m256i x = _mm256_set1_epi32(load4(xr[r] + 4 * g));
      const __m256i a = _mm256_maddubs_epi16(l0, x), c = _mm256_maddubs_epi16(l1, x);
      p[r][0] = g == 0 ? a : _mm256_add_epi16(p[r][0], a);
      p[r][1] = g == 0 ? c : _mm256_add_epi16(p[r][1], c);
      // GCC otherwise regroups the (exact) integer sums, holding every product until the end: spilled to the stack
      asm("" : "+x"(p[r][0]), "+x"(p[r][1]));
    }
    const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
    const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#pragma GCC unroll 4
    for (int r = 0; r < G; ++r) {
      const __m256i x = _mm256_set1_epi32(load4(xr[r] + 16 + 4 * g));
      p[r][0] = _mm256_add_epi16(p[r][0], _mm256_maddubs_epi16(h0, x));
      p[r][1] = _mm256_add_epi16(p[r][1], _mm256_maddubs_epi16(h1, x));
      asm("" : "+x"(p[r][0]), "+x"(p[r][1]));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t B = xq.blocks;
#pragma GCC unroll 4
  for (int r = 0; r < G; ++r) {
    const __m256 dx = _mm256_set1_ps(xq.d[(row0 + r) * B + b]), ds = _mm256_set1_ps(xq.ds[(row0 + r) * B + b]);
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p[r][h], ones));
      acc[r][h] = _mm256_fmadd_ps(s, _mm256_mul_ps(dw[h], dx), acc[r][h]);
      acc[r][h] = _mm256_fmadd_ps(mw[h], ds, acc[r][h]);
    }
  }
}

// Rows R0 .. RB - 1 of one 4-bit block in near-equal groups of at most 4 (four rows' sums and a group's unpacked
// weights fill AVX2's 16 registers).
template <int RB, int R0>
inline void q4_groups_avx2(const uint8_t* wb, const __m256 (&dw)[2], const __m256 (&mw)[2], const QuantRows& xq,
                           int64_t r0, int64_t b, __m256 (*acc)[2]) {
  constexpr int left = RB - R0, groups = (left + 3) / 4, G = (left + groups - 1) / groups;
  q4_rows_avx2<G>(wb, dw, mw, xq, r0 + R0, b, acc + R0);
  if constexpr (R0 + G < RB) q4_groups_avx2<RB, R0 + G>(wb, dw, mw, xq, r0, b, acc);
}

// The 4-bit tile on AVX2, block by block.
template <int RB>
void q4_tile_avx2(const Linear& L, int64_t t, const QuantRows& xq, int64_t r0, float (&out)[RB][kCols]) {
  const QuantTile<true> tile(L, t);
  __m256 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < tile.blocks; ++b) {
    tile.fetch_ahead(b);
    __m256 dw[2], mw[2];
    for (int h = 0; h < 2; ++h) {
      dw[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile.scales(b) + h * 8)));
      mw[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile.mins(b) + h * 8)));
    }
    q4_groups_avx2<RB, 0>(tile.block(b), dw, mw, xq, r0, b, acc);
  }
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(out[r], acc[r][0]);
    _mm256_storeu_ps(out[r] + 8, acc[r][1]);
  }
}
#endif

// One tile, RB rows: acc[r][c] over the whole of k.
template <int RB>
void tile_rows(const Linear& L, int64_t t, const float* x, const QuantRows& xq, int64_t r0, float (&acc)[RB][kCols]) {
  if (L.fmt == kFmtF32) return dense_tile<RB>(x + r0 * L.k, L.k, L.f32 + t * L.k * kCols, L.k, acc);
  if (L.fmt == kFmtBF16) return dense_tile<RB>(x + r0 * L.k, L.k, L.bf16 + t * L.k * kCols, L.k, acc);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (L.fmt == kFmtQ4_1) return quant_tile_avx512<RB, true>(L, t, xq, r0, acc);
  return quant_tile_avx512<RB, false>(L, t, xq, r0, acc);
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (L.fmt == kFmtQ4_1) return q4_tile_avx2<RB>(L, t, xq, r0, acc);
  return q8_tile_avx2<RB>(L, t, xq, r0, acc);
#endif
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
  const int64_t B = L.k / kBlock;
  int32_t isum[RB][kCols];
  for (int64_t b = 0; b < B; ++b) {
    float dw[kCols], mw[kCols];
    halves_to_floats(L.d + (t * B + b) * kCols, dw);
    if (L.fmt == kFmtQ4_1) {
      halves_to_floats(L.m + (t * B + b) * kCols, mw);
      q4_block<RB>(L.q4 + (t * B + b) * 256, xq, r0, b, isum);
    } else {
      q8_block<RB>(L.q8 + (t * B + b) * 512, xq, r0, b, isum);
    }
    for (int r = 0; r < RB; ++r) {
      const float dx = xq.d[(r0 + r) * B + b];
#pragma omp simd
      for (int c = 0; c < kCols; ++c) acc[r][c] = fma_(static_cast<float>(isum[r][c]), dw[c] * dx, acc[r][c]);
      if (L.fmt == kFmtQ4_1) {
        const float ds = xq.ds[(r0 + r) * B + b];
#pragma omp simd
        for (int c = 0; c < kCols; ++c) acc[r][c] = fma_(mw[c], ds, acc[r][c]);
      }
    }
  }
}

// With `add`, out += y, rounded as the stack stores a residual sum (a residual connection, y rounded first).
template <int RB>
void tile_store(const Linear& L, int64_t t, const float* x, const QuantRows& xq, int64_t r0, float* out, bool bf16,
                bool add) {
  float acc[RB][kCols];
  tile_rows<RB>(L, t, x, xq, r0, acc);
  const int64_t c0 = t * kCols, width = std::min(kCols, L.n - c0);
  for (int r = 0; r < RB; ++r)
    for (int64_t c = 0; c < width; ++c) {
      float& o = out[(r0 + r) * L.n + c0 + c];
      const float y = store(L.bias ? acc[r][c] + L.bias[c0 + c] : acc[r][c], bf16);
      o = add ? store(o + y, bf16) : y;
    }
}

// Tiles [t0, t1) of y [R, N] = x [R, K] W^T (+ bias) (xq: x quantized, for quantized weights), rounded to bf16 once
// at the end if `bf16`, into out (or, with `add`, added to it). Each tile's rows in near-equal blocks of at most 6
// (fp32, bf16: 6 x 16 accumulators fill AVX2's registers) or 8 (quantized) rows sharing every loaded weight.
void linear_tiles(const Linear& L, const float* x, const QuantRows& xq, int64_t R, int64_t t0, int64_t t1, float* out,
                  bool bf16, bool add) {
  const int64_t most = quantized(L.fmt) ? 8 : 6;
  const int64_t blocks = (R + most - 1) / most;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t b = 0, r = 0; b < blocks; ++b) {
      const int64_t rows = (R - r + blocks - b - 1) / (blocks - b);
      switch (rows) {
        case 1: tile_store<1>(L, t, x, xq, r, out, bf16, add); break;
        case 2: tile_store<2>(L, t, x, xq, r, out, bf16, add); break;
        case 3: tile_store<3>(L, t, x, xq, r, out, bf16, add); break;
        case 4: tile_store<4>(L, t, x, xq, r, out, bf16, add); break;
        case 5: tile_store<5>(L, t, x, xq, r, out, bf16, add); break;
        case 6: tile_store<6>(L, t, x, xq, r, out, bf16, add); break;
        case 7: tile_store<7>(L, t, x, xq, r, out, bf16, add); break;
        default: tile_store<8>(L, t, x, xq, r, out, bf16, add); break;
      }
      r += rows;
    }
  }
}

// The whole of y = x W^T (into out, or with `add` added to it) over the threads: `team`'s (xq already made from x by
// the caller) or at::parallel_for's.
void linear_into(const Linear& L, const float* x, int64_t R, float* out, bool bf16, const Team* team = nullptr,
                 const QuantRows* xq = nullptr, bool add = false) {
  QuantRows own;
  if (xq == nullptr) {
    if (quantized(L.fmt)) {
      own.size_for(R, L.k);
      quantize_rows(x, 0, R, own);
    }
    xq = &own;
  }
  const int64_t T = (L.n + kCols - 1) / kCols;
  run_tasks(team, T, [&](int64_t part, int64_t parts) { return equal_part(T, part, parts); },
            [&](int64_t t0, int64_t t1) { linear_tiles(L, x, *xq, R, t0, t1, out, bf16, add); });
}

Linear linear_from(int64_t fmt, const torch::Tensor& a, const torch::Tensor& d, const torch::Tensor& m,
                   const torch::Tensor& bias, int64_t n, int64_t k) {
  Linear L;
  L.fmt = static_cast<int>(fmt);
  L.n = n;
  L.k = k;
  const int64_t T = (n + kCols - 1) / kCols;
  TORCH_CHECK(a.is_contiguous(), "linear: packed weight must be contiguous");
  if (L.fmt == kFmtF32) {
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.numel() == T * k * kCols, "linear: fp32 tiles [T, K, 16]");
    L.f32 = a.data_ptr<float>();
  } else if (L.fmt == kFmtBF16) {
    TORCH_CHECK(a.scalar_type() == at::kBFloat16 && a.numel() == T * k * kCols, "linear: bf16 tiles [T, K, 16]");
    L.bf16 = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(k % kBlock == 0, "linear: quantized weights need K a multiple of 32");
    TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.numel() == T * (k / kBlock) * kCols,
                "linear: scales [T, K/32, 16] fp16");
    L.d = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
    if (L.fmt == kFmtQ8_0) {
      TORCH_CHECK(a.scalar_type() == at::kChar && a.numel() == T * k * kCols, "linear: q8_0 tiles");
      L.q8 = a.data_ptr<int8_t>();
    } else {
      TORCH_CHECK(L.fmt == kFmtQ4_1, "linear: unknown weight format ", fmt);
      TORCH_CHECK(a.scalar_type() == at::kByte && a.numel() == T * k * kCols / 2, "linear: q4_1 tiles");
      TORCH_CHECK(m.is_contiguous() && m.scalar_type() == at::kHalf && m.numel() == d.numel(), "linear: q4_1 mins");
      L.q4 = a.data_ptr<uint8_t>();
      L.m = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
    }
  }
  if (bias.defined() && bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n, "linear: bias [N]");
    L.bias = bias.data_ptr<float>();
  }
  return L;
}

// The largest of v[0 .. n) (-inf if none), 16 lanes at a time; a maximum is the same in any order (v holds no NaN).
inline float max_of(const float* v, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 lanes = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(v + i));
  m = _mm512_reduce_max_ps(lanes);
#elif defined(__AVX2__)
  __m256 lanes = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(v + i));
  float lane[8];
  _mm256_storeu_ps(lane, lanes);
  for (float x : lane) m = x > m ? x : m;
#endif
  for (; i < n; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// ---------------------------------------------------------------------------------------------------------------
// Attention of a block of n new tokens (rows: the G query heads of each KV head times the n tokens, row g * n + i)
// over the keys each may see, taken in logical order: the `past` committed keys (slot = position), then the token's
// own ancestors in the block and itself (vis[i][j], in order of j), wherever in the block they sit. The keys are
// split into chunks of 256 logical positions; each chunk's partial softmax is exact, and the chunks are merged in
// order. A row's result depends only on its query and its logical key sequence.

constexpr int64_t kChunk = 256;
// Keys and values are prefetched into L2 (prefetcht1), not L1: a core has few L1 misses in flight, and streams
// that waited on them ran at a fraction of the memory's rate.
constexpr int kCacheToL2 = 2;
constexpr int64_t kTile = 64;  // keys per score tile, and per tile of the cache's keys

// The cache stores each head's keys tile-major, [S / kTile, D, kTile]: a tile holds its kTile keys' D elements,
// element j of all of them together (so a score tile vectorises along the keys), in one contiguous block (8 KB of
// bf16 at D = 64): a single stream, which the memory system follows at its full rate, where keys transposed over the
// whole cache ([D, S]) made each of a tile's D rows a stream of its own. Element j of the key in `slot` sits at
// key_offset(slot, D) + j * kTile among its head's keys.
inline int64_t key_offset(int64_t slot, int64_t D) { return slot / kTile * (D * kTile) + slot % kTile; }

// Keys are fetched this many bytes ahead of the tile being multiplied: two tiles of bf16, one of fp32.
template <typename E>
constexpr int64_t kKeyTilesAhead = 4 / sizeof(E);

#if defined(__AVX512F__)
// round_bf16 on 16 floats' bits.
inline __m512i round_bf16_16(__m512i bits) {
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd),
                                           _mm512_set1_epi32(0xFFFF0000u));
  const __m512 x = _mm512_castsi512_ps(bits);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}

// e^x on 16 lanes, for x <= 0 where `live` (0 elsewhere, and below kMinExp): 2^t with t = x log2 e = i + g, i =
// round(t), |g| <= 1/2, 2^g from its Taylor series to degree 7 (relative error < 1e-8, under float rounding), scaled
// by 2^i (vscalefps). Every result is 0 or a normal float: e^x >= 2^-125.5 above kMinExp.
inline __m512 exp16(__m512 x, __mmask16 live) {
  const __m512 lowest = _mm512_set1_ps(kMinExp);
  live = _mm512_mask_cmp_ps_mask(live, x, lowest, _CMP_NLT_UQ);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, lowest), _mm512_set1_ps(1.44269504088896341f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 g = _mm512_sub_ps(t, i);
  // ln(2)^k / k!, k = 7 .. 0
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  for (const float c : {1.5403530393381606e-04f, 1.3333558146428443e-03f, 9.6181291076284772e-03f,
                        5.5504108664821580e-02f, 2.4022650695910071e-01f, 6.9314718055994531e-01f, 1.0f})
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(c));
  return _mm512_maskz_scalef_ps(live, p, i);
}

// A chunk's softmax numerators e = exp(s - m) of its first `count` scores s (0 past them), returning their sum: over
// the whole chunk in one order whatever count is (16 lanes, then the lanes'). Written over s, rounded to bf16 with
// `round` (to nearest even, as round_bf16: every e is 0 or a normal float); or, given wp (the values on vdpbf16ps),
// there alone, rounded, as value_tile_bf16 reads them: wp[i] = (e[2i], e[2i+1]), the bf16 values in order.
inline float softmax_chunk(float* s, int64_t count, float m, bool round, int32_t* wp) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  __m512 even = sum;  // the pair's first 16
#endif
  for (int64_t l = 0; l < kChunk; l += 16) {
    const __mmask16 live = static_cast<__mmask16>((1u << std::clamp<int64_t>(count - l, 0, 16)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), mv), live);
    sum = _mm512_add_ps(sum, e);
#if defined(__AVX512BF16__)
    if (wp != nullptr) {
      if (l % 32 == 16) _mm512_storeu_si512(wp + (l - 16) / 2, (__m512i)_mm512_cvtne2ps_pbh(e, even));
      even = e;
      continue;
    }
#endif
    _mm512_storeu_ps(s + l, round ? _mm512_castsi512_ps(round_bf16_16(_mm512_castps_si512(e))) : e);
  }
  return _mm512_reduce_add_ps(sum);
}
#endif

// Attention over a bf16 cache multiplies bf16 by bf16, in pairs: the scores take the query in bf16 too (rounded
// once, scale included) and the weighted sum of values takes the weights (exp(s - m), before the chunk's sum) in
// bf16 (`bf16_products`; a bf16 model's stack computes in fp32 over the widened keys and values instead, as a
// fused attention on CUDA does inside). A sum over pairs (i = 0, 2, 4, .. along j, or along the chunk's logical
// keys) takes, per pair, acc + x[i+1] y[i+1], rounded, + x[i] y[i], rounded (both products exact), pairs in order:
// what AVX-512 BF16's dot product (vdpbf16ps) computes; a CPU without it takes the two fmas. Over an fp32 cache
// everything is fp32 and runs in order.
template <typename E>
constexpr bool kPairs = !std::is_same_v<E, float>;  // whether a cache of E can be multiplied in pairs

// Whether the values' pairs can run on vdpbf16ps (in slices of 64 elements), or only widened through fmas.
template <int D>
#if defined(__AVX512BF16__)
constexpr bool kValuePairs = D % 64 == 0;
#else
constexpr bool kValuePairs = false;
#endif

#if defined(__AVX512BF16__)
// Seconds of `reps` rounds of 24 independent multiply-adds on registers (f: acc -> acc), the fastest of 3.
template <typename F>
double timed_rounds(F f, int64_t reps) {
  double best = 1e30;
  for (int trial = 0; trial < 3; ++trial) {
    __m512 acc[24];
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_set1_ps(1e-3f * static_cast<float>(i));
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t rep = 0; rep < reps; ++rep) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) acc[i] = f(acc[i]);
      __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[5]), "+v"(acc[11]), "+v"(acc[17]), "+v"(acc[23]));
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    float sink[16];
    _mm512_storeu_ps(sink, acc[trial]);
    __asm__ volatile("" : : "r"(sink) : "memory");
  }
  return best;
}
#endif

// Whether bf16 pairs are multiplied on vdpbf16ps, or as two fmas over the widened values: the same floats (both
// products of a pair are exact, and the fmas take them in vdpbf16ps's order), so this only picks the faster. Some
// CPUs issue vdpbf16ps at a fraction of their fma rate, where two fmas per pair are faster; others at the fmas'
// rate, where the dot product is. Timed once, on registers (about a millisecond); TOKENSWIFT_BF16_DOTS=on|off
// decides instead, and set_bf16_dots for a test.
std::atomic<int> g_bf16_dots{-1};  // -1: not chosen yet

bool bf16_dots() {
#if defined(__AVX512BF16__)
  if (g_bf16_dots < 0) {
    const char* forced = std::getenv("TOKENSWIFT_BF16_DOTS");
    if (forced != nullptr && (std::strcmp(forced, "on") == 0 || std::strcmp(forced, "off") == 0)) {
      g_bf16_dots = std::strcmp(forced, "on") == 0 ? 1 : 0;
    } else {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80), b = a;
      const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
      const int64_t reps = 20000;
      const double dots = timed_rounds([&](__m512 acc) { return _mm512_dpbf16_ps(acc, a, b); }, reps);
      const double fmas = timed_rounds([&](__m512 acc) { return _mm512_fmadd_ps(x, _mm512_fmadd_ps(x, acc, y), y); },
                                       reps);
      g_bf16_dots = dots < fmas ? 1 : 0;
    }
  }
  return g_bf16_dots == 1;
#else
  return false;
#endif
}

// For tests: pick the pairs' instruction (true: vdpbf16ps where this build has it), returning the previous choice.
bool set_bf16_dots(bool on) {
  const bool before = bf16_dots();
#if defined(__AVX512BF16__)
  g_bf16_dots = on ? 1 : 0;
#endif
  return before;
}

constexpr int64_t kRowBlock = 6;  // the most rows a score or value tile takes at once

// Scores of RB rows for the first `width` of a tile's kTile keys (kt[j * kTile + l]): per key an fma chain over j,
// in order (in pairs, odd first, with Pairs). `next` (or null): a tile fetched meanwhile, spread over the multiplies.
template <int RB, int D, typename E, bool Pairs>
inline void score_tile(const float* q, const E* kt, int64_t width, float* p, int64_t ldp, const E* next) {
  constexpr int64_t line = 64 / sizeof(E);  // elements per cache line
#if defined(__AVX2__) && !defined(__AVX512F__)
  // AVX2: 8 W keys at a time with every accumulator in a register (RB W of the 16: 4 vectors a row up to 3 rows,
  // else 2), each key vector loaded once for the RB rows; the same fma chain per key as below. The next tile's
  // D * kTile / line cache lines are requested evenly over the passes' steps: issued in a burst, most of them were
  // dropped behind the misses in flight.
  static_assert(RB <= kRowBlock, "score_tile: at most 6 rows fit AVX2's registers");
  constexpr int W = RB <= 3 ? 4 : 2;
  constexpr int64_t lines = D * kTile / line, steps = D * kTile / (8 * W);
  for (int64_t l0 = 0; l0 < kTile; l0 += 8 * W) {
    __m256 acc[RB][W];
    for (int r = 0; r < RB; ++r)
      for (int x = 0; x < W; ++x) acc[r][x] = _mm256_setzero_ps();
    for (int jj = 0; jj < D; ++jj) {
      const int j = Pairs ? jj ^ 1 : jj;
      if (next != nullptr) {
        const int64_t step = l0 / (8 * W) * D + jj;
        for (int64_t u = step * lines / steps; u < (step + 1) * lines / steps; ++u)
          __builtin_prefetch(next + u * line, 0, kCacheToL2);
      }
      fma_tile<RB, W>(acc, kt + j * kTile + l0, [&](int r) { return q[r * D + j]; });
    }
    const int64_t keep = std::min<int64_t>(8 * W, width - l0);
    for (int r = 0; r < RB && keep > 0; ++r) {
      float row[8 * W];
      float* dst = keep == 8 * W ? p + r * ldp + l0 : row;
      for (int x = 0; x < W; ++x) _mm256_storeu_ps(dst + 8 * x, acc[r][x]);
      if (keep < 8 * W) std::copy(row, row + keep, p + r * ldp + l0);
    }
  }
  return;
#endif
  float acc[RB][kTile], wide[kTile];
  for (int r = 0; r < RB; ++r)
    for (int l = 0; l < kTile; ++l) acc[r][l] = 0.0f;
  for (int jj = 0; jj < D; ++jj) {
    const int j = Pairs ? jj ^ 1 : jj;
    const float* kj = widened(kt + j * kTile, kTile, wide);
    if (next != nullptr)
      for (int64_t l = 0; l < kTile; l += line) __builtin_prefetch(next + j * kTile + l, 0, kCacheToL2);
    for (int r = 0; r < RB; ++r) {
      const float qj = q[r * D + j];
#pragma omp simd
      for (int l = 0; l < kTile; ++l) acc[r][l] = fma_(qj, kj[l], acc[r][l]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int64_t l = 0; l < width; ++l) p[r * ldp + l] = acc[r][l];
}

#if defined(__AVX512BF16__)
// Two rows' 32 bf16 values interleaved into pairs (unpacklo, unpackhi) hold, lane by lane, the elements
// 0-3, 8-11, 16-19, 24-27 and 4-7, 12-15, 20-23, 28-31: 32 floats between that order and their own.
inline void to_pair_lanes(const float* x, __m512& lo, __m512& hi) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  lo = _mm512_permutex2var_ps(a, _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27), b);
  hi = _mm512_permutex2var_ps(a, _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31), b);
}

inline void from_pair_lanes(__m512 lo, __m512 hi, float* x) {
  _mm512_storeu_ps(x, _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                                                    22, 23), hi));
  _mm512_storeu_ps(x + 16, _mm512_permutex2var_ps(lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14,
                                                                        15, 28, 29, 30, 31), hi));
}

// 64 elements of two bf16 rows as pairs (a[i], b[i]), in the order of to_pair_lanes for each half.
inline void pairs_of(const uint16_t* a, const uint16_t* b, __m512bh (&k)[4]) {
  const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 32);
  const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 32);
  k[0] = (__m512bh)_mm512_unpacklo_epi16(a0, b0);
  k[1] = (__m512bh)_mm512_unpackhi_epi16(a0, b0);
  k[2] = (__m512bh)_mm512_unpacklo_epi16(a1, b1);
  k[3] = (__m512bh)_mm512_unpackhi_epi16(a1, b1);
}

// Two floats holding bf16 values as a bf16 pair (x[0] low, x[1] high).
inline int32_t bf16_pair(const float* x) {
  return static_cast<int32_t>(bf16_bits(x[0]) | static_cast<uint32_t>(bf16_bits(x[1])) << 16);
}

// score_tile over bf16 keys on vdpbf16ps: qp[r * D / 2 + i] holds row r's bf16 pair (q[2i], q[2i+1]). Rows 2i and
// 2i + 1 of the tile are interleaved into (k[2i], k[2i+1]) pairs per key, the keys then in the lanes' order
// 0-3, 8-11, .. (unpacklo) and 4-7, 12-15, .. (unpackhi), put back in order when stored.
template <int RB, int D>
inline void score_tile_bf16(const int32_t* qp, const uint16_t* kt, int64_t width, float* p, int64_t ldp,
                            const uint16_t* next) {
  __m512 acc[RB][4];  // (every index below a constant once unrolled: the accumulators stay in registers)
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i) {
    const uint16_t* even = kt + 2 * i * kTile;
    const uint16_t* odd = even + kTile;
    if (next != nullptr)
      for (int j = 0; j < 2; ++j) {
        __builtin_prefetch(next + (2 * i + j) * kTile, 0, kCacheToL2);
        __builtin_prefetch(next + (2 * i + j) * kTile + 32, 0, kCacheToL2);
      }
    __m512bh k[4];
    pairs_of(even, odd, k);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qp[r * (D / 2) + i]);
#pragma GCC unroll 4
      for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], k[m], qb);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    if (width == kTile) {  // straight into place: a copy through the stack cost a third of the tile's multiplies
      from_pair_lanes(acc[r][0], acc[r][1], p + r * ldp);
      from_pair_lanes(acc[r][2], acc[r][3], p + r * ldp + 32);
      continue;
    }
    float row[kTile];
    from_pair_lanes(acc[r][0], acc[r][1], row);
    from_pair_lanes(acc[r][2], acc[r][3], row + 32);
    for (int64_t l = 0; l < width; ++l) p[r * ldp + l] = row[l];
  }
}
#endif

template <typename Tile>
inline void for_row_blocks(int64_t R, Tile tile) {
  int64_t r = 0;
  for (; r + kRowBlock <= R; r += kRowBlock) tile(std::integral_constant<int, kRowBlock>{}, r);
  for (; r + 3 <= R; r += 3) tile(std::integral_constant<int, 3>{}, r);
  if (R - r == 2) tile(std::integral_constant<int, 2>{}, r);
  else if (R - r == 1) tile(std::integral_constant<int, 1>{}, r);
}

// Value rows prefetched ahead: 32 rows' bytes of fp32, 8 KB at a head size of 64 (prefetches past the cache's end
// are harmless). Several rows' tiles take long enough per value row that half this left memory idle at long contexts.
template <typename E>
constexpr int64_t kValuesAhead = 32 * 4 / sizeof(E);

// Keys whose values (at most 16 KB of them as fp32, a multiple of 16 keys) the AVX2 and portable value tiles take
// at a time.
template <int D>
constexpr int64_t kValueKeys = std::max<int64_t>(16, 4096 / D / 16 * 16);

constexpr int64_t kRegRows = 24;  // the most rows a register tile takes (below); the padding past the last
constexpr int64_t kWideRows = 6;  // the most rows that take 4 vectors each in a register tile

#if defined(__AVX512F__)
// Register-blocked fma tiles for AVX-512, used wherever the pairs are not on vdpbf16ps: a tile is 16 W keys (scores)
// or 16 W elements of the values (weighted values) for up to kRegRows rows, W accumulator registers per row, each key
// or value row loaded (and widened) once for all of them and each query element or weight broadcast into its fma.
// Every row's result is the same chain of fmas as score_tile's and value_tile's (the same order over j, or over l,
// odd first in pairs), so the floats do not change; rows past the last are computed on padding and dropped.

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {  // bf16 widened: a shift, exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// f(rows, wide, r, valid) over R rows in blocks of `rows` (a compile-time constant; the first `valid` of them real)
// and `wide` vectors per row: a few rows take 4 vectors each (more independent fmas per load), more rows one each
// in blocks of at most kRegRows, a multiple of 4.
template <typename F>
inline void for_register_blocks(int64_t R, F f) {
  using I = std::integral_constant<int, 1>;
  using IV = std::integral_constant<int, 4>;
  if (R <= kWideRows) {
    switch ((R + 1) / 2) {
      case 1: return f(std::integral_constant<int, 2>{}, IV{}, 0, R);
      case 2: return f(std::integral_constant<int, 4>{}, IV{}, 0, R);
      default: return f(std::integral_constant<int, 6>{}, IV{}, 0, R);
    }
  }
  for (int64_t r = 0; r < R; r += kRegRows) {
    const int64_t valid = std::min(kRegRows, R - r);
    switch ((valid + 3) / 4) {
      case 1: f(std::integral_constant<int, 4>{}, I{}, r, valid); break;
      case 2: f(std::integral_constant<int, 8>{}, I{}, r, valid); break;
      case 3: f(std::integral_constant<int, 12>{}, I{}, r, valid); break;
      case 4: f(std::integral_constant<int, 16>{}, I{}, r, valid); break;
      case 5: f(std::integral_constant<int, 20>{}, I{}, r, valid); break;
      default: f(std::integral_constant<int, 24>{}, I{}, r, valid); break;
    }
  }
}

// Scores of RB rows (the first `valid` stored) for `width` <= 16 W keys of a tile (kt[j * kTile + l]); the same keys'
// place kKeyTilesAhead tiles on is fetched meanwhile.
template <int RB, int W, int D, typename E, bool Pairs>
inline void score_rows(const float* q, const E* kt, int64_t width, float* p, int64_t ldp, int64_t valid) {
  __mmask16 m[W];
  for (int w = 0; w < W; ++w)
    m[w] = static_cast<__mmask16>((1u << std::clamp<int64_t>(width - 16 * w, 0, 16)) - 1);
  __m512 acc[RB][W];
#pragma GCC unroll 24
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
  for (int jj = 0; jj < D; ++jj) {
    const int j = Pairs ? jj ^ 1 : jj;
    const E* ahead = kt + kKeyTilesAhead<E> * D * kTile + j * kTile;
    for (int64_t b = 0; b < 16 * W * static_cast<int64_t>(sizeof(E)); b += 64)  // each line of that row
      __builtin_prefetch(reinterpret_cast<const char*>(ahead) + b, 0, kCacheToL2);
    __m512 k[W];
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w) k[w] = load16(kt + j * kTile + 16 * w, m[w]);
#pragma GCC unroll 24
    for (int r = 0; r < RB; ++r) {
      const __m512 qj = _mm512_set1_ps(q[r * D + j]);
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(qj, k[w], acc[r][w]);
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < RB; ++r)  // (every index a constant: the accumulators stay in registers)
#pragma GCC unroll 4
    for (int w = 0; w < W; ++w)
      if (r < valid) _mm512_mask_storeu_ps(p + r * ldp + 16 * w, m[w], acc[r][w]);
}

// acc[r][d0 .. d0 + 16 W) += sum over l < n of w[r][l] * v[l][d0 ..], l in order (in pairs, odd first, with Pairs:
// n even), RB rows (the first `valid` read and stored).
template <int RB, int W, int D, typename E, bool Pairs>
inline void value_rows(const float* w, int64_t ldw, const E* v, int64_t n, float* acc, int64_t d0, int64_t valid) {
  __m512 a[RB][W];
#pragma GCC unroll 24
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < W; ++x) a[r][x] = r < valid ? _mm512_loadu_ps(acc + r * D + d0 + 16 * x) : _mm512_setzero_ps();
  for (int64_t lj = 0; lj < n; ++lj) {
    const int64_t l = Pairs ? lj ^ 1 : lj;
    for (int64_t b = 0; b < 16 * W * static_cast<int64_t>(sizeof(E)); b += 64)  // rows kValuesAhead on
      __builtin_prefetch(reinterpret_cast<const char*>(v + (lj + kValuesAhead<E>) * D + d0) + b, 0, kCacheToL2);
    __m512 vl[W];
#pragma GCC unroll 4
    for (int x = 0; x < W; ++x) vl[x] = load16(v + l * D + d0 + 16 * x, 0xFFFF);
#pragma GCC unroll 24
    for (int r = 0; r < RB; ++r) {
      const __m512 wl = _mm512_set1_ps(w[r * ldw + l]);
#pragma GCC unroll 4
      for (int x = 0; x < W; ++x) a[r][x] = _mm512_fmadd_ps(wl, vl[x], a[r][x]);
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < W; ++x)
      if (r < valid) _mm512_storeu_ps(acc + r * D + d0 + 16 * x, a[r][x]);
}

// The scores of R rows (q padded by kRegRows rows past them) for the first `width` keys of a tile, on the register
// tiles: 64 keys at a time for a few rows, else 16.
template <int D, typename E>
void tile_in_registers(const float* q, int64_t R, const E* kt, int64_t width, float* p, int64_t ldp, bool pairs) {
  static_assert(kTile % 64 == 0, "tile_in_registers: whole register tiles in a cache tile");
  const int64_t tile = R <= kWideRows ? 64 : 16;  // keys per tile: for_register_blocks' vectors per row, 16 each
  for (int64_t t0 = 0; t0 < width; t0 += tile) {
    const int64_t keys = std::min(tile, width - t0);
    for_register_blocks(R, [&](auto rows, auto wide, int64_t r, int64_t valid) {
      constexpr int RB = decltype(rows)::value, W = decltype(wide)::value;
      float* out = p + r * ldp + t0;
      if constexpr (kPairs<E>) {
        if (pairs) return score_rows<RB, W, D, E, true>(q + r * D, kt + t0, keys, out, ldp, valid);
      }
      score_rows<RB, W, D, E, false>(q + r * D, kt + t0, keys, out, ldp, valid);
    });
  }
}

// The committed keys' weighted values of R rows (w padded by kRegRows rows past them) on the register tiles.
template <int D, typename E>
void values_in_registers(const float* w, int64_t ldw, const E* v, int64_t n, int64_t R, float* acc, bool pairs) {
  for_register_blocks(R, [&](auto rows, auto wide, int64_t r, int64_t valid) {
    constexpr int RB = decltype(rows)::value;
    // a head size that is not a multiple of 16 W: one vector per row at a time
    constexpr int W = D % (16 * decltype(wide)::value) == 0 ? decltype(wide)::value : 1;
    for (int64_t d0 = 0; d0 < D; d0 += 16 * W) {
      if constexpr (kPairs<E>) {
        if (pairs) {
          value_rows<RB, W, D, E, true>(w + r * ldw, ldw, v, n, acc + r * D, d0, valid);
          continue;
        }
      }
      value_rows<RB, W, D, E, false>(w + r * ldw, ldw, v, n, acc + r * D, d0, valid);
    }
  });
}
#endif

// Scores of R rows for n keys from slot s0 on (p[r * ldp + l]) of one head's keys (kt, tile-major: key_offset),
// a tile at a time. A tile is read where it lies, whatever its slots past the n keys hold (their scores are dropped);
// keys from a slot inside a tile (a block's, after `past`) are gathered into a tile first. With `pairs`, q holds bf16
// values and qp (on vdpbf16ps) the same rows as bf16 pairs.
template <int D, typename E>
void scores(const float* q, const int32_t* qp, int64_t R, const E* kt, int64_t s0, int64_t n, float* p,
            int64_t ldp, bool pairs) {
  E pad[D * kTile];
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t width = std::min(kTile, n - t0), slot = s0 + t0;
    const E* src = kt + key_offset(slot, D);
    if (slot % kTile != 0) {
      std::fill(pad, pad + D * kTile, E{});  // a zero, as fp32 or as bf16 bits
      for (int64_t l = 0; l < width; ++l) {
        const E* key = kt + key_offset(slot + l, D);
        for (int j = 0; j < D; ++j) pad[j * kTile + l] = key[j * kTile];
      }
      src = pad;
    }
    // Tiles ahead (past this head's last, the next head's first: a thread's next task) are fetched while this one is
    // multiplied, spread over its rows: a burst of them all waits on the misses in flight.
    const E* next = kt + key_offset(slot - slot % kTile, D) + kKeyTilesAhead<E> * D * kTile;
#if defined(__AVX512F__)
    if (!pairs || qp == nullptr) {
      tile_in_registers<D, E>(q, R, src, width, p + t0, ldp, pairs);
      continue;
    }
#endif
#if defined(__AVX512BF16__)
    if constexpr (kPairs<E>) {
      if (pairs && qp != nullptr) {
        for_row_blocks(R, [&](auto rows, int64_t r) {
          score_tile_bf16<decltype(rows)::value, D>(qp + r * (D / 2), src, width, p + r * ldp + t0, ldp,
                                                    r == 0 ? next : nullptr);
        });
        continue;
      }
    }
#endif
#if !defined(__AVX2__)
    // Plain C++, several row blocks: bf16 keys widened once for all of them. (AVX2's register tiles widen each key
    // vector as they load it, for every row block: cheaper than a pass through memory.)
    if (!std::is_same_v<E, float> && R > kRowBlock) {
      float wide[D * kTile];
      for (int64_t l = 0; l < D * kTile; l += 64 / sizeof(E)) __builtin_prefetch(next + l, 0, kCacheToL2);
      widened(src, D * kTile, wide);
      for_row_blocks(R, [&](auto rows, int64_t r) {
        constexpr int RB = decltype(rows)::value;
        float* out = p + r * ldp + t0;
        pairs ? score_tile<RB, D, float, true>(q + r * D, wide, width, out, ldp, nullptr)
              : score_tile<RB, D, float, false>(q + r * D, wide, width, out, ldp, nullptr);
      });
      continue;
    }
#endif
    for_row_blocks(R, [&](auto rows, int64_t r) {
      constexpr int RB = decltype(rows)::value;
      const E* ahead = r == 0 ? next : nullptr;
      pairs ? score_tile<RB, D, E, true>(q + r * D, src, width, p + r * ldp + t0, ldp, ahead)
            : score_tile<RB, D, E, false>(q + r * D, src, width, p + r * ldp + t0, ldp, ahead);
    });
  }
}

// acc[r][i] += sum over l < n of w[r][l] * v[l][i], l in order (in pairs, odd first, with Pairs: n even), RB rows
// sharing every loaded value row. Over a bf16 cache the weights w hold bf16 values.
template <int RB, int D, typename E, bool Pairs>
inline void value_tile(const float* w, int64_t ldw, const E* v, int64_t n, float* acc) {
  constexpr int64_t line = 64 / sizeof(E);  // elements per cache line
#if defined(__AVX2__) && !defined(__AVX512F__)
  // AVX2: 8 W of the D elements at a time with every accumulator in a register (as score_tile's), each value
  // vector loaded once for the RB rows; the same fma chain per element as below.
  static_assert(RB <= kRowBlock && D % 16 == 0, "value_tile: at most 6 rows, D a multiple of 16");
  constexpr int W = RB <= 3 && D % 32 == 0 ? 4 : 2;
  for (int64_t d0 = 0; d0 < D; d0 += 8 * W) {
    __m256 a[RB][W];
    for (int r = 0; r < RB; ++r)
      for (int x = 0; x < W; ++x) a[r][x] = _mm256_loadu_ps(acc + r * D + d0 + 8 * x);
    for (int64_t lj = 0; lj < n; ++lj) {
      const int64_t l = Pairs ? lj ^ 1 : lj;
      if (d0 == 0)
        for (int64_t i = 0; i < D; i += line) __builtin_prefetch(v + (lj + kValuesAhead<E>) * D + i, 0, kCacheToL2);
      fma_tile<RB, W>(a, v + l * D + d0, [&](int r) { return w[r * ldw + l]; });
    }
    for (int r = 0; r < RB; ++r)
      for (int x = 0; x < W; ++x) _mm256_storeu_ps(acc + r * D + d0 + 8 * x, a[r][x]);
  }
  return;
#endif
  float a[RB][D], wide[D];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < D; ++i) a[r][i] = acc[r * D + i];
  for (int64_t lj = 0; lj < n; ++lj) {
    const int64_t l = Pairs ? lj ^ 1 : lj;
    for (int64_t i = 0; i < D; i += line) __builtin_prefetch(v + (lj + kValuesAhead<E>) * D + i, 0, kCacheToL2);
    const float* vl = widened(v + l * D, D, wide);
    for (int r = 0; r < RB; ++r) {
      const float wl = w[r * ldw + l];
#pragma omp simd
      for (int i = 0; i < D; ++i) a[r][i] = fma_(wl, vl[i], a[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < D; ++i) acc[r * D + i] = a[r][i];
}

#if defined(__AVX512BF16__)
// value_tile over a bf16 cache on vdpbf16ps (D a multiple of 64): per 64 elements of the rows, pairs of value rows
// interleaved; wp[r * ldw + l / 2]: row r's weights of keys l and l + 1 as a bf16 pair (softmax_chunk).
template <int RB, int D>
inline void value_tile_bf16(const int32_t* wp, int64_t ldw, const uint16_t* v, int64_t n, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 a[RB][4];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      to_pair_lanes(acc + r * D + d0, a[r][0], a[r][1]);
      to_pair_lanes(acc + r * D + d0 + 32, a[r][2], a[r][3]);
    }
    for (int64_t l = 0; l < n; l += 2) {
      for (int64_t ahead = l + kValuesAhead<uint16_t>; ahead < l + kValuesAhead<uint16_t> + 2; ++ahead) {
        __builtin_prefetch(v + ahead * D + d0, 0, kCacheToL2);
        __builtin_prefetch(v + ahead * D + d0 + 32, 0, kCacheToL2);
      }
      __m512bh k[4];
      pairs_of(v + l * D + d0, v + (l + 1) * D + d0, k);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(wp[r * ldw + l / 2]);
#pragma GCC unroll 4
        for (int m = 0; m < 4; ++m) a[r][m] = _mm512_dpbf16_ps(a[r][m], k[m], wb);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      from_pair_lanes(a[r][0], a[r][1], acc + r * D + d0);
      from_pair_lanes(a[r][2], a[r][3], acc + r * D + d0 + 32);
    }
  }
}
#endif

// One row's weighted values over a bf16 cache from key `from` (even) to `count`, in pairs as value_tile takes them,
// wherever each key sits (value(l)); a pair's missing second key weighs 0 (w is 0 past count) on zeros. On
// vdpbf16ps the weights are read as pairs: from wp where given (softmax_chunk's), else from w.
template <int D, typename Value>
void values_in_pairs(const float* w, const int32_t* wp, int64_t from, int64_t count, Value value, float* acc,
                     bool dots) {
  static const uint16_t zeros[D] = {};
  for (int64_t l = from; l < count; l += 2) {
    const uint16_t* va = value(l);
    const uint16_t* vb = l + 1 < count ? value(l + 1) : zeros;
#if defined(__AVX512BF16__)
    if (D % 64 == 0 && dots) {
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(wp != nullptr ? wp[l / 2] : bf16_pair(w + l));
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 a[4];
        to_pair_lanes(acc + d0, a[0], a[1]);
        to_pair_lanes(acc + d0 + 32, a[2], a[3]);
        __m512bh k[4];
        pairs_of(va + d0, vb + d0, k);
        for (int m = 0; m < 4; ++m) a[m] = _mm512_dpbf16_ps(a[m], k[m], wb);
        from_pair_lanes(a[0], a[1], acc + d0);
        from_pair_lanes(a[2], a[3], acc + d0 + 32);
      }
      continue;
    }
#endif
#pragma omp simd
    for (int j = 0; j < D; ++j) acc[j] = fma_(w[l], widen(va[j]), fma_(w[l + 1], widen(vb[j]), acc[j]));
  }
}

// Attention of H KV heads' rows over a cache (see above) in steps a team can share: the scaled queries (one thread),
// the (head, chunk) tasks (each chunk's partial softmax and weighted values; parts of near-equal cost), the merge of
// each row's chunks in order (parts of rows). Every layer of a stack has the same shape, so one plan serves them all.
template <int D, typename E>
struct Attention {
  int64_t H, G, n, R, past, window, C = 0;
  float scale;
  bool pairs, dots;  // products in bf16 pairs; the pairs on vdpbf16ps (bf16_dots)
  const std::vector<std::vector<int64_t>>& anc;
  std::vector<int64_t> len, cost;  // each row's key count; the tasks' cumulative costs (cost[t]: tasks before t)
  std::vector<float> qs, part_max, part_sum, part_acc;
  std::vector<int32_t> qp;  // the queries as bf16 pairs, for vdpbf16ps

  Attention(int64_t H_, int64_t G_, int64_t n_, int64_t past_, const std::vector<std::vector<int64_t>>& anc_,
            int64_t window_, float scale_, bool bf16_products)
      : H(H_), G(G_), n(n_), R(G_ * n_), past(past_), window(window_), scale(scale_),
        pairs(kPairs<E> && bf16_products), dots(pairs && bf16_dots()), anc(anc_), len(n_) {
    int64_t longest = 0;
    for (int64_t i = 0; i < n; ++i) {
      len[i] = past + static_cast<int64_t>(anc[i].size());
      longest = std::max(longest, len[i]);
    }
    C = (longest + kChunk - 1) / kChunk;
    // a task costs its chunk's keys (the longest row's) plus a fixed share for its softmax and setup
    cost.resize(H * C + 1);
    for (int64_t task = 0; task < H * C; ++task) {
      const int64_t c0 = (task % C) * kChunk;
      cost[task + 1] = cost[task] + std::min(kChunk, longest - c0) + kChunk / 16;
    }
    qs.resize((H * R + kRegRows) * D);  // rows past the last: the register tiles' padding
#if defined(__AVX512BF16__)
    if (dots) qp.resize(H * R * D / 2);
#endif
    part_max.resize(H * C * R);
    part_sum.resize(H * C * R);
    part_acc.resize(H * C * R * D);
  }

  // Query head hq (KV head hq / G's row hq % G * n + i) of token i, from q [D]: softmax(scale * q.k) =
  // softmax((scale * q).k); bf16 products take bf16 queries.
  void query(int64_t hq, int64_t i, const float* q) {
    const int64_t row = (hq * n + i) * D;
#if defined(__AVX512F__)
    if constexpr (D % 32 == 0) {  // 32 at a time: rounded as round_bf16, paired as bf16_pair
      const __m512 sv = _mm512_set1_ps(scale);
      for (int64_t j = 0; j < D; j += 32) {
        __m512i half[2];
        for (int h = 0; h < 2; ++h) {
          const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(q + j + 16 * h), sv));
          half[h] = pairs ? round_bf16_16(bits) : bits;
          _mm512_storeu_si512(&qs[row + j + 16 * h], half[h]);
        }
#if defined(__AVX512BF16__)
        if (dots) {  // the upper halves of the 32 floats, in order: their bf16 pairs
          const __m512i upper = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31,
                                                 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
          _mm512_storeu_si512(&qp[(row + j) / 2], _mm512_permutex2var_epi16(half[0], upper, half[1]));
        }
#endif
      }
      return;
    }
#endif
    for (int64_t j = 0; j < D; ++j) {
      qs[row + j] = q[j] * scale;
      if (pairs) qs[row + j] = round_bf16(qs[row + j]);
#if defined(__AVX512BF16__)
      if (dots && j % 2 == 1) qp[(row + j) / 2] = bf16_pair(&qs[row + j - 1]);
#endif
    }
  }

  const int32_t* query_pairs(int64_t h) const { return qp.empty() ? nullptr : &qp[h * R * D / 2]; }

  void tasks(int64_t begin, int64_t end, const E* kp, int64_t kh, const E* vp, int64_t vh) {
    static thread_local std::vector<float> p, block, wide;
    static thread_local std::vector<int32_t> wp;  // p's rows as bf16 pairs (softmax_chunk), for vdpbf16ps
    p.resize((R + kRegRows) * kChunk);
    wp.resize(R * kChunk / 2);
    block.resize(R * n);
    // row r's weights as pairs, where the values are on vdpbf16ps and read them so alone
    auto row_pairs = [&](int64_t r) { return dots && kValuePairs<D> ? &wp[r * kChunk / 2] : nullptr; };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / C, c0 = (task % C) * kChunk, c1 = c0 + kChunk;
      const int64_t shared = std::max<int64_t>(0, std::min(c1, past) - c0);  // committed keys in this chunk
      // the chunk's first values are on their way while its scores are computed (value_tile fetches the rest ahead)
      for (int64_t i = 0; i < std::min(shared, kValuesAhead<E>) * D; i += 64 / sizeof(E))
        __builtin_prefetch(vp + h * vh + c0 * D + i, 0, kCacheToL2);
      if (shared > 0)
        scores<D, E>(&qs[h * R * D], query_pairs(h), R, kp + h * kh, c0, shared, p.data(), kChunk, pairs);
      if (c1 > past)  // every row's scores for every key of the block (slots past .. past + n - 1)
        scores<D, E>(&qs[h * R * D], query_pairs(h), R, kp + h * kh, past, n, block.data(), n, pairs);
      float* mx = &part_max[task * R];
      float* sum = &part_sum[task * R];
      float* acc = &part_acc[task * R * D];
      std::fill(acc, acc + R * D, 0.0f);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r % n;
        const int64_t count = std::max<int64_t>(0, std::min(c1, len[i]) - c0);  // this row's keys in the chunk
        float* pr = &p[r * kChunk];
        for (int64_t l = std::max(shared, int64_t{0}); l < count; ++l)  // its block keys, in logical order
          pr[l] = block[r * n + anc[i][c0 + l - past]];
        if (window > 0)  // keys before the row's window are hidden
          std::fill(pr, pr + std::clamp<int64_t>(len[i] - window - c0, 0, count),
                    -std::numeric_limits<float>::infinity());
        const float m = max_of(pr, count);
        mx[r] = m;
        if (count == 0 || std::isinf(m)) {  // no visible key of this row in this chunk
          std::fill(pr, pr + kChunk, 0.0f);
          if (int32_t* pairs_out = row_pairs(r)) std::fill(pairs_out, pairs_out + kChunk / 2, 0);
          mx[r] = -std::numeric_limits<float>::infinity();
          sum[r] = 0.0f;
          continue;
        }
#if defined(__AVX512F__)
        sum[r] = softmax_chunk(pr, count, m, pairs, row_pairs(r));
#else
        for (int64_t l = 0; l < count; ++l) pr[l] = exp_nonpositive(pr[l] - m);
        // summed over the whole chunk, zeros past its end: the order of the additions never depends on count
        std::fill(pr + count, pr + kChunk, 0.0f);
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t l = 0; l < kChunk; ++l) s += pr[l];
        sum[r] = s;
        if (pairs)  // the values' weights in bf16 (their sum above stays fp32's)
          for (int64_t l = 0; l < kChunk; ++l) pr[l] = round_bf16(pr[l]);
#endif
      }
      // values: the committed keys for all rows at once (an even number of them in pairs), then each row's other
      // keys in its logical order
      const int64_t common = pairs ? shared & ~int64_t{1} : shared;
      const E* vc = vp + h * vh + c0 * D;
      if (common > 0 && dots && kValuePairs<D>) {
#if defined(__AVX512BF16__)
        for_row_blocks(R, [&](auto rows, int64_t r) {
          value_tile_bf16<decltype(rows)::value, D>(&wp[r * kChunk / 2], kChunk / 2,
                                                    reinterpret_cast<const uint16_t*>(vc), common, acc + r * D);
        });
#endif
      } else if (common > 0) {
#if defined(__AVX512F__)
        values_in_registers<D, E>(p.data(), kChunk, vc, common, R, acc, pairs);
#else
        // kValueKeys keys at a time, whose values stay in L1 through every row block's passes over them (a row's
        // sums go on, in order, from block to block); with several row blocks, bf16 values widened once for all
        for (int64_t l0 = 0; l0 < common; l0 += kValueKeys<D>) {
          const int64_t m = std::min(kValueKeys<D>, common - l0);
          if (kPairs<E> && R > kRowBlock) {
            wide.resize(kValueKeys<D> * D);
            widened(vc + l0 * D, m * D, wide.data());
            for (int64_t i = 0; i < kValueKeys<D> * D; i += 64 / sizeof(E))  // the next block's, meanwhile
              __builtin_prefetch(vc + (l0 + m) * D + i, 0, kCacheToL2);
            for_row_blocks(R, [&](auto rows, int64_t r) {
              constexpr int RB = decltype(rows)::value;
              const float* w = &p[r * kChunk + l0];
              pairs ? value_tile<RB, D, float, true>(w, kChunk, wide.data(), m, acc + r * D)
                    : value_tile<RB, D, float, false>(w, kChunk, wide.data(), m, acc + r * D);
            });
            continue;
          }
          for_row_blocks(R, [&](auto rows, int64_t r) {
            constexpr int RB = decltype(rows)::value;
            const float* w = &p[r * kChunk + l0];
            pairs ? value_tile<RB, D, E, true>(w, kChunk, vc + l0 * D, m, acc + r * D)
                  : value_tile<RB, D, E, false>(w, kChunk, vc + l0 * D, m, acc + r * D);
          });
        }
#endif
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t i = r % n;
        const int64_t count = std::max<int64_t>(0, std::min(c1, len[i]) - c0);
        // the chunk's key l: a committed slot, or the row's ancestor (or itself) wherever it sits in the block
        auto value = [&](int64_t l) {
          return vp + h * vh + (c0 + l < past ? c0 + l : past + anc[i][c0 + l - past]) * D;
        };
        float* ar = acc + r * D;
        if constexpr (kPairs<E>) {
          if (pairs) {
            values_in_pairs<D>(&p[r * kChunk], row_pairs(r), common, count, value, ar, dots);
            continue;
          }
        }
        for (int64_t l = common; l < count; ++l) {
          const float wl = p[r * kChunk + l];
          const E* vl = value(l);
#pragma omp simd
          for (int j = 0; j < D; ++j) ar[j] = fma_(wl, widen(vl[j]), ar[j]);
        }
      }
    }
  }

  // Rows [begin, end) (row h * R + r): the chunks' softmaxes merged in chunk order, each row's result [D] given to
  // out(h * G + r / n, r % n, row): query head, token.
  template <typename Out>
  void merge(int64_t begin, int64_t end, const Out& out) const {
    for (int64_t hr = begin; hr < end; ++hr) {
      const int64_t h = hr / R, r = hr % R;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < C; ++c) m = std::max(m, part_max[(h * C + c) * R + r]);
      float o[D] = {};
      float total = 0.0f;
      for (int64_t c = 0; c < C; ++c) {
        const int64_t idx = (h * C + c) * R + r;
        if (std::isinf(part_max[idx])) continue;
        const float w = std::exp(part_max[idx] - m);
        total = fma_(w, part_sum[idx], total);
        const float* a = &part_acc[idx * D];
        for (int64_t j = 0; j < D; ++j) o[j] = fma_(w, a[j], o[j]);
      }
      for (int64_t j = 0; j < D; ++j) o[j] /= total;
      out(h * G + r / n, r % n, static_cast<const float*>(o));
    }
  }

  // The whole of it for one layer (every query given): each row's result to out (see merge), over `team`'s threads
  // or at::parallel_for's.
  template <typename Out>
  void run(const E* kp, int64_t kh, const E* vp, int64_t vh, const Out& out, const Team* team) {
    run_tasks(team, static_cast<int64_t>(cost.size()) - 1,
              [&](int64_t i, int64_t parts) { return cost_part(cost, i, parts); },
              [&](int64_t b, int64_t e) { tasks(b, e, kp, kh, vp, vh); });
    run_tasks(team, H * R, [&](int64_t i, int64_t parts) { return equal_part(H * R, i, parts); },
              [&](int64_t b, int64_t e) { merge(b, e, out); });
  }
};

template <int D, typename E>
void attend_d(const float* q, int64_t H, int64_t G, int64_t n, const E* kp, int64_t kh, const E* vp, int64_t vh,
              int64_t past, const std::vector<std::vector<int64_t>>& anc, int64_t window, float scale,
              bool bf16_products, float* out) {
  Attention<D, E> a(H, G, n, past, anc, window, scale, bf16_products);
  for (int64_t hq = 0; hq < H * G; ++hq)
    for (int64_t i = 0; i < n; ++i) a.query(hq, i, q + (hq * n + i) * D);
  a.run(kp, kh, vp, vh, [&](int64_t hq, int64_t i, const float* o) {
    std::copy(o, o + D, out + (hq * n + i) * D);
  }, nullptr);
}

// The ancestors (and self) of each block token in block order: from a visibility matrix [n, n], or causal.
std::vector<std::vector<int64_t>> ancestors(const torch::Tensor& vis, int64_t n) {
  std::vector<std::vector<int64_t>> anc(n);
  if (vis.numel() == 0) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j) anc[i].push_back(j);
    return anc;
  }
  TORCH_CHECK(vis.scalar_type() == at::kBool && vis.dim() == 2 && vis.size(0) == n && vis.size(1) == n,
              "attend: vis must be a bool [n, n] matrix");
  auto v = vis.contiguous();
  const bool* vp = v.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j)
      if (vp[i * n + j]) anc[i].push_back(j);
    TORCH_CHECK(!anc[i].empty() && anc[i].back() == i, "attend: a block token must see itself and nothing after it");
  }
  return anc;
}

// f(std::integral_constant<int, D>) for a head size D the attention kernel is instantiated for.
template <typename F>
void with_head_size(int64_t D, const char* who, F f) {
  switch (D) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 80: return f(std::integral_constant<int, 80>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
  }
  TORCH_CHECK(false, who, ": no kernel for head size ", D);
}

template <typename E>
void attend_into(const float* q, int64_t H, int64_t G, int64_t n, int64_t D, const torch::Tensor& k,
                 const torch::Tensor& v, int64_t past, const std::vector<std::vector<int64_t>>& anc, int64_t window,
                 float scale, bool bf16_products, float* out) {
  TORCH_CHECK(k.dim() == 4 && k.size(0) == H && k.size(2) == D && k.size(3) == kTile && k.is_contiguous(),
              "attend: keys in tiles [H_kv, S / ", kTile, ", D, ", kTile, "]");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == H && v.stride(2) == 1 && v.stride(1) == D, "attend: values by row");
  TORCH_CHECK(k.size(1) * kTile >= past + n && v.size(1) >= past + n,
              "attend: the cache holds fewer slots than past + n");
  const E* kp = static_cast<const E*>(k.data_ptr());
  const E* vp = static_cast<const E*>(v.data_ptr());
  with_head_size(D, "attend", [&](auto d) {
    attend_d<decltype(d)::value, E>(q, H, G, n, kp, k.stride(0), vp, v.stride(0), past, anc, window, scale,
                                    bf16_products, out);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Per-row glue; with `bf16`, rounded where a bf16 model rounds (round_bf16).

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

// ---------------------------------------------------------------------------------------------------------------
// The draw: the processed distribution's Gumbel-max sample, in one pass over the vocabulary.

inline uint64_t splitmix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// The noise key of the draw at sequence `position` (core/generation/sampling.py: _mix, the same function): splitmix64
// of (seed, position), so neighbouring positions get unrelated noise.
inline int64_t noise_key(uint64_t seed, int64_t position) {
  const uint64_t z = seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(position) * 0xBF58476D1CE4E5B9ULL +
                     0x94D049BB133111EBULL;
  return static_cast<int64_t>(splitmix(z) & 0x7FFFFFFFFFFFFFFFULL);
}

// Gumbel noise of token `id` at the position whose key (a hash of seed and position) is `key`: the same function as
// core/generation/sampling.py's gumbel_noise.
inline float gumbel(uint64_t key, int64_t id) {
  const uint64_t z = splitmix(key + static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ULL);
  const double u = (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;
  return static_cast<float>(-std::log(-std::log(u)));
}

// Appends the e[i] >= lo (i < n), in order, to ce and ci from `count` on (ids: first + i; both sized for n more,
// plus 16); returns the new count.
int64_t append_at_least(const float* e, int64_t n, int64_t first, float lo, float* ce, int32_t* ci, int64_t count) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // compress in registers and store whole vectors (the slack of 16 takes the unused lanes): a compressing store to
  // memory is slow on some CPUs
  const __m512 bound = _mm512_set1_ps(lo);
  __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i step = _mm512_set1_epi32(16);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(e + i);
    const __mmask16 k = _mm512_cmp_ps_mask(x, bound, _CMP_GE_OQ);
    if (k) {
      _mm512_storeu_ps(ce + count, _mm512_maskz_compress_ps(k, x));
      _mm512_storeu_si512(ci + count, _mm512_maskz_compress_epi32(k, idx));
      count += __builtin_popcount(k);
    }
    idx = _mm512_add_epi32(idx, step);
  }
#endif
  for (; i < n; ++i) {
    ce[count] = e[i];
    ci[count] = static_cast<int32_t>(first + i);
    count += e[i] >= lo;
  }
  return count;
}

// A draw's passes over the vocabulary go in blocks of kDrawBlock ids, the blocks in contiguous runs over the threads
// (each reads the logits its own core wrote, the lm_head being split so): a block's result never depends on the
// split, and the blocks' results are combined in block order, so a draw is the same on any number of threads.
constexpr int64_t kDrawBlock = 1024;

template <typename F>
void for_blocks(int64_t n, const F& f) {
  const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock;
  // (a drafter's few thousand scores are not worth waking a thread for)
  const int threads = blocks < 8 ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), blocks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b) f(b, b * kDrawBlock, std::min(kDrawBlock, n - b * kDrawBlock));
}

// The largest of v[0 .. n) (-inf for none), over the threads.
float max_of_blocks(const float* v, int64_t n) {
  thread_local std::vector<float> parts;  // (named through a pointer: a lambda sees each thread's own thread_local)
  parts.resize((n + kDrawBlock - 1) / kDrawBlock);
  float* pp = parts.data();
  for_blocks(n, [=](int64_t b, int64_t first, int64_t len) { pp[b] = max_of(v + first, len); });
  float m = -std::numeric_limits<float>::infinity();
  for (const float x : parts) m = x > m ? x : m;
  return m;
}

// e[i] = exp(v[i] - m) for the scores v[0 .. n) (0 for a filtered one, -inf): the tokens with e[i] >= lo, in id
// order, their e into ce and ids into ci (both resized); returns how many, and with `total` the sum of every e[i]
// (each block's sum, added in block order). Over the threads, in blocks that stay in L1, so the vocabulary's e are
// never written out whole: each block's tokens go to a stretch of its own (with the slack append_at_least writes
// into), then are moved up behind the previous blocks'.
int64_t exp_at_least(const float* v, int64_t n, float m, float lo, std::vector<float>& ce, std::vector<int32_t>& ci,
                     float* total = nullptr) {
  const int64_t blocks = (n + kDrawBlock - 1) / kDrawBlock, stretch = kDrawBlock + 16;
  ce.resize(blocks * stretch);
  ci.resize(blocks * stretch);
  thread_local std::vector<float> parts;
  thread_local std::vector<int64_t> counts;
  parts.resize(blocks);
  counts.resize(blocks);
  float* pp = parts.data();
  int64_t* cp = counts.data();
  float* cep = ce.data();
  int32_t* cip = ci.data();
  for_blocks(n, [=](int64_t b, int64_t first, int64_t len) {
    alignas(64) float e[kDrawBlock];
    float part = 0.0f;
    const float* x = v + first;
#pragma omp simd reduction(+ : part)
    for (int64_t i = 0; i < len; ++i) {
      e[i] = exp_nonpositive(x[i] - m);
      part += e[i];
    }
    pp[b] = part;
    cp[b] = append_at_least(e, len, first, lo, cep + b * stretch, cip + b * stretch, 0);
  });
  int64_t count = 0;
  float sum = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    sum += pp[b];
    std::memmove(cep + count, cep + b * stretch, cp[b] * sizeof(float));
    std::memmove(cip + count, cip + b * stretch, cp[b] * sizeof(int32_t));
    count += cp[b];
  }
  if (total != nullptr) *total = sum;
  return count;
}

// Temperature, top-k, top-p and min-p on scores v[0 .. vocab) in place (filtered scores become -inf): the draw's
// filters (see draw), shared with the drafts' ranking so a draft is ranked as the token will be drawn. With `kept`
// (the draw's), where top-p decides last and its nucleus lies among the tokens it ranked, the kept tokens' ids come
// back in id order instead, their scores as filtered and the others' left as they were (true returned): the draw
// then reads those alone, not the whole vocabulary twice more. `divided`: v already holds the scores over the
// temperature (the draw divides them as it copies them).
bool filter_scores(float* v, int64_t vocab, double temperature, double top_p, int64_t top_k, double min_p,
                   std::vector<int32_t>* kept = nullptr, bool divided = false) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const float t = static_cast<float>(temperature);
  if (!divided)
    for (int64_t i = 0; i < vocab; ++i) v[i] = v[i] / t;
  if (top_k > 0 && top_k < vocab) {
    std::vector<float> copy(v, v + vocab);
    std::nth_element(copy.begin(), copy.begin() + (top_k - 1), copy.end(), std::greater<float>());
    const float kth = copy[top_k - 1];
    for (int64_t i = 0; i < vocab; ++i)
      if (v[i] < kth) v[i] = ninf;
  }
  if (top_p < 1.0) {
    const float m = max_of_blocks(v, vocab);
    // The nucleus: the shortest prefix of the tokens ranked by (e desc, id asc) whose mass reaches top_p of the
    // whole, among the tokens with e >= 1e-6 (the top token has e = 1) when their mass reaches the goal, as it nearly
    // always does, else among every token. A positive float's bits rank it, so the tokens fall into buckets by their
    // top bits (exponent and 4 bits of mantissa), ranked as their values: whole buckets are taken from the top, by
    // their mass (summed in id order), until one would reach the goal; that one is ranked token by token.
    thread_local std::vector<float> ce;
    thread_local std::vector<int32_t> ci;
    float lo = 1e-6f, sum = 0.0f;
    int64_t nc = exp_at_least(v, vocab, m, lo, ce, ci, &sum);
    const double goal = top_p * static_cast<double>(sum);
    double big = 0.0;
    for (int64_t j = 0; j < nc; ++j) big += ce[j];
    if (big < goal) {
      lo = std::numeric_limits<float>::denorm_min();
      nc = exp_at_least(v, vocab, m, lo, ce, ci);
    }
    constexpr int kBuckets = 1 << 11;  // float bits >> 19 of a value in (0, 1]
    auto bucket = [](float x) {
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      return static_cast<int>(bits >> 19);
    };
    thread_local std::vector<double> bmass(kBuckets);  // 0 for an empty bucket: every candidate's e is > 0
    int top = 0, low = kBuckets - 1;
    for (int64_t j = 0; j < nc; ++j) {
      const int b = bucket(ce[j]);
      bmass[b] += ce[j];
      top = std::max(top, b);
      low = std::min(low, b);
    }
    // every token in a bucket >= cut is kept, and `partial` in the bucket below it
    int cut = top + 1;
    std::vector<std::pair<int64_t, float>> partial;  // (id, score) of the boundary bucket's kept tokens
    double mass = 0.0;  // (in double: a flat distribution's nucleus adds thousands of shares)
    for (int b = top; b >= low && mass < goal; --b) {
      if (bmass[b] == 0.0) continue;
      if (mass + bmass[b] < goal) {
        mass += bmass[b];
        cut = b;
        continue;
      }
      std::vector<std::pair<float, int32_t>> members;
      for (int64_t j = 0; j < nc; ++j)
        if (bucket(ce[j]) == b) members.push_back({ce[j], ci[j]});
      std::sort(members.begin(), members.end(), [](const auto& x, const auto& y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
      });
      partial.clear();
      for (const auto& [x, id] : members) {
        if (mass >= goal) break;
        partial.push_back({id, v[id]});
        mass += x;
      }
      if (partial.size() == members.size()) {  // the whole bucket, and the goal not reached yet (rounding)
        partial.clear();
        cut = b;
      }
    }
    std::fill(bmass.begin() + low, bmass.begin() + top + 1, 0.0);
    // a token below the ranked ones shares their lowest bucket at most: above it, the nucleus is ranked tokens only
    if (kept != nullptr && min_p <= 0.0 && cut > bucket(lo)) {
      kept->clear();
      for (int64_t j = 0; j < nc; ++j)
        if (bucket(ce[j]) >= cut) kept->push_back(ci[j]);
      for (const auto& [id, score] : partial) kept->push_back(static_cast<int32_t>(id));
      std::sort(kept->begin(), kept->end());
      return true;
    }
    for (int64_t i = 0; i < vocab; ++i) {
      const float e = exp_nonpositive(v[i] - m);
      v[i] = e > 0.0f && bucket(e) >= cut ? v[i] : ninf;
    }
    for (const auto& [id, score] : partial) v[id] = score;
  }
  if (min_p > 0.0) {  // p_i < min_p * p_max, that is exp(v_i - max) < min_p
    const float m = max_of_blocks(v, vocab), floor = static_cast<float>(min_p);
    for_blocks(vocab, [=](int64_t, int64_t first, int64_t len) {
      for (int64_t i = first; i < first + len; ++i)
        if (exp_nonpositive(v[i] - m) < floor) v[i] = ninf;
    });
  }
  return false;
}

// The first i with v[i] == x, or -1.
inline int64_t first_equal(const float* v, int64_t n, float x) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(x);
  for (; i + 16 <= n; i += 16)
    if (const uint32_t k = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), target, _CMP_EQ_OQ))
      return i + __builtin_ctz(k);
#endif
  for (; i < n; ++i)
    if (v[i] == x) return i;
  return -1;
}

// f(i) for each i in 0 .. n with v[i] > -inf, in order; the blocks of 16 with none are skipped in one test.
template <typename F>
inline void for_each_finite(const float* v, int64_t n, F f) {
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 none = _mm512_set1_ps(ninf);
  for (; i + 16 <= n; i += 16) {
    uint32_t k = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), none, _CMP_NEQ_UQ);
    for (; k; k &= k - 1) f(i + __builtin_ctz(k));
  }
#endif
  for (; i < n; ++i)
    if (v[i] != ninf) f(i);
}

// Token ids in two runs: a penalty window that is the sequence's tail followed by a path below it.
struct IdRuns {
  const int64_t* a;
  int64_t na;
  const int64_t* b;
  int64_t nb;
  template <typename F>
  void each(F f) const {
    for (int64_t j = 0; j < na; ++j) f(a[j]);
    for (int64_t j = 0; j < nb; ++j) f(b[j]);
  }
};

// The token drawn from one row of logits lp [vocab]: banned ids out, the contextual penalty over the distinct ids of
// `window`, then (temperature 0: the argmax) temperature, top-k, top-p (the fewest most likely tokens whose mass
// reaches top_p: rank j kept while the mass ranked above it is short of top_p, ties ranked by id), min-p, and the
// argmax of the surviving scores plus their Gumbel noise. `key` is the position's noise key (sampling.py: _mix).
int64_t draw_row(const float* lp, int64_t vocab, const IdRuns& window, const torch::Tensor& banned,
                 double temperature, double top_p, int64_t top_k, double min_p, double penalty, int64_t key) {
  const float ninf = -std::numeric_limits<float>::infinity();
  // The scores: sampling, the logits over the temperature, divided as they are copied (filter_scores would divide
  // them in a pass of its own), the penalised ones divided after their penalty, as filter_scores would.
  const bool greedy = temperature == 0.0;
  const float t = static_cast<float>(temperature);
  thread_local std::vector<float> v;
  v.resize(vocab);
  float* vp = v.data();
  for_blocks(vocab, [=](int64_t, int64_t first, int64_t len) {
    if (greedy) {
      std::copy(lp + first, lp + first + len, vp + first);
    } else {
#pragma omp simd
      for (int64_t i = first; i < first + len; ++i) vp[i] = lp[i] / t;
    }
  });
  if (penalty != 1.0 && window.na + window.nb > 0) {
    const float theta = static_cast<float>(penalty);
    thread_local std::vector<uint8_t> seen;  // each distinct id of the window is penalised once
    seen.resize(vocab);
    // all checked before any is marked: a refused window leaves `seen` clear
    window.each([=](int64_t id) {
      TORCH_CHECK(0 <= id && id < vocab, "draw: window id ", id, " outside 0..", vocab - 1);
    });
    uint8_t* sp = seen.data();
    window.each([=](int64_t id) {
      if (sp[id]) return;
      sp[id] = 1;
      const float x = lp[id] > 0.0f ? lp[id] / theta : lp[id] * theta;
      vp[id] = greedy ? x : x / t;
    });
    window.each([=](int64_t id) { sp[id] = 0; });
  }
  auto bc = banned.contiguous();
  for (int64_t i = 0; i < bc.numel(); ++i) vp[bc.data_ptr<int64_t>()[i]] = ninf;
  if (greedy) {  // the first of the largest scores (none: every token banned)
    const float m = max_of_blocks(v.data(), vocab);
    return m == ninf ? -1 : first_equal(v.data(), vocab, m);
  }
  const uint64_t k64 = static_cast<uint64_t>(key);
  int64_t best = -1;
  float top = ninf;
  auto consider = [&](int64_t i) {  // in id order: the first of the largest noisy scores
    const float x = v[i] + gumbel(k64, i);
    if (best < 0 || x > top) best = i, top = x;
  };
  thread_local std::vector<int32_t> kept;
  if (filter_scores(vp, vocab, temperature, top_p, top_k, min_p, &kept, /*divided=*/true))
    for (const int32_t i : kept) consider(i);
  else
    for_each_finite(v.data(), vocab, consider);
  return best;
}

}  // namespace

// The ids, sorted.
std::vector<int64_t> sorted_ids(const torch::Tensor& ids) {
  auto c = ids.contiguous();
  std::vector<int64_t> out(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  std::sort(out.begin(), out.end());
  return out;
}

// A generation's draw (core/generation/sampling.py: Sampler), its settings bound once: a draw then passes only its
// logits and where it is, between two forwards, where converting each setting again costs more than the draw's
// bookkeeping. `window` is the penalty window's length W; the noise key of position t is noise_key(seed, t).
class Draw {
 public:
  Draw(int64_t vocab, torch::Tensor banned, double temperature, double top_p, int64_t top_k, double min_p,
       double penalty, int64_t window, int64_t seed)
      : vocab_(vocab), banned_(banned.contiguous()), temperature_(temperature), top_p_(top_p), min_p_(min_p),
        penalty_(penalty), top_k_(top_k), W_(window), seed_(static_cast<uint64_t>(seed)) {
    TORCH_CHECK(banned_.scalar_type() == at::kLong, "Draw: banned ids must be int64");
    TORCH_CHECK(W_ >= 1 && seed >= 0, "Draw: a window of at least one id and a seed >= 0");
  }

  int64_t key(int64_t position) const { return noise_key(seed_, position); }

  // draw_row of one row of logits [>= vocab] at sequence `position`, whose penalty window is `window` [W].
  int64_t draw(const torch::Tensor& logits, const torch::Tensor& window, int64_t position) const {
    auto lc = cpu_float(logits);
    check_logits(lc);
    TORCH_CHECK(window.scalar_type() == at::kLong, "draw: window ids must be int64");
    auto wc = window.contiguous();
    return row(lc.data_ptr<float>(), {wc.data_ptr<int64_t>(), wc.numel(), nullptr, 0}, key(position));
  }

  // The draw after the sequence history[:length] (int64), at position `length`: its penalty window the last W ids.
  int64_t next(const torch::Tensor& logits, const torch::Tensor& history, int64_t length) const {
    auto lc = cpu_float(logits);
    check_logits(lc);
    check_history(history, length);
    auto hc = history.contiguous();
    const int64_t from = std::min(length, W_);
    return row(lc.data_ptr<float>(), {hc.data_ptr<int64_t>() + length - from, from, nullptr, 0}, key(length));
  }

  // The walk of a verified tree (core/tokenswift/step.py): from the root (node 0), draw the token after the sequence
  // and the path so far from the node's row of logits [n, >= vocab], exactly as `draw` does for that sequence (its
  // penalty window: the last W ids of history then path), and move to the child holding it; stop where none does.
  // Nodes are in `tokens` / `parents` order (parents first). The sequence is history's first `length` ids. Returns
  // the accepted nodes (the path) and the token drawn after them.
  std::tuple<std::vector<int64_t>, int64_t> walk(const torch::Tensor& logits, const std::vector<int64_t>& tokens,
                                                 const std::vector<int64_t>& parents, const torch::Tensor& history,
                                                 int64_t length) const {
    const int64_t n = static_cast<int64_t>(tokens.size());
    auto lc = cpu_float(logits);
    TORCH_CHECK(lc.dim() == 2 && lc.size(0) == n && lc.size(1) >= vocab_, "walk: logits [nodes, >= vocab]");
    TORCH_CHECK(static_cast<int64_t>(parents.size()) == n && n > 0 && parents[0] == -1, "walk: one parent per node");
    check_history(history, length);
    auto hc = history.contiguous();
    const int64_t* hp = hc.data_ptr<int64_t>();
    const int64_t H = length, stride = lc.stride(0);
    std::vector<int64_t> path, nodes;
    int64_t node = 0;
    while (true) {
      const int64_t d = static_cast<int64_t>(path.size());
      const int64_t from_path = std::min(d, W_), from_history = std::min(H, W_ - from_path);
      const IdRuns window{hp + H - from_history, from_history, path.data() + d - from_path, from_path};
      const int64_t token = row(lc.data_ptr<float>() + node * stride, window, key(length + d));
      int64_t child = -1;
      for (int64_t i = node + 1; i < n && child < 0; ++i)
        if (parents[i] == node && tokens[i] == token) child = i;
      if (child < 0) return {nodes, token};
      node = child;
      nodes.push_back(node);
      path.push_back(token);
    }
  }

  // What rank_row takes of the draw: the banned ids (sorted) and the filters.
  std::vector<int64_t> banned_sorted() const { return sorted_ids(banned_); }
  double temperature() const { return temperature_; }
  double top_p() const { return top_p_; }
  int64_t top_k() const { return top_k_; }
  double min_p() const { return min_p_; }

 private:
  // Logits as the draw reads them: float32 on the CPU, contiguous. The forward's are already, and pass through
  // without an operator call: between two forwards each costs more than the draw's bookkeeping.
  static torch::Tensor cpu_float(const torch::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat ? t.contiguous()
                                                                 : t.to(torch::kCPU, torch::kFloat).contiguous();
  }

  void check_logits(const torch::Tensor& logits) const {
    TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == at::kFloat && logits.size(0) >= vocab_, "draw: logits");
  }

  void check_history(const torch::Tensor& history, int64_t length) const {
    TORCH_CHECK(history.dim() == 1 && history.scalar_type() == at::kLong, "draw: history int64 [len]");
    TORCH_CHECK(0 <= length && length <= history.numel(), "draw: length ", length, " outside the history");
  }

  int64_t row(const float* logits, const IdRuns& window, int64_t key) const {
    return draw_row(logits, vocab_, window, banned_, temperature_, top_p_, top_k_, min_p_, penalty_, key);
  }

  int64_t vocab_;
  torch::Tensor banned_;
  double temperature_, top_p_, min_p_, penalty_;
  int64_t top_k_, W_;
  uint64_t seed_;
};

// Drafts ranked as they will be drawn, for one row of a drafter's logits v [n] over token ids `idp` (null: column j
// is token j), in place: banned ids (sorted) out, then (temperature 0) the softmax of the raw scores, or the draw's
// filters and each surviving token's Gumbel noise at the row's position (`key`) before the softmax; the k most
// likely columns' token ids and probabilities into ids / p, most likely first (ties by column). A row the filters
// emptied proposes its first k columns at 0.
void rank_row(float* v, int64_t n, const int64_t* idp, const std::vector<int64_t>& ban, double temperature,
              double top_p, int64_t top_k, double min_p, uint64_t key, int64_t k, int64_t* ids, float* p) {
  auto token = [&](int64_t j) { return idp ? idp[j] : j; };
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j)
    if (std::binary_search(ban.begin(), ban.end(), token(j))) v[j] = ninf;
  if (temperature != 0.0) {
    filter_scores(v, n, temperature, top_p, top_k, min_p);
    for_each_finite(v, n, [&](int64_t j) { v[j] += gumbel(key, token(j)); });
  }
  // Only the survivors are exponentiated and ranked: the filters leave a few dozen of a head's thousands of columns.
  const float m = max_of(v, n);
  thread_local std::vector<int32_t> alive;  // the columns with a chance, in column order
  alive.clear();
  double sum = 0.0;  // in column order, as a sum over every column (a filtered one adds 0)
  if (m != ninf)
    for_each_finite(v, n, [&](int64_t j) {
      v[j] = std::exp(v[j] - m);
      sum += v[j];
      if (v[j] > 0.0f) alive.push_back(static_cast<int32_t>(j));
    });
  const int64_t ranked = std::min<int64_t>(k, static_cast<int64_t>(alive.size()));
  std::partial_sort(alive.begin(), alive.begin() + ranked, alive.end(),
                    [&](int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  for (int64_t i = 0; i < ranked; ++i) {
    ids[i] = token(alive[i]);
    p[i] = static_cast<float>(v[alive[i]] / sum);
  }
  // then the columns with no chance (every survivor is ranked by now; only a survivor's v is above 0), in column order
  for (int64_t j = 0, i = ranked; j < n && i < k; ++j)
    if (!(v[j] > 0.0f)) {
      ids[i] = token(j);
      p[i++] = 0.0f;
    }
}

// rank_row for each row of logits [rows, V], row r at noise key keys[r]: token ids and probabilities [rows, k] each.
std::vector<torch::Tensor> rank_drafts(torch::Tensor logits, torch::Tensor ids, torch::Tensor banned,
                                       double temperature, double top_p, int64_t top_k, double min_p,
                                       std::vector<int64_t> keys, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "rank_drafts: logits float32 [rows, V]");
  auto lc = logits.contiguous();
  const int64_t rows = lc.size(0), n = lc.size(1);
  k = std::min(k, n);
  auto ic = ids.contiguous();
  TORCH_CHECK(ic.numel() == 0 || ic.numel() == n, "rank_drafts: ids must be empty or one per column");
  const std::vector<int64_t> ban = sorted_ids(banned);
  TORCH_CHECK(temperature == 0.0 || static_cast<int64_t>(keys.size()) == rows, "rank_drafts: one noise key per row");
  auto out_ids = torch::empty({rows, k}, torch::kLong);
  auto out_p = torch::empty({rows, k}, torch::kFloat);
  std::vector<float> v(n);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(lc.data_ptr<float>() + r * n, lc.data_ptr<float>() + (r + 1) * n, v.begin());
    rank_row(v.data(), n, ic.numel() ? ic.data_ptr<int64_t>() : nullptr, ban, temperature, top_p, top_k, min_p,
             temperature != 0.0 ? static_cast<uint64_t>(keys[r]) : 0, k, out_ids.data_ptr<int64_t>() + r * k,
             out_p.data_ptr<float>() + r * k);
  }
  return {out_ids, out_p};
}

// Row `id` of a packed weight [n, k] as fp32 into row [k] (an embedding lookup in a tied lm_head's table): per
// element the weight the linear kernels compute with (d * q, or d * q + m for q4_1; a bf16 value widened).
void embed_row(const Linear& L, int64_t id, float* row) {
  const int64_t k = L.k, B = k / kBlock, t = id / kCols, c = id % kCols;
  if (L.fmt == kFmtF32 || L.fmt == kFmtBF16) {
    for (int64_t j = 0; j < k; ++j)
      row[j] = L.f32 ? L.f32[(t * k + j) * kCols + c] : bf16_to_float(L.bf16[(t * k + j) * kCols + c]);
    return;
  }
  for (int64_t b = 0; b < B; ++b) {
    const float dw = half_to_float(L.d[(t * B + b) * kCols + c]);
    const float mw = L.fmt == kFmtQ4_1 ? half_to_float(L.m[(t * B + b) * kCols + c]) : 0.0f;
    for (int g = 0; g < 8; ++g)
      for (int j = 0; j < 4; ++j) {
        float q;
        if (L.fmt == kFmtQ8_0) {
          q = static_cast<float>(L.q8[(t * B + b) * 512 + (g * kCols + c) * 4 + j]);
        } else {
          const uint8_t byte = L.q4[(t * B + b) * 256 + ((g % 4) * kCols + c) * 4 + j];
          q = static_cast<float>(g < 4 ? (byte & 0x0F) : (byte >> 4));
        }
        const float w = dw * q;
        row[b * kBlock + g * 4 + j] = L.fmt == kFmtQ4_1 ? w + mw : w;
      }
  }
}

// Rows `ids` of a table [n, k] (one packed weight) as fp32 [len(ids), k].
torch::Tensor embed_of(const Linear& L, const torch::Tensor& ids, const char* who) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, who, ": token ids must be int64");
  auto ic = ids.contiguous();
  const int64_t rows = ic.numel();
  auto out = torch::empty({rows, L.k}, torch::kFloat);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t id = ic.data_ptr<int64_t>()[r];
    TORCH_CHECK(0 <= id && id < L.n, who, ": id ", id, " outside 0..", L.n - 1);
    embed_row(L, id, out.data_ptr<float>() + r * L.k);
  }
  return out;
}

torch::Tensor embed_rows(torch::Tensor ids, int64_t fmt, torch::Tensor a, torch::Tensor d, torch::Tensor m,
                         int64_t n, int64_t k) {
  return embed_of(linear_from(fmt, a, d, m, torch::Tensor(), n, k), ids.reshape(-1), "embed_rows");
}

// The root head (core/tokenswift/heads.py: RootHead, then its scoring), its weights found and checked once: for
// rows h0 [R, H] and the roots' token ids [R], state = h0 + down(silu(up([norm_h(h0); norm_e(e)]))) and logits =
// scorer(norm_out(state)), e the roots' embeddings. `norms`: the three norms' weights; `lin`: up, down, the scored
// lm_head rows and the embedding table as (packed, scales, mins, bias) each, `meta` their (format, outputs). A step
// is one call and one parallel region, since each operator, region and argument conversion between two forwards
// pays for caches the forward has just emptied; its drafts only choose what is verified, never a token.
class RootHead {
 public:
  RootHead(std::vector<torch::Tensor> norms, double eps, std::vector<torch::Tensor> lin, std::vector<int64_t> meta) {
    TORCH_CHECK(norms.size() == 3 && lin.size() == 16 && meta.size() == 8,
                "RootHead: 3 norms, 3 linear layers and the embedding table");
    for (auto& t : norms) t = t.contiguous();
    for (const auto& t : norms)
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1, "RootHead: float32 norm weights");
    H_ = norms[0].numel();
    TORCH_CHECK(norms[1].numel() == H_ && norms[2].numel() == H_, "RootHead: the norms must span the hidden size");
    up_ = linear_from(meta[0], lin[0], lin[1], lin[2], lin[3], meta[1], 2 * H_);
    down_ = linear_from(meta[2], lin[4], lin[5], lin[6], lin[7], meta[3], meta[1]);
    scorer_ = linear_from(meta[4], lin[8], lin[9], lin[10], lin[11], meta[5], H_);
    table_ = linear_from(meta[6], lin[12], lin[13], lin[14], torch::Tensor(), meta[7], H_);
    TORCH_CHECK(down_.n == H_, "RootHead: the down projection must give the hidden size");
    norm_h_ = norms[0].data_ptr<float>();
    norm_e_ = norms[1].data_ptr<float>();
    norm_out_ = norms[2].data_ptr<float>();
    eps_ = static_cast<float>(eps);
    // held, so the pointers above stay valid for the object's life
    held_ = norms;
    held_.insert(held_.end(), lin.begin(), lin.end());
  }

  int64_t scored() const { return scorer_.n; }
  int64_t hidden() const { return H_; }

  // The state [R, H] and logits [R, scored()] of rows h0 [R, H] (float32) and their roots [R].
  std::vector<torch::Tensor> step(const torch::Tensor& h0, const torch::Tensor& roots) const {
    TORCH_CHECK(h0.dim() == 2 && h0.scalar_type() == at::kFloat && h0.size(1) == H_, "root_step: h0 float32 [R, H]");
    TORCH_CHECK(roots.scalar_type() == at::kLong && roots.numel() == h0.size(0), "root_step: one root per row");
    const int64_t R = h0.size(0);
    auto hc = h0.contiguous(), rc = roots.contiguous();
    auto state = torch::empty({R, H_}, torch::kFloat);
    auto logits = torch::empty({R, scorer_.n}, torch::kFloat);
    run(hc.data_ptr<float>(), rc.data_ptr<int64_t>(), R, state.data_ptr<float>(), logits.data_ptr<float>());
    return {state, logits};
  }

  // step's arithmetic into state and logits: the same floats whatever R and the threads.
  void run(const float* h0, const int64_t* roots, int64_t R, float* state, float* logits) const {
    const int64_t H = H_, W = up_.n;
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(0 <= roots[r] && roots[r] < table_.n, "root_step: id ", roots[r], " outside 0..", table_.n - 1);
    std::vector<float> e(R * H), x(R * 2 * H), u(R * W), normed(R * H);
    for (int64_t r = 0; r < R; ++r) embed_row(table_, roots[r], e.data() + r * H);
    for (int64_t r = 0; r < R; ++r) {  // [norm_h(h0); norm_e(e)]
      rms_norm(h0 + r * H, norm_h_, 1, H, eps_, x.data() + r * 2 * H, false);
      rms_norm(e.data() + r * H, norm_e_, 1, H, eps_, x.data() + r * 2 * H + H, false);
    }
    QuantRows xq[3];
    const Linear* L[3] = {&up_, &down_, &scorer_};
    for (int j = 0; j < 3; ++j)
      if (quantized(L[j]->fmt)) xq[j].size_for(R, L[j]->k);
    if (quantized(up_.fmt)) quantize_rows(x.data(), 0, R, xq[0]);
    const int threads = at::get_num_threads();
    std::vector<Claim> claims(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const Team team = Team::current(claims.data());
      linear_into(up_, x.data(), R, u.data(), false, &team, &xq[0]);
      // SiLU, and the down projection's input quantized, by whole blocks of each row
      const int64_t per = (W + kBlock - 1) / kBlock;  // (a quantized layer's W is a multiple of kBlock)
      run_parts(&team, [&](int64_t part, int64_t parts) { return equal_part(R * per, part, parts); },
                [&](int64_t b0, int64_t b1) {
                  for (int64_t b = b0; b < b1; ++b) {
                    const int64_t r = b / per, c0 = (b % per) * kBlock, c1 = std::min(c0 + kBlock, W);
                    for (int64_t c = c0; c < c1; ++c) {
                      float& v = u[r * W + c];
                      v = v / (1.0f + std::exp(-v));
                    }
                    if (quantized(down_.fmt)) quantize_columns(u.data(), r, c0, c1, xq[1]);
                  }
                });
      linear_into(down_, u.data(), R, state, false, &team, &xq[1]);
      if (team.id == 0) {  // the residual, the output norm and the scorer's input: a few hundred floats a row
        for (int64_t i = 0; i < R * H; ++i) state[i] += h0[i];
        rms_norm(state, norm_out_, R, H, eps_, normed.data(), false);
        if (quantized(scorer_.fmt)) quantize_rows(normed.data(), 0, R, xq[2]);
      }
      team.sync();
      linear_into(scorer_, normed.data(), R, logits, false, &team, &xq[2]);
    }
  }

 private:
  std::vector<torch::Tensor> held_;
  Linear up_, down_, scorer_, table_;
  const float* norm_h_ = nullptr;
  const float* norm_e_ = nullptr;
  const float* norm_out_ = nullptr;
  float eps_ = 0.0f;
  int64_t H_ = 0;
};

// A generation's drafted levels of the root head (core/tokenswift/heads.py: DraftHeads.root_drafter): the head, the
// token ids it scores and the generation's draw bound once, so a level passes only its state, token and position.
class RootDrafter {
 public:
  RootDrafter(const RootHead& head, torch::Tensor ids, const Draw& draw, int64_t k)
      : head_(head), draw_(draw), ban_(draw.banned_sorted()), k_(std::min(k, head.scored())) {
    auto ic = ids.contiguous();
    TORCH_CHECK(ic.scalar_type() == at::kLong && (ic.numel() == 0 || ic.numel() == head.scored()),
                "RootDrafter: ids must be empty or one per scored row");
    ids_.assign(ic.data_ptr<int64_t>(), ic.data_ptr<int64_t>() + ic.numel());
  }

  // One drafted level: the state [1, H] after row `row` of h0 [n, H] and `token`, and its k drafts for sequence
  // `position` with their probabilities, ranked as the draw there will draw (rank_row): the same floats as
  // RootHead.step then rank_drafts. The state is one of two buffers the drafter holds, used in turn: valid until the
  // level after next, so a chain reads each level's state into the next (a forward's hidden states are read where
  // they lie, no row copied out between two forwards).
  std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<double>> draft(const torch::Tensor& h0, int64_t row,
                                                                            int64_t token, int64_t position) const {
    TORCH_CHECK(h0.dim() == 2 && h0.scalar_type() == at::kFloat && h0.size(1) == head_.hidden() &&
                    h0.stride(1) == 1 && 0 <= row && row < h0.size(0),
                "RootDrafter: a row of float32 states [n, hidden]");
    const torch::Tensor& state = states_[turn_];
    turn_ ^= 1;
    TORCH_CHECK(!state.is_same(h0), "RootDrafter: a state read two levels after it was drafted");
    thread_local std::vector<float> logits;  // (no tensor: nothing but rank_row reads them)
    logits.resize(head_.scored());
    head_.run(h0.data_ptr<float>() + row * h0.stride(0), &token, 1, state.data_ptr<float>(), logits.data());
    std::vector<int64_t> drafted(k_);
    std::vector<float> p(k_);
    rank_row(logits.data(), head_.scored(), ids_.empty() ? nullptr : ids_.data(), ban_, draw_.temperature(),
             draw_.top_p(), draw_.top_k(), draw_.min_p(), static_cast<uint64_t>(draw_.key(position)), k_,
             drafted.data(), p.data());
    return {state, drafted, std::vector<double>(p.begin(), p.end())};
  }

 private:
  RootHead head_;
  Draw draw_;
  std::vector<int64_t> ids_, ban_;
  int64_t k_;
  torch::Tensor states_[2] = {torch::empty({1, head_.hidden()}, torch::kFloat),
                              torch::empty({1, head_.hidden()}, torch::kFloat)};
  mutable int turn_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------
// Python entry points.

// y [R, N] = x [R, K] W^T (+ bias) for a packed weight (see Linear).
torch::Tensor linear(torch::Tensor x, int64_t fmt, torch::Tensor a, torch::Tensor d, torch::Tensor m,
                     torch::Tensor bias, int64_t n, bool bf16) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear: x must be float32 [R, K]");
  x = x.contiguous();
  const Linear L = linear_from(fmt, a, d, m, bias, n, x.size(1));
  auto out = torch::empty({x.size(0), n}, x.options());
  linear_into(L, x.data_ptr<float>(), x.size(0), out.data_ptr<float>(), bf16);
  return out;
}

// Attention of q [H_kv, G * n, D] for n new tokens over keys k [H_kv, S / kTile, D, kTile] (tiles: key_offset) and
// values v [H_kv, S, D], fp32 or bf16 (see attend_d).
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t n, int64_t past, torch::Tensor vis,
                     int64_t window, double scale, bool bf16_products) {
  TORCH_CHECK(q.dim() == 3, "attend: q must be 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attend: float32 queries");
  q = q.contiguous();
  const int64_t H = q.size(0), D = q.size(2);
  TORCH_CHECK(n > 0 && q.size(1) % n == 0, "attend: rows must be a multiple of the block's tokens");
  auto out = torch::empty_like(q);
  const auto anc = ancestors(vis, n);
  with_cache_type(k, v, "attend", [&](auto c) {
    attend_into<decltype(c)>(q.data_ptr<float>(), H, q.size(1) / n, n, D, k, v, past, anc, window,
                             static_cast<float>(scale), bf16_products, out.data_ptr<float>());
  });
  return out;
}

torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor w, double eps, bool bf16) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32");
  x = x.contiguous();
  auto out = torch::empty_like(x);
  rms_norm(x.data_ptr<float>(), w.contiguous().data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps),
           out.data_ptr<float>(), bf16);
  return out;
}

torch::Tensor silu_gate_rows(torch::Tensor gu, bool bf16) {
  gu = gu.contiguous();
  const int64_t I = gu.size(1) / 2;
  auto out = torch::empty({gu.size(0), I}, gu.options());
  silu_gate(gu.data_ptr<float>(), gu.size(0), I, out.data_ptr<float>(), bf16);
  return out;
}

// A whole decoder stack over n new tokens, in place on x [n, hidden]: per layer RMSNorm, the fused QKV projection,
// rotary embedding, the new keys and values written into the cache at slots past .. past + n - 1, attention, the
// output projection and residual, RMSNorm, the fused gate/up projection, the SiLU gate, the down projection and
// residual. kc [layers, H_kv, S / kTile, D, kTile] (tiles: key_offset) and vc [layers, H_kv, S, D] are the cache's
// buffers (fp32 or bf16); `norm_w` holds two norms' weights per layer and `Ls` four linear layers per layer (qkv, o,
// gate/up, down), found and checked when the stack was bound (Stack), so nothing in the parallel region may throw.
// With `bf16` the stack rounds to bf16 where a bf16 model does (round_bf16), x, cos and sin holding bf16 values.
// Token i's rotary rows are rows pos[i] of cos and sin. With `head`, the final norm (weights final_w) and the
// lm_head of the rows from `first` on follow in the same threads, into logits [n - first, head->n] (rounded to bf16
// with head_bf16).
template <int D, typename E>
void decoder_of(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const int64_t* pos, torch::Tensor kc,
                torch::Tensor vc, int64_t past, torch::Tensor vis, int64_t window,
                const std::vector<const float*>& norm_w, const std::vector<Linear>& Ls, int64_t n_heads, int64_t n_kv,
                double eps, double scale, bool bf16, const Linear* head, const float* final_w, int64_t first,
                bool head_bf16, float* logits) {
  const int64_t n = x.size(0), H = x.size(1), layers = static_cast<int64_t>(norm_w.size()) / 2;
  const int64_t G = n_heads / n_kv, q_dim = n_heads * D, kv_dim = n_kv * D, ld = q_dim + 2 * kv_dim;
  TORCH_CHECK(kc.dim() == 5 && kc.size(3) == D && kc.size(4) == kTile && kc.is_contiguous() && vc.dim() == 4 &&
              vc.stride(3) == 1 && vc.stride(2) == D, "decoder: keys in tiles, values by row");
  TORCH_CHECK(kc.size(0) >= layers && kc.size(2) * kTile >= past + n && vc.size(2) >= past + n,
              "decoder: cache too small");
  auto cs = cos.contiguous(), sn = sin.contiguous();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  const auto anc = ancestors(vis, n);
  E* kbase = static_cast<E*>(kc.data_ptr());
  E* vbase = static_cast<E*>(vc.data_ptr());
  const int64_t kh = kc.stride(1), vh = vc.stride(1);
  const int64_t inter = Ls[2].n / 2;
  float* xp = x.data_ptr<float>();
  std::vector<float> h(n * H), qkv(n * ld), att(n * q_dim), gu(n * 2 * inter), act(n * inter);
  Attention<D, E> attention(n_kv, G, n, past, anc, window, static_cast<float>(scale), !bf16);
  QuantRows xq[5];  // each linear layer's input, quantized, and the lm_head's
  for (int j = 0; j < 4; ++j) xq[j].size_for(n, Ls[j].k);
  if (head != nullptr) xq[4].size_for(n - first, H);
  const float ep = static_cast<float>(eps);
  // A head's rotary embedding and what follows it (a key head's key and value into the cache; a query head's scaled
  // query), per token: the KV heads first, then the query heads. A key head writes a cache line per dimension.
  const int64_t heads = n_kv + n_heads;
  std::vector<int64_t> head_cost(n * heads + 1);
  for (int64_t u = 0; u < n * heads; ++u) head_cost[u + 1] = head_cost[u] + (u % heads < n_kv ? 4 : 1);
  // Attention's rows go into att [n, q_dim], quantized there when a head's columns are whole quantization blocks.
  constexpr bool whole_blocks = D % kBlock == 0;
  const int threads = at::get_num_threads();
  // One region for the whole stack: every thread takes its part of each phase and they meet at a barrier after it.
  // The per-row glue is cut into (token, 32 columns) pieces, so a one-token step shares it too; a row's norm needs
  // the row's sum of squares, which each thread computes whole. The residual sums are taken by the output and down
  // projections, as they write their columns.
  std::vector<Claim> claims(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const Team team = Team::current(claims.data());
    // f(i, c0, c1) for the columns [c0, c1) of token i in this thread's part of n rows of `width` columns (pieces of
    // kBlock columns: a piece quantized is a whole block).
    auto pieces = [&](int64_t width, auto f, int64_t from = 0) {  // (rows from `from` on)
      const int64_t per = (width + kBlock - 1) / kBlock;
      run_parts(&team, [&](int64_t part, int64_t parts) { return equal_part((n - from) * per, part, parts); },
                [&](int64_t u0, int64_t u1) {
                  for (int64_t i = u0 / per; i * per < u1; ++i) {
                    const int64_t b0 = std::max(u0, i * per) - i * per, b1 = std::min(u1, (i + 1) * per) - i * per;
                    f(from + i, b0 * kBlock, std::min(b1 * kBlock, width));
                  }
                });
    };
    auto norm = [&](const float* w, const Linear& L, QuantRows& q) {
      pieces(H, [&](int64_t i, int64_t c0, int64_t c1) {
        rms_norm_columns(xp + i * H, w, H, ep, c0, c1, h.data() + i * H, bf16);
        if (quantized(L.fmt)) quantize_columns(h.data(), i, c0, c1, q);
      });
    };
    for (int64_t l = 0; l < layers; ++l) {
      const Linear* L = &Ls[l * 4];
      E* kp = kbase + l * kc.stride(0);
      E* vp = vbase + l * vc.stride(0);
      norm(norm_w[l * 2], L[0], xq[0]);
      linear_into(L[0], h.data(), n, qkv.data(), bf16, &team, &xq[0]);
      run_parts(&team, [&](int64_t part, int64_t parts) { return cost_part(head_cost, part, parts); },
                [&](int64_t u0, int64_t u1) {
                  for (int64_t u = u0; u < u1; ++u) {
                    const int64_t i = u / heads, hd = u % heads;
                    float* row = qkv.data() + i * ld;
                    if (hd >= n_kv) {
                      const int64_t hq = hd - n_kv;
                      rope_head(row + hq * D, D, cp + pos[i] * D, sp + pos[i] * D, bf16);
                      attention.query(hq, i, row + hq * D);
                      continue;
                    }
                    float* k = row + q_dim + hd * D;
                    const float* v = row + q_dim + kv_dim + hd * D;
                    rope_head(k, D, cp + pos[i] * D, sp + pos[i] * D, bf16);
                    for (int64_t j = 0; j < D; ++j) {
                      put(&kp[hd * kh + key_offset(past + i, D) + j * kTile], k[j]);
                      put(&vp[hd * vh + (past + i) * D + j], v[j]);
                    }
                  }
                });
      const bool quantize_att = quantized(L[1].fmt);
      attention.run(kp, kh, vp, vh, [&](int64_t hq, int64_t i, const float* o) {
        float* a = &att[i * q_dim + hq * D];
        for (int64_t j = 0; j < D; ++j) a[j] = store(o[j], bf16);
        if (quantize_att && whole_blocks) quantize_columns(att.data(), i, hq * D, (hq + 1) * D, xq[1]);
      }, &team);
      if (quantize_att && !whole_blocks)
        pieces(q_dim, [&](int64_t i, int64_t c0, int64_t c1) { quantize_columns(att.data(), i, c0, c1, xq[1]); });
      linear_into(L[1], att.data(), n, xp, bf16, &team, &xq[1], true);
      norm(norm_w[l * 2 + 1], L[2], xq[2]);
      linear_into(L[2], h.data(), n, gu.data(), bf16, &team, &xq[2]);
      pieces(inter, [&](int64_t i, int64_t c0, int64_t c1) {
        silu_gate_columns(gu.data() + i * 2 * inter, inter, c0, c1, act.data() + i * inter, bf16);
        if (quantized(L[3].fmt)) quantize_columns(act.data(), i, c0, c1, xq[3]);
      });
      linear_into(L[3], act.data(), n, xp, bf16, &team, &xq[3], true);
    }
    if (head != nullptr) {  // the final norm and the lm_head, of the rows from `first` on
      float* normed = h.data() + first * H;
      pieces(H, [&](int64_t i, int64_t c0, int64_t c1) {
        rms_norm_columns(xp + i * H, final_w, H, ep, c0, c1, h.data() + i * H, bf16);
        if (quantized(head->fmt)) quantize_columns(normed, i - first, c0, c1, xq[4]);
      }, first);
      linear_into(*head, normed, n - first, logits, head_bf16, &team, &xq[4]);
    }
  }
}

// A decoder stack's weights, found and checked once (core/runtime/model.py: Transformer.bind_stack): `norms` two
// weights per layer, `lin` four tensors per linear layer (packed, scales, mins, bias) and `meta` (format, n) per
// linear layer, four linear layers per layer (qkv, o, gate/up, down); the embedding `table` as (packed, scales, mins)
// and its (format, rows), or none; the lm_head as (packed, scales, mins, bias) and its (format, outputs), or none,
// with the final norm's weights. A forward then passes only its inputs: converting and checking the weights' few
// hundred tensors on every call cost more, between two forwards with the caches cold, than a layer's work.
class Stack {
 public:
  Stack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> lin, std::vector<int64_t> meta,
        std::vector<torch::Tensor> table, std::vector<int64_t> table_meta, std::vector<torch::Tensor> head,
        std::vector<int64_t> head_meta, torch::Tensor final_norm, int64_t n_heads, int64_t n_kv, int64_t head_dim,
        double eps, double scale, bool bf16, bool head_bf16)
      : n_heads_(n_heads), n_kv_(n_kv), head_dim_(head_dim), eps_(eps), scale_(scale), bf16_(bf16),
        head_bf16_(head_bf16) {
    TORCH_CHECK(!norms.empty() && norms.size() % 2 == 0, "decoder: two norms per layer");
    const int64_t layers = static_cast<int64_t>(norms.size()) / 2, q_dim = n_heads * head_dim;
    H_ = norms[0].numel();
    TORCH_CHECK(static_cast<int64_t>(lin.size()) == layers * 16 && static_cast<int64_t>(meta.size()) == layers * 8,
                "decoder: 4 linear layers per layer");
    layers_.resize(layers * 4);
    norm_w_.resize(layers * 2);
    for (int64_t l = 0; l < layers; ++l) {
      for (int j = 0; j < 4; ++j) {
        const int64_t at_ = (l * 4 + j) * 4;
        const int64_t k_in = j == 0 || j == 2 ? H_ : (j == 1 ? q_dim : meta[(l * 4 + 2) * 2 + 1] / 2);
        layers_[l * 4 + j] = linear_from(meta[(l * 4 + j) * 2], lin[at_], lin[at_ + 1], lin[at_ + 2], lin[at_ + 3],
                                         meta[(l * 4 + j) * 2 + 1], k_in);
      }
      for (int j = 0; j < 2; ++j) {
        const torch::Tensor& w = norms[l * 2 + j];
        TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H_,
                    "decoder: norm weights float32 [hidden]");
        norm_w_[l * 2 + j] = w.data_ptr<float>();
      }
    }
    if (!table.empty()) {
      TORCH_CHECK(table.size() == 3 && table_meta.size() == 2, "decoder: the table as (packed, scales, mins)");
      table_ = linear_from(table_meta[0], table[0], table[1], table[2], torch::Tensor(), table_meta[1], H_);
      has_table_ = true;
    }
    if (!head.empty()) {
      TORCH_CHECK(head.size() == 4 && head_meta.size() == 2, "decoder: the lm_head as (packed, scales, mins, bias)");
      TORCH_CHECK(final_norm.scalar_type() == at::kFloat && final_norm.is_contiguous() && final_norm.numel() == H_,
                  "decoder: final norm weights float32 [hidden]");
      head_ = linear_from(head_meta[0], head[0], head[1], head[2], head[3], head_meta[1], H_);
      final_w_ = final_norm.data_ptr<float>();
      has_head_ = true;
    }
    // held, so the pointers above stay valid for the object's life
    for (auto* group : {&norms, &lin, &table, &head}) held_.insert(held_.end(), group->begin(), group->end());
    held_.push_back(final_norm);
  }

  // The stack over n new tokens: their embeddings looked up in the table when `tokens` holds their ids (else given
  // as x [n, hidden]); token i's rotary rows are rows positions[i] of cos and sin [P, head_dim]; keys and values
  // written into kc [layers, H_kv, S / kTile, D, kTile] and vc [layers, H_kv, S, D] at slots past ..; new token i
  // sees new token j where vis[i][j] (empty: causally); `window` a sliding window (0: none). Returns the hidden
  // states [n, hidden] (x, where given) and, with `first` >= 0, the logits [n - first, outputs] of the rows from
  // `first` on: the final norm and the lm_head in the same threads.
  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor tokens, torch::Tensor cos, torch::Tensor sin,
                                     torch::Tensor positions, torch::Tensor kc, torch::Tensor vc, int64_t past,
                                     torch::Tensor vis, int64_t window, int64_t first) const {
    if (tokens.numel() > 0) {
      TORCH_CHECK(has_table_, "decoder: token ids, but no embedding table");
      x = embed_of(table_, tokens.reshape(-1), "decoder");
    }
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == H_,
                "decoder: x float32 [n, hidden]");
    const int64_t n = x.size(0);
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == n, "decoder: one position a token");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == head_dim_ && sin.sizes() == cos.sizes() &&
                cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "decoder: rotary tables [P, D]");
    auto pc = positions.contiguous();
    const int64_t* pos = pc.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(0 <= pos[i] && pos[i] < cos.size(0), "decoder: position ", pos[i], " outside the rotary table");
    const bool with_head = first >= 0;
    torch::Tensor logits;
    if (with_head) {
      TORCH_CHECK(has_head_, "decoder: logits asked for, but no lm_head");
      TORCH_CHECK(first < n, "decoder: logits from row ", first, " of ", n);
      logits = torch::empty({n - first, head_.n}, torch::kFloat);
    }
    with_cache_type(kc, vc, "decoder", [&](auto c) {
      with_head_size(head_dim_, "decoder", [&](auto d) {
        decoder_of<decltype(d)::value, decltype(c)>(
            x, cos, sin, pos, kc, vc, past, vis, window, norm_w_, layers_, n_heads_, n_kv_, eps_, scale_, bf16_,
            with_head ? &head_ : nullptr, final_w_, std::max<int64_t>(first, 0), head_bf16_,
            with_head ? logits.data_ptr<float>() : nullptr);
      });
    });
    return with_head ? std::vector<torch::Tensor>{x, logits} : std::vector<torch::Tensor>{x};
  }

 private:
  int64_t H_ = 0, n_heads_, n_kv_, head_dim_;
  double eps_, scale_;
  bool bf16_, head_bf16_, has_table_ = false, has_head_ = false;
  std::vector<Linear> layers_;  // four per layer
  std::vector<const float*> norm_w_;  // two per layer
  Linear table_{}, head_{};
  const float* final_w_ = nullptr;
  std::vector<torch::Tensor> held_;
};

// The kept rows of a verified block moved into place in the cache, in every layer and head: row d of the block from
// slot start + rows[d] to slot start + d, rows increasing (so no source is overwritten before it is read). A row's
// element j of head h in layer l lies at at(l, h, slot) + j * step: [layers, H_kv, S, D] values (step 1), or keys
// in tiles (step kTile).
template <typename E, typename At>
void move_rows(E* p, int64_t L, int64_t H, int64_t D, int64_t step, int64_t start, const std::vector<int64_t>& rows,
               At at) {
  // a block's slots of one element share a cache line or two in a tile of keys: all rows are moved per element, so
  // each line is fetched once. The lines lie far apart and cold, so both threads fetch them.
  const int threads = at::get_num_threads();
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t l = 0; l < L; ++l)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < D; ++j)
        for (size_t d = 0; d < rows.size(); ++d)
          if (rows[d] != static_cast<int64_t>(d))
            p[at(l, h, start + static_cast<int64_t>(d)) + j * step] = p[at(l, h, start + rows[d]) + j * step];
}

// keep_rows over the cache's keys kc [layers, H_kv, S / kTile, D, kTile] and values vc [layers, H_kv, S, D].
void keep_rows(torch::Tensor kc, torch::Tensor vc, int64_t start, std::vector<int64_t> rows) {
  TORCH_CHECK(rows.empty() || rows[0] >= 0, "keep_rows: a row before the block");
  for (size_t d = 1; d < rows.size(); ++d)
    TORCH_CHECK(rows[d] > rows[d - 1], "keep_rows: rows must increase");
  TORCH_CHECK(kc.dim() == 5 && kc.size(4) == kTile && kc.is_contiguous() && vc.dim() == 4 && vc.is_contiguous(),
              "keep_rows: keys in tiles, values by row");
  TORCH_CHECK(rows.empty() || (start + rows.back() < kc.size(2) * kTile && start + rows.back() < vc.size(2)),
              "keep_rows: a row past the cache");
  const int64_t L = vc.size(0), H = vc.size(1), D = vc.size(3);
  with_cache_type(kc, vc, "keep_rows", [&](auto c) {
    using E = decltype(c);
    const int64_t kl = kc.stride(0), kh = kc.stride(1), vl = vc.stride(0), vh = vc.stride(1);
    move_rows(static_cast<E*>(kc.data_ptr()), L, H, D, kTile, start, rows,
              [&](int64_t l, int64_t h, int64_t slot) { return l * kl + h * kh + key_offset(slot, D); });
    move_rows(static_cast<E*>(vc.data_ptr()), L, H, D, 1, start, rows,
              [&](int64_t l, int64_t h, int64_t slot) { return l * vl + h * vh + slot * D; });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // `bf16`: round to bf16 where a bf16 model does (round_bf16); fp32 activations without it
  m.def("linear", &linear, "y = x W^T (+ bias) over a packed weight", py::arg("x"), py::arg("fmt"), py::arg("a"),
        py::arg("d"), py::arg("m"), py::arg("bias"), py::arg("n"), py::arg("bf16") = false);
  m.def("bf16_dots", &bf16_dots, "whether bf16 pairs are multiplied on vdpbf16ps (else as two fmas: same floats)");
  m.def("set_bf16_dots", &set_bf16_dots, "pick the bf16 pairs' instruction (a test's switch); the previous choice");
  m.def("attend", &attend, "attention in each row's logical key order", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("n"), py::arg("past"), py::arg("vis"), py::arg("window"), py::arg("scale"),
        py::arg("bf16_products") = true);
  m.def("rms_norm", &rms_norm_rows, "RMSNorm of each row", py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("bf16") = false);
  m.def("silu_gate", &silu_gate_rows, "silu(gate) * up of each row", py::arg("gu"), py::arg("bf16") = false);
  py::class_<Stack>(m, "Stack", "a decoder stack's weights, found and checked once", py::module_local())
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                    std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<torch::Tensor>, std::vector<int64_t>,
                    torch::Tensor, int64_t, int64_t, int64_t, double, double, bool, bool>(),
           py::arg("norms"), py::arg("lin"), py::arg("meta"), py::arg("table"), py::arg("table_meta"),
           py::arg("head"), py::arg("head_meta"), py::arg("final_norm"), py::arg("n_heads"), py::arg("n_kv"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("bf16"), py::arg("head_bf16"))
      .def("forward", &Stack::forward, "the stack over a block of new tokens", py::arg("x"), py::arg("tokens"),
           py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("kc"), py::arg("vc"), py::arg("past"),
           py::arg("vis"), py::arg("window"), py::arg("first"));
  m.def("tasks_taken", [] { return tasks_taken.load(); }, "tasks a thread took from another's share, so far");
  m.def("keep_rows", &keep_rows, "the kept rows of a verified block moved into place in the cache");
  py::class_<Draw>(m, "Draw", "a generation's draw, its settings bound once", py::module_local())
      .def(py::init<int64_t, torch::Tensor, double, double, int64_t, double, double, int64_t, int64_t>(),
           py::arg("vocab"), py::arg("banned"), py::arg("temperature"), py::arg("top_p"), py::arg("top_k"),
           py::arg("min_p"), py::arg("penalty"), py::arg("window"), py::arg("seed"))
      .def("key", &Draw::key, "the noise key of a sequence position", py::arg("position"))
      .def("draw", &Draw::draw, "the token drawn from one row of logits", py::arg("logits"), py::arg("window"),
           py::arg("position"))
      .def("next", &Draw::next, "the token drawn after history[:length]", py::arg("logits"), py::arg("history"),
           py::arg("length"))
      .def("walk", &Draw::walk, "the accepted path through a verified tree and the token drawn after it",
           py::arg("logits"), py::arg("tokens"), py::arg("parents"), py::arg("history"), py::arg("length"));
  m.def("rank_drafts", &rank_drafts, "each row's k most likely drafts, ranked as the draw will draw");
  m.def("embed_rows", &embed_rows, "rows of a packed weight as fp32");
  py::class_<RootHead>(m, "RootHead", "the root head's weights, found and checked once", py::module_local())
      .def(py::init<std::vector<torch::Tensor>, double, std::vector<torch::Tensor>, std::vector<int64_t>>(),
           py::arg("norms"), py::arg("eps"), py::arg("lin"), py::arg("meta"))
      .def("step", &RootHead::step, "the root head's state and logits", py::arg("h0"), py::arg("roots"));
  py::class_<RootDrafter>(m, "RootDrafter", "the root head and the draw's filters, bound for a generation",
                          py::module_local())
      .def(py::init<const RootHead&, torch::Tensor, const Draw&, int64_t>(), py::arg("head"), py::arg("ids"),
           py::arg("draw"), py::arg("k"))
      .def("__call__", &RootDrafter::draft, "one drafted level: its state and its k drafts, ranked", py::arg("h0"),
           py::arg("row"), py::arg("token"), py::arg("position"));
}
