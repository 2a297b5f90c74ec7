// Shared by the native CPU kernels (rownorm.cc, bracket.cc): threads and loop constants.
#ifndef ROWGEOM_CSRC_COMMON_H_
#define ROWGEOM_CSRC_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace rowgeom {

constexpr int kLanes = 16;          // independent float accumulators of a row reduction
constexpr int64_t kBlockRows = 64;  // rows summed in float before adding to float64 totals

// Runs f(t) for t in [0, threads) on threads - 1 new threads and the caller.
template <class F>
void parallel(int threads, F&& f) {
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) pool.emplace_back(f, t);
  f(0);
  for (auto& th : pool) th.join();
}

// Thread t's share [lo, hi) of n items.
inline void split(int64_t n, int threads, int t, int64_t* lo, int64_t* hi) {
  *lo = n * t / threads;
  *hi = n * (t + 1) / threads;
}

// Threads for an array of `elements` whose parallel loop has `work` items: at most
// `requested`, one per 64 Ki elements (a new thread costs ~30 us; small heads are done before
// it starts) and one per item.
inline int thread_count(int64_t requested, int64_t work, int64_t elements) {
  const int64_t by_size = std::max<int64_t>(1, elements >> 16);
  return int(std::max<int64_t>(1, std::min({requested, work, by_size})));
}

}  // namespace rowgeom

#endif  // ROWGEOM_CSRC_COMMON_H_
