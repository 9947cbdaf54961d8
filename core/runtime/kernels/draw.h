// The draw (the processed distribution's Gumbel-max sample, in one pass over the vocabulary), the sampling
// filters and the drafts' ranking.
// Part of the CPU kernels, compiled as one translation unit from cpu.cpp, whose opening comment says how every
// kernel stays row-invariant.
#pragma once

#include "threads.h"

namespace {

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
