// A generation's candidate trees in one call a step: the trie of the model's drafts and the n-gram continuations,
// rescored by the draft calibrator, cut to the budget, and the calibrator's learning once the step is drawn. It
// computes exactly what core/tokenswift/tree.py (TreeBuilder) and calibration.py (DraftCalibrator) compute, the
// reference it is tested against: the same double arithmetic in the same order, the same ties. Between two
// forwards, with every cache cold, these few dozen nodes cost more as Python objects than as this.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

constexpr int64_t kHeads = 1, kNgram = 2;  // tree.py: HEADS, NGRAM (a node's sources, a bit set)

using Level = std::vector<std::pair<int64_t, double>>;  // one depth's drafts: (token, chance)
using Continuations = std::vector<std::pair<std::vector<int64_t>, int64_t>>;  // (continuation, count)

// Python's seq[:stop] length for a sequence of `size` items.
int64_t python_prefix(int64_t size, int64_t stop) {
  if (stop < 0) stop += size;
  return std::clamp<int64_t>(stop, 0, size);
}

}  // namespace

class TreeDrafts {
 public:
  // budget, min_score: the tree's (TreeBuilder.build); ngram_weight: the n-gram scores' weight; chained: drafts as a
  // chain (add_chain) or every combination (add_product); calibrate: rescore by the calibrator (bins, prior, depths:
  // calibration.py's BINS, PRIOR, DEPTHS) and learn from each step, else the raw scores.
  TreeDrafts(int64_t budget, double min_score, double ngram_weight, bool chained, bool calibrate, int64_t bins,
             double prior, int64_t depths)
      : budget_(budget), min_score_(min_score), ngram_weight_(ngram_weight), chained_(chained),
        calibrate_(calibrate), bins_(bins), prior_(prior), depths_(depths),
        counts_(4 * (depths + 1) * bins, {0.0, 0.0}) {
    check(budget >= 1 && bins >= 1 && depths >= 1, "TreeDrafts: a budget, bins and depths of at least 1");
  }

  // DraftCalibrator.chance: the estimated chance that a draft of raw `score` from `source` at `depth` is drawn,
  // given its parent is.
  double chance(double score, int64_t source, int64_t depth) const {
    if (!calibrate_) return score;
    const auto& [seen, hits] = counts_[key(score, source, depth)];
    return (hits + prior_ * score) / (seen + prior_);
  }

  // draft_tree's trie below `root`: the model's drafts `levels`, then each n-gram key's continuations with its total
  // (the root's, then the first draft's, as draft_tree keys them), rescored and cut. Returns the tree's tokens,
  // parents, depths and sources (tree.py: Tree).
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> build(
      int64_t root, const std::vector<Level>& levels,
      const std::vector<std::pair<int64_t, Continuations>>& ngrams) {
    check(ngrams.size() == (levels.empty() ? 1u : 2u), "TreeDrafts: one n-gram key, two with drafts");
    check(levels.empty() || !levels[0].empty(), "TreeDrafts: the first level has no drafts");
    tokens_.assign(1, root);
    parents_.assign(1, -1);
    depths_of_.assign(1, 0);
    sources_.assign(1, 0);
    scores_.assign(1, std::numeric_limits<double>::infinity());
    children_.assign(1, {});
    if (chained_)
      add_chain(levels);
    else
      add_product(levels, {}, {}, 0);
    const int64_t depth = budget_ - 1;  // no deeper draft fits the tree
    for (size_t k = 0; k < ngrams.size(); ++k) {
      const auto& [total, conts] = ngrams[k];
      std::vector<int64_t> prefix;
      double base = 1.0;
      if (k == 1) {  // the first draft's continuations, below it
        prefix.push_back(levels[0][0].first);
        base = levels[0][0].second;
      }
      const int64_t lp = static_cast<int64_t>(prefix.size());
      for (const auto& [cont, count] : conts) {
        const double score =
            base * std::min(1.0, ngram_weight_ * static_cast<double>(count) / static_cast<double>(total + 1));
        std::vector<int64_t> path = prefix;
        path.insert(path.end(), cont.begin(), cont.begin() + python_prefix(cont.size(), depth - lp));
        std::vector<double> scores(prefix.size(), base);
        scores.resize(prefix.size() + cont.size(), score);
        add(path, scores, kNgram);
      }
    }
    if (calibrate_) recalibrate();
    return cut();
  }

  // DraftCalibrator.observe of the last built trie: `drawn` the tokens drawn after the root.
  void observe(const std::vector<int64_t>& drawn) {
    if (!calibrate_ || given_.empty()) return;
    int64_t node = 0;
    for (size_t d = 0; d < drawn.size(); ++d) {
      const int64_t token = drawn[d];
      int64_t next = -1;
      for (const auto& [draft, child] : children_[node]) {
        auto& [seen, hits] = counts_[key(given_[child], sources_[child], static_cast<int64_t>(d) + 1)];
        seen += 1.0;
        hits += draft == token ? 1.0 : 0.0;
        if (draft == token) next = child;
      }
      if (next < 0) return;
      node = next;
    }
  }

 private:
  size_t key(double score, int64_t source, int64_t depth) const {
    check(0 <= source && source < 4, "TreeDrafts: a source is a set of HEADS and NGRAM");
    const int64_t bin = std::min(bins_ - 1, std::max<int64_t>(0, static_cast<int64_t>(score * bins_)));
    return static_cast<size_t>((source * (depths_ + 1) + std::min(depth, depths_)) * bins_ + bin);
  }

