"""A CPU matrix product for the few rows of a decoding step: y = x W^T + b for 1-32 rows of x, weights read once.

A decoding step multiplies one token, or a small token tree, by every weight of the model: it is bound by reading
the weights. The library's products handle these shapes badly (a second row costs far more than the roofline says);
this kernel streams each weight once per step for all rows: weights are packed once into tiles of 16 output columns
([N/16, K, 16], `pack`), a row's 16 partial sums stay in registers while the tile's K columns stream by, and up to
6 rows share every loaded weight vector. Compiled engines keep inductor's GEMMs inside their graphs
(core/runtime/model.py, PackedLinear).

Every output is the same sequence of fused multiply-adds over k in order, whichever rows came with it: a row's
result is bit-identical whether it is computed alone or inside a tree, so vanilla decoding and TokenSwift's
verification see the same floats. `linear` returns None when the kernel does not apply (not float32 on a CPU, too
many rows); `kernel()` is None without a compiler or with TOKENSWIFT_LINEAR=library, and then nothing is packed.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from core.runtime.kernels.build import ROW_TILE, build

COLS = 16  # output columns per packed tile (two AVX2 vectors, one AVX-512 vector)
MAX_ROWS = 32  # beyond this a step is compute-bound and the library GEMM is the better tool (prefill)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <vector>
""" + ROW_TILE + r"""
namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kMaxRows = 6;  // 6 rows x 16 columns of accumulators: 12 of AVX2's 16 vector registers

// out[r][c] = sum_k x[r][k] * w[k][c] (+ bias[c]) for RB rows and one packed tile w [K, kCols].
template <int RB>
inline void tile(const float* x, int64_t K, const float* w, const float* bias, float* out, int64_t ldo) {
  float acc[RB][kCols] = {};
  row_tile<RB, kCols>(x, K, w, kCols, K, acc);
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < kCols; ++c) out[r * ldo + c] = bias ? acc[r][c] + bias[c] : acc[r][c];
}

// R rows in ceil(R / kMaxRows) blocks of near-equal size (8 rows: 4 + 4, not 6 + 2: the tile is re-read per block).
void all_rows(const float* x, int64_t R, int64_t K, const float* w, const float* bias, float* out, int64_t ldo) {
  const int64_t blocks = (R + kMaxRows - 1) / kMaxRows;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int64_t rows = (R - r + blocks - b - 1) / (blocks - b);
    const float* xr = x + r * K;
    float* o = out + r * ldo;
    switch (rows) {
      case 1: tile<1>(xr, K, w, bias, o, ldo); break;
      case 2: tile<2>(xr, K, w, bias, o, ldo); break;
      case 3: tile<3>(xr, K, w, bias, o, ldo); break;
      case 4: tile<4>(xr, K, w, bias, o, ldo); break;
      case 5: tile<5>(xr, K, w, bias, o, ldo); break;
      default: tile<6>(xr, K, w, bias, o, ldo); break;
    }
    r += rows;
  }
}

}  // namespace

// x [R, K] float32; packed [T, K, 16] (see `pack`); bias [N] or None; returns [R, N].
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kCols, "linear: x [R, K], packed [T, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "linear: float32 only");
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == x.size(1) && n <= packed.size(0) * kCols && n > 0,
              "linear: shape mismatch");
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), T = packed.size(0), full = n / kCols;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "linear: bias [N]");
    bp = bias->data_ptr<float>();
  }
  auto out = torch::empty({R, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, full, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      all_rows(xp, R, K, wp + t * K * kCols, bp ? bp + t * kCols : nullptr, op + t * kCols, n);
  });
  if (full < T) {  // a last tile with fewer than 16 real columns: computed whole, its real columns kept
    const int64_t width = n - full * kCols;
    std::vector<float> last(R * kCols), b(kCols, 0.0f);
    if (bp) std::copy(bp + full * kCols, bp + n, b.begin());
    all_rows(xp, R, K, wp + full * K * kCols, b.data(), last.data(), kCols);
    for (int64_t r = 0; r < R; ++r) std::copy(&last[r * kCols], &last[r * kCols] + width, op + r * n + full * kCols);
  }
  return out;
}
"""


@functools.cache  # called for every layer of every step: the setting is read, the extension found, once
def kernel() -> Any | None:
    """The compiled extension (built on the first call, ~20 s; then loaded from the cache), or None."""
    if os.environ.get("TOKENSWIFT_LINEAR", "kernel") == "library":
        return None
    return build("linear", SOURCE, ["linear"])


def pack(weight: Tensor) -> Tensor:
    """weight [N, K] (nn.Linear's layout) as tiles of 16 output columns [ceil(N / 16), K, 16], zero-padded."""
    n, k = weight.shape
    padded = F.pad(weight.detach().float(), (0, 0, 0, -n % COLS))
    return padded.view(-1, COLS, k).transpose(1, 2).contiguous()


def unpack(packed: Tensor, n: int) -> Tensor:
    """The [n, K] weight that `pack` packed (a copy)."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def linear(x: Tensor, packed: Tensor, bias: Tensor | None, n: int) -> Tensor | None:
    """x @ W^T + bias from W's packed tiles (made by `pack` once `kernel()` was built), x [R, K]; None where the
    kernel does not apply (the caller uses the unpacked weight)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return None
    module = kernel()
    return None if module is None else module.linear(x, packed, bias, n)
