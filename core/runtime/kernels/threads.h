// Threads: a kernel's tasks cut into parts, run by at::parallel_for or by a Team of one OpenMP region whose
// threads claim each other's unstarted work.
// Part of the CPU kernels, compiled as one translation unit from cpu.cpp, whose opening comment says how every
// kernel stays row-invariant.
#pragma once

#include "numerics.h"

namespace {

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

}  // namespace