  // TreeBuilder._child
  int64_t child(int64_t node, int64_t token, double score, int64_t source) {
    score = std::min(score, scores_[node]);
    for (const auto& [t, c] : children_[node])
      if (t == token) {
        sources_[c] |= source;
        scores_[c] = std::max(scores_[c], score);
        return c;
      }
    const int64_t c = static_cast<int64_t>(tokens_.size());
    children_[node].push_back({token, c});
    tokens_.push_back(token);
    parents_.push_back(node);
    depths_of_.push_back(depths_of_[node] + 1);
    sources_.push_back(source);
    scores_.push_back(score);
    children_.emplace_back();
    return c;
  }

  // TreeBuilder.add
  void add(const std::vector<int64_t>& path, const std::vector<double>& scores, int64_t source) {
    int64_t node = 0;
    for (size_t i = 0; i < std::min(path.size(), scores.size()); ++i) node = child(node, path[i], scores[i], source);
  }

  // TreeBuilder.add_chain
  void add_chain(const std::vector<Level>& levels) {
    int64_t node = 0;
    double above = 1.0;
    for (const auto& level : levels) {
      if (level.empty()) return;
      int64_t first = -1;
      for (const auto& [token, p] : level) {
        const int64_t c = child(node, token, above * p, kHeads);
        if (first < 0) first = c;
      }
      node = first;
      above = above * level[0].second;
    }
  }

  // TreeBuilder.add_product
  void add_product(const std::vector<Level>& levels, std::vector<int64_t> prefix, std::vector<double> scores,
                   size_t depth) {
    if (depth == levels.size()) return;
    for (const auto& [token, p] : levels[depth]) {
      const double s = (scores.empty() ? 1.0 : scores.back()) * p;
      prefix.push_back(token);
      scores.push_back(s);
      add(prefix, scores, kHeads);
      add_product(levels, prefix, scores, depth + 1);
      prefix.pop_back();
      scores.pop_back();
    }
  }

  // TreeBuilder.recalibrate with this calibrator's chances; the raw scores given the parents kept for observe.
  void recalibrate() {
    const std::vector<double> raw = scores_;
    given_.assign(raw.size(), 1.0);
    for (size_t i = 1; i < raw.size(); ++i) {
      const int64_t parent = parents_[i];
      given_[i] = parent == 0 ? raw[i] : (raw[parent] > 0 ? raw[i] / raw[parent] : 0.0);
      scores_[i] = (parent == 0 ? 1.0 : scores_[parent]) * chance(given_[i], sources_[i], depths_of_[i]);
    }
  }

  // TreeBuilder.build: the root and the budget - 1 best nodes scoring at least min_score, parents first.
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> cut() const {
    std::vector<int64_t> order;
    for (int64_t i = 1; i < static_cast<int64_t>(tokens_.size()); ++i)
      if (scores_[i] >= min_score_) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return scores_[a] > scores_[b]; });
    order.resize(std::min<size_t>(order.size(), static_cast<size_t>(std::max<int64_t>(0, budget_ - 1))));
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return depths_of_[a] < depths_of_[b] || (depths_of_[a] == depths_of_[b] && a < b);
    });
    std::vector<int64_t> keep(1, 0), index(tokens_.size(), -1);
    keep.insert(keep.end(), order.begin(), order.end());
    std::vector<int64_t> tokens, parents, depths, sources;
    for (size_t j = 0; j < keep.size(); ++j) {
      const int64_t i = keep[j];
      index[i] = static_cast<int64_t>(j);
      tokens.push_back(tokens_[i]);
      parents.push_back(j == 0 ? -1 : index[parents_[i]]);
      check(j == 0 || parents.back() >= 0, "tree selection must be prefix-closed");
      depths.push_back(depths_of_[i]);
      sources.push_back(sources_[i]);
    }
    return {tokens, parents, depths, sources};
  }

  int64_t budget_;
  double min_score_, ngram_weight_;
  bool chained_, calibrate_;
  int64_t bins_;
  double prior_;
  int64_t depths_;
  std::vector<std::pair<double, double>> counts_;  // (source, depth, bin) -> (drafts judged, drafts drawn)
  // the last trie built: node 0 the root, parents before children
  std::vector<int64_t> tokens_, parents_, depths_of_, sources_;
  std::vector<double> scores_, given_;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> children_;  // (token, child), in the order added
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<TreeDrafts>(m, "TreeDrafts", "a generation's candidate trees and draft calibrator", py::module_local())
      .def(py::init<int64_t, double, double, bool, bool, int64_t, double, int64_t>(), py::arg("budget"),
           py::arg("min_score"), py::arg("ngram_weight"), py::arg("chained"), py::arg("calibrate"), py::arg("bins"),
           py::arg("prior"), py::arg("depths"))
      .def("chance", &TreeDrafts::chance, "the calibrated chance of a draft", py::arg("score"), py::arg("source"),
           py::arg("depth"))
      .def("build", &TreeDrafts::build, "a step's tree: tokens, parents, depths, sources", py::arg("root"),
           py::arg("levels"), py::arg("ngrams"))
      .def("observe", &TreeDrafts::observe, "learn from the tokens drawn after the root", py::arg("drawn"));
}
