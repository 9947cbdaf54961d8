"""A CPU attention kernel for a handful of queries over a long KV cache, built on first use with the system's C++
compiler.

Decoding asks attention for 3-24 query rows per KV head (one token or a small token tree, times the query heads
that share a KV head) over thousands of cached keys. Batched matrix products handle that shape badly on a CPU: they
read the keys well below the memory's rate, and each further query row costs more. This kernel splits the keys into
chunks, reads each key and value once for all the rows, keeps a chunk's scores in cache for an exact softmax, and
merges the chunks' partial softmaxes in a fixed order (as flash-decoding does): so a row's result depends only on its
query and the keys it sees, not on how many rows came with it, how many keys are masked out or how many threads ran.

`attend` returns None when the kernel cannot be used (not a float32 CPU tensor, no compiler, or
TOKENSWIFT_ATTENTION=matmul): the caller then takes the matrix-product path, which computes the same function.
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor

from core.runtime.kernels.build import ROW_TILE, build

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>
""" + ROW_TILE + r"""
namespace {

constexpr int64_t kChunk = 256;  // keys per task; a chunk's scores stay in L1/L2
constexpr int64_t kTile = 64;    // keys per score tile: its accumulators vectorise over keys
constexpr float kMinExp = -87.0f;  // exp below this is under float's normal range: counted as 0

// exp(x) for x <= 0, written so the compiler vectorises it: e^x = 2^i * e^f with i = round(x log2 e),
// |f| <= ln(2)/2, e^f from its Taylor series to degree 8 (relative error < 1e-8, under float rounding).
inline float exp_nonpositive(float x) {
  const float t = (x > kMinExp ? x : kMinExp) * 1.44269504088896341f;
  const float i = __builtin_floorf(t + 0.5f);
  const float f = (t - i) * 0.693147180559945309f;
  float p = 1.0f / 40320.0f;
  p = p * f + 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(i) + 127) << 23);
  return x < kMinExp ? 0.0f : p * scale;
}

// Scores of RB rows for kTile keys, from keys stored transposed (kt[j * ks + l]): a row tile over the head
// dimensions, its accumulators along the keys.
template <int RB, int D>
inline void score_tile(const float* q, const float* kt, int64_t ks, float* p) {
  float acc[RB][kTile] = {};
  row_tile<RB, kTile>(q, D, kt, ks, D, acc);
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < kTile; ++i) p[r * kChunk + i] = acc[r][i];
}

// out[r] = sum_l w[r][l] * v[l] for RB rows over n keys: every loaded value vector serves RB rows.
template <int RB, int D>
inline void value_tile(const float* w, const float* v, int64_t n, float* out) {
  float acc[RB][D] = {};
  for (int64_t l = 0; l < n; ++l) {
    const float* vl = v + l * D;
    for (int r = 0; r < RB; ++r) {
      const float wl = w[r * kChunk + l];
#pragma omp simd
      for (int i = 0; i < D; ++i) acc[r][i] += wl * vl[i];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < D; ++i) out[r * D + i] = acc[r][i];
}

// Calls tile(rows, r) over R rows in blocks, `rows` a compile-time block size: blocks of 6 (measured: 6 keeps the
// compiler's accumulators in registers, more spill), then of 3, 2 or 1 for what is left.
template <typename Tile>
inline void for_row_blocks(int64_t R, Tile tile) {
  int64_t r = 0;
  for (; r + 6 <= R; r += 6) tile(std::integral_constant<int, 6>{}, r);
  for (; r + 3 <= R; r += 3) tile(std::integral_constant<int, 3>{}, r);
  if (R - r == 2) tile(std::integral_constant<int, 2>{}, r);
  else if (R - r == 1) tile(std::integral_constant<int, 1>{}, r);
}

// Scores of R rows for a chunk's n keys. A last, partial tile of keys is copied into a zero-padded one, so every
// score comes from the same arithmetic.
template <int D>
void chunk_scores(const float* q, const float* kt, int64_t ks, float* p, int64_t R, int64_t n) {
  float pad[D * kTile];
  const int64_t tiles = (n + kTile - 1) / kTile;
  if (n % kTile) {
    const int64_t l0 = (tiles - 1) * kTile, width = n - l0;
    std::fill(pad, pad + D * kTile, 0.0f);
    for (int j = 0; j < D; ++j) std::copy(kt + j * ks + l0, kt + j * ks + l0 + width, pad + j * kTile);
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const bool padded = (t + 1) * kTile > n;
    const float* src = padded ? pad : kt + t * kTile;
    const int64_t stride = padded ? kTile : ks;
    for_row_blocks(R, [&](auto rows, int64_t r) {
      score_tile<decltype(rows)::value, D>(q + r * D, src, stride, p + r * kChunk + t * kTile);
    });
  }
}

template <int D>
void chunk_values(const float* w, const float* v, int64_t n, float* out, int64_t R) {
  for_row_blocks(R, [&](auto rows, int64_t r) {
    value_tile<decltype(rows)::value, D>(w + r * kChunk, v, n, out + r * D);
  });
}

template <int D>
torch::Tensor attend_d(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& bias, float scale) {
  const int64_t H = q.size(0), R = q.size(1), L = k.size(1);
  const bool has_bias = bias.numel() > 0;
  const int64_t C = (L + kChunk - 1) / kChunk;
  std::vector<float> part_max(H * C * R), part_sum(H * C * R), part_acc(H * C * R * D);
  // Queries scaled once: softmax(scale * q.k) = softmax((scale * q).k).
  std::vector<float> qs(H * R * D);
  const float* qp = q.data_ptr<float>();
  for (int64_t i = 0; i < H * R * D; ++i) qs[i] = qp[i] * scale;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const int64_t ks = k.stride(2), kh_stride = k.stride(0), vh_stride = v.stride(0);

  at::parallel_for(0, H * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(R * kChunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / C, l0 = (task % C) * kChunk, n = std::min(kChunk, L - l0);
      const float* vh = vp + h * vh_stride + l0 * D;
      float* mx = &part_max[task * R];
      float* sum = &part_sum[task * R];
      chunk_scores<D>(&qs[h * R * D], kp + h * kh_stride + l0, ks, p.data(), R, n);
      for (int64_t r = 0; r < R; ++r) {
        float* pr = &p[r * kChunk];
        if (has_bias) {
          const float* br = bp + r * L + l0;
#pragma omp simd
          for (int64_t l = 0; l < n; ++l) pr[l] += br[l];
        }
        float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
        for (int64_t l = 0; l < n; ++l) m = std::max(m, pr[l]);
        mx[r] = m;
        float s = 0.0f;
        if (std::isinf(m)) {  // every key of this chunk is masked for this row
          std::fill(pr, pr + n, 0.0f);
        } else {
          for (int64_t l = 0; l < n; ++l) pr[l] = exp_nonpositive(pr[l] - m);
          // Summed over the whole chunk, zeros past its end: the order of the additions never depends on n.
          std::fill(pr + n, pr + kChunk, 0.0f);
#pragma omp simd reduction(+ : s)
          for (int64_t l = 0; l < kChunk; ++l) s += pr[l];
        }
        sum[r] = s;
      }
      chunk_values<D>(p.data(), vh, n, &part_acc[task * R * D], R);
    }
  });

  // Merge the chunks' softmaxes in chunk order, whatever thread computed them.
  auto out = torch::empty({H, R, D}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < C; ++c) m = std::max(m, part_max[(h * C + c) * R + r]);
      float* o = op + (h * R + r) * D;
      std::fill(o, o + D, 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = (h * C + c) * R + r;
        if (std::isinf(part_max[i])) continue;
        const float w = std::exp(part_max[i] - m);
        total += w * part_sum[i];
        const float* a = &part_acc[i * D];
        for (int64_t j = 0; j < D; ++j) o[j] += w * a[j];
      }
      for (int64_t j = 0; j < D; ++j) o[j] /= total;
    }
  }
  return out;
}

}  // namespace

// out[h, r] = softmax(scale * q[h, r] . k[h, l] + bias[r, l] over l) @ v[h]
// q [H, R, D]; k [H, L, D] stored transposed (stride 1 along L); v [H, L, D] with contiguous rows;
// bias [R, L] contiguous, or empty for none.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor bias, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q, k, v must be 3-D");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attend: float32 only");
  q = q.contiguous();
  const int64_t H = q.size(0), R = q.size(1), D = q.size(2), L = k.size(1);
  TORCH_CHECK(k.size(0) == H && v.size(0) == H && v.size(1) == L && k.size(2) == D && v.size(2) == D,
              "attend: shape mismatch");
  TORCH_CHECK(k.stride(1) == 1 && v.stride(2) == 1 && v.stride(1) == D,
              "attend: keys must be stored transposed, values row by row");
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.size(0) == R && bias.size(1) == L,
                "attend: bias must be a contiguous float32 [R, L]");
  }
  if (D == 64) return attend_d<64>(q, k, v, bias, static_cast<float>(scale));
  if (D == 128) return attend_d<128>(q, k, v, bias, static_cast<float>(scale));
  TORCH_CHECK(false, "attend: head size must be 64 or 128");
}
"""

