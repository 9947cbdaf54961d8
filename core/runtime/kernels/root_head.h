// Embedding lookups in packed tables and the root head's drafting step (RootHead, RootDrafter).
// Part of the CPU kernels, compiled as one translation unit from cpu.cpp, whose opening comment says how every
// kernel stays row-invariant.
#pragma once

#include "draw.h"
#include "linear.h"
#include "row_ops.h"

// RootHead and RootDrafter, bound to Python, live outside the anonymous namespace yet hold its types: GCC warns of
// that in a header (-Wsubobject-linkage), which several translation units might include; the kernels are one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsubobject-linkage"

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

#pragma GCC diagnostic pop
