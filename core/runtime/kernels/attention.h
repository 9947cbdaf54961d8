// Attention of a block of new tokens over the KV cache, each row over its keys in logical order, in chunks whose
// partial softmaxes merge in order.
// Part of the CPU kernels, compiled as one translation unit from cpu.cpp, whose opening comment says how every
// kernel stays row-invariant.
#pragma once

#include "threads.h"

namespace {

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
// in order (in pairs, odd first, with Pairs). `next` (or null): a tile fetched meanwhile, spread over the multiplies,
// and with it `values` (or null): this tile's keys' value rows (kTile of D elements, as many lines as a tile), so the
// weighted sum after the chunk's softmax finds them at hand instead of starting a stream of its own.
template <int RB, int D, typename E, bool Pairs>
inline void score_tile(const float* q, const E* kt, int64_t width, float* p, int64_t ldp, const E* next,
                       const E* values = nullptr) {
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
        for (int64_t u = step * lines / steps; u < (step + 1) * lines / steps; ++u) {
          __builtin_prefetch(next + u * line, 0, kCacheToL2);
          if (values != nullptr) __builtin_prefetch(values + u * line, 0, kCacheToL2);
        }
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
    if (values != nullptr)
      for (int64_t l = 0; l < kTile; l += line) __builtin_prefetch(values + j * kTile + l, 0, kCacheToL2);
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
// values and qp (on vdpbf16ps) the same rows as bf16 pairs. `values` (or null): the value rows of slots s0 on, fetched
// as each tile's scores are computed where the tiles take them (score_tile).
template <int D, typename E>
void scores(const float* q, const int32_t* qp, int64_t R, const E* kt, int64_t s0, int64_t n, float* p,
            int64_t ldp, bool pairs, const E* values = nullptr) {
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
      const E* tile_values = r == 0 && values != nullptr ? values + t0 * D : nullptr;
      pairs ? score_tile<RB, D, E, true>(q + r * D, src, width, p + r * ldp + t0, ldp, ahead, tile_values)
            : score_tile<RB, D, E, false>(q + r * D, src, width, p + r * ldp + t0, ldp, ahead, tile_values);
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
      // the chunk's first values are on their way while its scores are computed (value_tile fetches the rest ahead;
      // where the score tiles take them, the scores fetch every committed key's values too)
      const E* vc = vp + h * vh + c0 * D;
      for (int64_t i = 0; i < std::min(shared, kValuesAhead<E>) * D; i += 64 / sizeof(E))
        __builtin_prefetch(vc + i, 0, kCacheToL2);
      if (shared > 0)
        scores<D, E>(&qs[h * R * D], query_pairs(h), R, kp + h * kh, c0, shared, p.data(), kChunk, pairs, vc);
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

}  // namespace