_OFF = False  # set by `disabled()`, for side-by-side measurements


@functools.cache  # called for every layer of every step: the setting is read, the extension found, once
def kernel() -> Any | None:
    """The compiled extension (built on the first call, ~20 s; then loaded from the cache), or None."""
    if os.environ.get("TOKENSWIFT_ATTENTION", "kernel") == "matmul":
        return None
    return build("attention", SOURCE, ["attend"])


def attend(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor | None, scale: float) -> Tensor | None:
    """softmax(scale * q @ keys^T + bias) @ values per KV head, q [kv, rows, d]; None where the kernel does not
    apply (the caller computes it with matrix products)."""
    d = q.shape[-1]
    if (_OFF or q.device.type != "cpu" or q.dtype != torch.float32 or d not in (64, 128)
            or keys.stride(1) != 1 or values.stride(2) != 1 or values.stride(1) != d):
        return None  # keys not stored transposed (a CUDA or bf16 cache), or a head size without a kernel
    module = kernel()
    if module is None:
        return None
    empty = q.new_empty(0)
    return module.attend(q, keys, values, empty if bias is None else bias, scale)


@contextmanager
def disabled() -> Iterator[None]:
    """Within this block attention takes the matrix-product path (the cost curve's A/B of the kernel)."""
    global _OFF
    previous, _OFF = _OFF, True
    try:
        yield
    finally:
        _OFF = previous
