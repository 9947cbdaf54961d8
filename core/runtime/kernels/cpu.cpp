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
// The kernels live in the headers included below, one part each; with this file's Python entry points they compile
// as one translation unit, once per instruction set level (build.py): AVX-512 with VNNI, AVX2, or plain C++.

#include "numerics.h"
#include "threads.h"
#include "linear.h"
#include "attention.h"
#include "row_ops.h"
#include "draw.h"
#include "root_head.h"
#include "stack.h"

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

// `passes` passes of out [R, N] = x [R, K] W^T over a packed weight, every thread passing over its own equal part of
// the tiles at once (so its part stays in its core's caches, as the compute floor asks): the seconds per pass. A
// call's own costs (quantizing x, starting the threads) are paid once for all its passes.
double linear_passes(torch::Tensor x, int64_t fmt, torch::Tensor a, torch::Tensor d, torch::Tensor m,
                     torch::Tensor bias, int64_t n, torch::Tensor out, int64_t passes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "linear_passes: x float32 [R, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == x.size(0) * n,
              "linear_passes: out float32 [R, N]");
  TORCH_CHECK(passes > 0, "linear_passes: at least one pass");
  const Linear L = linear_from(fmt, a, d, m, bias, n, x.size(1));
  const int64_t R = x.size(0), T = (n + kCols - 1) / kCols;
  const QuantRows xq = quantized_rows(L, x.data_ptr<float>(), R);
  const int threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const Team team = Team::current(nullptr);
    const auto [t0, t1] = equal_part(T, team.id, team.size);
    for (int64_t p = 0; p < passes; ++p)
      linear_tiles(L, x.data_ptr<float>(), xq, R, t0, t1, out.data_ptr<float>(), false, false);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / passes;
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
  m.def("linear_passes", &linear_passes, "seconds per pass of linear, each thread over its own part",
        py::arg("x"), py::arg("fmt"), py::arg("a"), py::arg("d"), py::arg("m"), py::arg("bias"), py::arg("n"),
        py::arg("out"), py::arg("passes"));
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
