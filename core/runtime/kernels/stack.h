// The whole decoder stack over n new tokens in one call (decoder_of) and its weights bound once (Stack).
// Part of the CPU kernels, compiled as one translation unit from cpu.cpp, whose opening comment says how every
// kernel stays row-invariant.
#pragma once

#include "attention.h"
#include "draw.h"
#include "linear.h"
#include "row_ops.h"

// Stack, bound to Python, lives outside the anonymous namespace yet holds its types: GCC warns of that in a
// header (-Wsubobject-linkage), which several translation units might include; the kernels are one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsubobject-linkage"

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
  std::vector<float> qkv(n * ld), att(n * q_dim), gu(n * 2 * inter), act(n * inter);
  Attention<D, E> attention(n_kv, G, n, past, anc, window, static_cast<float>(scale), !bf16);
  const int threads = at::get_num_threads();
  // The norms (a layer's two, the final one): every thread normalises (and quantizes) the rows itself, into buffers
  // of its own that no other thread reads, so no barrier waits between a norm and the projection that reads it. A
  // norm is a few hundred floats a row.
  std::vector<std::vector<float>> normed_by(threads, std::vector<float>(n * H));
  std::vector<QuantRows> normed_q(threads);
  for (auto& q : normed_q) q.size_for(n, H);
  QuantRows att_q, act_q;  // the output and down projections' inputs, quantized
  att_q.size_for(n, Ls[1].k);
  act_q.size_for(n, Ls[3].k);
  const float ep = static_cast<float>(eps);
  // A head's rotary embedding and what follows it: a key head's keys and values of all n tokens into the cache, one
  // task per head (a key writes a cache line per dimension, shared with the other tokens' keys in its tile: split
  // over threads, those lines would pass between cores), then each token's query heads' scaled queries.
  const int64_t rope_tasks = n_kv + n * n_heads;
  std::vector<int64_t> head_cost(rope_tasks + 1);
  for (int64_t u = 0; u < rope_tasks; ++u) head_cost[u + 1] = head_cost[u] + (u < n_kv ? 4 * n : 1);
  // Attention's rows go into att [n, q_dim], quantized there when a head's columns are whole quantization blocks.
  constexpr bool whole_blocks = D % kBlock == 0;
  // One region for the whole stack: every thread takes its part of each phase and they meet at a barrier after it.
  // The other per-row glue is cut into (token, 32 columns) pieces, so a one-token step shares it too. The residual
  // sums are taken by the output and down projections, as they write their columns.
  std::vector<Claim> claims(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const Team team = Team::current(claims.data());
    // f(i, c0, c1) for the columns [c0, c1) of token i in this thread's part of n rows of `width` columns (pieces of
    // kBlock columns: a piece quantized is a whole block).
    auto pieces = [&](int64_t width, auto f) {
      const int64_t per = (width + kBlock - 1) / kBlock;
      run_parts(&team, [&](int64_t part, int64_t parts) { return equal_part(n * per, part, parts); },
                [&](int64_t u0, int64_t u1) {
                  for (int64_t i = u0 / per; i * per < u1; ++i) {
                    const int64_t b0 = std::max(u0, i * per) - i * per, b1 = std::min(u1, (i + 1) * per) - i * per;
                    f(i, b0 * kBlock, std::min(b1 * kBlock, width));
                  }
                });
    };
    float* own = normed_by[team.id].data();
    QuantRows& own_q = normed_q[team.id];
    // The norm (weights w) of the rows from `from` on, into this thread's buffer, quantized for L (row i as row
    // i - from): those rows.
    auto norm = [&](const float* w, const Linear& L, int64_t from = 0) {
      float* rows = own + from * H;
      for (int64_t i = from; i < n; ++i) {
        rms_norm_columns(xp + i * H, w, H, ep, 0, H, own + i * H, bf16);
        if (quantized(L.fmt)) quantize_columns(rows, i - from, 0, H, own_q);
      }
      return rows;
    };
    for (int64_t l = 0; l < layers; ++l) {
      const Linear* L = &Ls[l * 4];
      E* kp = kbase + l * kc.stride(0);
      E* vp = vbase + l * vc.stride(0);
      linear_into(L[0], norm(norm_w[l * 2], L[0]), n, qkv.data(), bf16, &team, &own_q);
      run_parts(&team, [&](int64_t part, int64_t parts) { return cost_part(head_cost, part, parts); },
                [&](int64_t u0, int64_t u1) {
                  for (int64_t u = u0; u < u1; ++u) {
                    if (u >= n_kv) {
                      const int64_t i = (u - n_kv) / n_heads, hq = (u - n_kv) % n_heads;
                      float* q = qkv.data() + i * ld + hq * D;
                      rope_head(q, D, cp + pos[i] * D, sp + pos[i] * D, bf16);
                      attention.query(hq, i, q);
                      continue;
                    }
                    for (int64_t i = 0; i < n; ++i) {
                      float* k = qkv.data() + i * ld + q_dim + u * D;
                      const float* v = k + kv_dim;
                      rope_head(k, D, cp + pos[i] * D, sp + pos[i] * D, bf16);
                      for (int64_t j = 0; j < D; ++j) {
                        put(&kp[u * kh + key_offset(past + i, D) + j * kTile], k[j]);
                        put(&vp[u * vh + (past + i) * D + j], v[j]);
                      }
                    }
                  }
                });
      const bool quantize_att = quantized(L[1].fmt);
      attention.run(kp, kh, vp, vh, [&](int64_t hq, int64_t i, const float* o) {
        float* a = &att[i * q_dim + hq * D];
        for (int64_t j = 0; j < D; ++j) a[j] = store(o[j], bf16);
        if (quantize_att && whole_blocks) quantize_columns(att.data(), i, hq * D, (hq + 1) * D, att_q);
      }, &team);
      if (quantize_att && !whole_blocks)
        pieces(q_dim, [&](int64_t i, int64_t c0, int64_t c1) { quantize_columns(att.data(), i, c0, c1, att_q); });
      linear_into(L[1], att.data(), n, xp, bf16, &team, &att_q, true);
      linear_into(L[2], norm(norm_w[l * 2 + 1], L[2]), n, gu.data(), bf16, &team, &own_q);
      pieces(inter, [&](int64_t i, int64_t c0, int64_t c1) {
        silu_gate_columns(gu.data() + i * 2 * inter, inter, c0, c1, act.data() + i * inter, bf16);
        if (quantized(L[3].fmt)) quantize_columns(act.data(), i, c0, c1, act_q);
      });
      linear_into(L[3], act.data(), n, xp, bf16, &team, &act_q, true);
    }
    if (head != nullptr)  // the final norm and the lm_head, of the rows from `first` on
      linear_into(*head, norm(final_w, *head, first), n - first, logits, head_bf16, &team, &own_q);
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

#pragma GCC diagnostic pop
