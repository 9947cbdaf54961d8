// Linear layers over packed fp32, bf16, q8_0 and q4_1 tiles, the activations quantized per row for the
// integer dot products.
// Part of the CPU kernels, compiled as one translation unit from cpu.cpp, whose opening comment says how every
// kernel stays row-invariant.
#pragma once

#include "threads.h"

namespace {

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
// Forced inline: GCC left it a call per block (the tile's accumulators through memory, a vzeroupper at each return),
// which made a block of 2 or 3 rows cost more per row than one of 4.
template <int G>
__attribute__((always_inline)) inline void q4_rows_avx2(const uint8_t* wb, const __m256 (&dw)[2],
                                                        const __m256 (&mw)[2], const QuantRows& xq, int64_t row0,
                                                        int64_t b, __m256 (*acc)[2]) {
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

// A group of 4 stays a call: inlined into the tile's loop it measured no faster, and slower in blocks of 8 rows.
__attribute__((noinline)) void q4_rows4_avx2(const uint8_t* wb, const __m256 (&dw)[2], const __m256 (&mw)[2],
                                            const QuantRows& xq, int64_t row0, int64_t b, __m256 (*acc)[2]) {
  q4_rows_avx2<4>(wb, dw, mw, xq, row0, b, acc);
}

// Rows R0 .. RB - 1 of one 4-bit block in near-equal groups of at most 4 (four rows' sums and a group's unpacked
// weights fill AVX2's 16 registers).
template <int RB, int R0>
inline void q4_groups_avx2(const uint8_t* wb, const __m256 (&dw)[2], const __m256 (&mw)[2], const QuantRows& xq,
                           int64_t r0, int64_t b, __m256 (*acc)[2]) {
  constexpr int left = RB - R0, groups = (left + 3) / 4, G = (left + groups - 1) / groups;
  if constexpr (G == 4) q4_rows4_avx2(wb, dw, mw, xq, r0 + R0, b, acc + R0);
  else q4_rows_avx2<G>(wb, dw, mw, xq, r0 + R0, b, acc + R0);
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

// The R rows of x as quantized weights take them (QuantRows); for fp32 and bf16 weights, none.
QuantRows quantized_rows(const Linear& L, const float* x, int64_t R) {
  QuantRows xq;
  if (quantized(L.fmt)) {
    xq.size_for(R, L.k);
    quantize_rows(x, 0, R, xq);
  }
  return xq;
}

// The whole of y = x W^T (into out, or with `add` added to it) over the threads: `team`'s (xq already made from x by
// the caller) or at::parallel_for's.
void linear_into(const Linear& L, const float* x, int64_t R, float* out, bool bf16, const Team* team = nullptr,
                 const QuantRows* xq = nullptr, bool add = false) {
  QuantRows own;
  if (xq == nullptr) {
    own = quantized_rows(L, x, R);
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

}  // namespace
