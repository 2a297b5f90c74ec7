// Projected RowNorm on one CPU device, as an XLA FFI custom call (built and called by rowgeom/_native.py).
//
// y = P rownorm(P x) over the token rows of a float32 matrix, in place when XLA aliases the
// output to a donated input. The exact algorithm needs the column mean m, the squared norms of
// the centred rows and the weighted column sum s of the normalised rows before the first
// output row is written; this kernel reads the array from memory as few times as that allows:
//
//   tokens are rows (a (V, d) table):    read (m), read (norms and s), read + write
//   tokens are columns (a (d, V) kernel): read (m and norms: each feature row is re-read from
//                                        cache), read + write (s per feature row, again from
//                                        cache just before the row is written)
//
// Against the floor (one read and one write, a donated x * 0.5) a plain read costs ~0.75 on a
// 2-core machine, so the bounds are ~2.5x and ~1.75x; measured 3.1-3.3x and 2.0-2.6x at
// (50304, 768), against 5.1x and 5.7x for the XLA formulation (docs/benchmarks.md). Tried and
// dropped: slabs of 16 feature columns for (V, d) (one read fewer, but strided rows: 17x),
// walking pass 2 backwards row by row (defeats the prefetcher), 64 accumulator lanes.
// Pass 2 of (V, d) walks its blocks in reverse so it starts on rows pass 1 left in cache.
//
// Semantics are those of rowgeom._rownorm._reference_path, float32 throughout except that the
// per-column sums are accumulated in float64 per block of rows:
//   pivot p = mean of the first min(2, num_valid) valid rows (scaled), centring is
//   (x*scale - p) - mean(x*scale - p); weights 1 / max(||c_i||, eps); padding rows are 0.
// Overflow guard: if a squared norm exceeds 2^100 or is not finite, everything is recomputed
// on input scaled by the power of two that brings max |x| to about 2^20 (eps scaled alike).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using rowgeom::kBlockRows;
using rowgeom::kLanes;
using rowgeom::parallel;
using rowgeom::split;

constexpr float kHugeExp = 50.0f;   // the overflow guard's threshold 2^50 on max |x|
const float kTiny = std::numeric_limits<float>::min();

inline float sum_lanes(const float* a, int64_t n, float scale, float p) {  // sum(a*scale - p)
  float acc[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[j + l] * scale - p;
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  for (; j < n; ++j) total += double(a[j] * scale - p);
  return float(total);
}

float max_abs(const float* x, int64_t cols, int64_t valid_rows,
              int64_t valid_cols, int threads) {
  std::vector<float> part(threads, 0.0f);
  parallel(threads, [&](int t) {
    int64_t lo, hi;
    split(valid_rows, threads, t, &lo, &hi);
    float m = 0.0f;
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t j = 0; j < valid_cols; ++j) {
        float a = std::fabs(x[i * cols + j]);
        m = (a > m || std::isnan(a)) ? a : m;  // NaN wins, as in jnp.max
      }
    part[t] = m;
  });
  float m = 0.0f;
  for (float p : part) m = (p > m || std::isnan(p)) ? p : m;
  return m;
}

// The overflow guard of _overflow_guard: scale 1 unless max |x| > 2^50.
void guard(float amax, float eps, float* scale, float* eps_scaled) {
  if (amax > std::exp2(kHugeExp)) {
    *scale = std::exp2(20.0f - std::floor(std::log2(amax)));
    *eps_scaled = std::max(eps * *scale, kTiny);
  } else {
    *scale = 1.0f;
    *eps_scaled = eps;
  }
}

inline bool suspect(float n2) { return !(n2 <= std::exp2(2 * kHugeExp)); }

struct Options {
  int64_t num_valid;
  float eps;
  bool center_input, center_output;
  int threads;
};

// What the output pass needs, per feature (pivot, mean; colsum: the output centring of the
// (V, F) layout) and per valid token (the weight 1 / max(norm, eps)), and the largest squared
// norm for the overflow guard.
struct Stats {
  std::vector<float> pivot, mean, colsum, weights;
  float max_n2 = 0.0f;
  Stats(int64_t F, int64_t nv) : pivot(F, 0.0f), mean(F, 0.0f), colsum(F, 0.0f), weights(nv, 0.0f) {}
};

// ---------------------------------------------------------------- tokens are rows: (V, F)


Stats row_stats(const float* x, int64_t F, const Options& o, float scale, float eps) {
  const int64_t nv = o.num_valid;
  const int T = o.threads;
  Stats st(F, nv);
  if (o.center_input) {
    const int64_t k = std::min<int64_t>(2, nv);
    for (int64_t j = 0; j < F; ++j) {
      float s = 0.0f;
      for (int64_t i = 0; i < k; ++i) s += x[i * F + j] * scale;
      st.pivot[j] = s * (1.0f / float(k));
    }
    std::vector<std::vector<double>> part(T, std::vector<double>(F, 0.0));
    parallel(T, [&](int t) {
      int64_t lo, hi;
      split(nv, T, t, &lo, &hi);
      std::vector<float> block(F);
      const float* p = st.pivot.data();
      double* total = part[t].data();
      for (int64_t b = lo; b < hi; b += kBlockRows) {
        std::fill(block.begin(), block.end(), 0.0f);
        const int64_t e = std::min(hi, b + kBlockRows);
        int64_t i = b;
        for (; i + 4 <= e; i += 4) {  // four rows per sweep of the block accumulator
          const float *x0 = x + i * F, *x1 = x0 + F, *x2 = x1 + F, *x3 = x2 + F;
          float* bl = block.data();
          for (int64_t j = 0; j < F; ++j)
            bl[j] += ((x0[j] * scale - p[j]) + (x1[j] * scale - p[j])) +
                     ((x2[j] * scale - p[j]) + (x3[j] * scale - p[j]));
        }
        for (; i < e; ++i) {
          const float* xi = x + i * F;
          for (int64_t j = 0; j < F; ++j) block[j] += xi[j] * scale - p[j];
        }
        for (int64_t j = 0; j < F; ++j) total[j] += block[j];
      }
    });
    for (int64_t j = 0; j < F; ++j) {
      double s = 0.0;
      for (int t = 0; t < T; ++t) s += part[t][j];
      st.mean[j] = float(s / double(nv));
    }
  }
  std::vector<std::vector<double>> part(T, std::vector<double>(F, 0.0));
  std::vector<float> max_part(T, 0.0f);
  parallel(T, [&](int t) {
    int64_t lo, hi;
    split(nv, T, t, &lo, &hi);
    std::vector<float> c(2 * F), block(F);
    const float* p = st.pivot.data();
    const float* m = st.mean.data();
    double* total = part[t].data();
    float mx = 0.0f;
    // The centred row (kept in L1) and its squared norm in one sweep; returns the weight.
    auto centre = [&](int64_t i, float* ci) {
      const float* xi = x + i * F;
      float lanes[kLanes] = {0};
      int64_t j = 0;
      for (; j + kLanes <= F; j += kLanes)
        for (int l = 0; l < kLanes; ++l) {
          const float v = (xi[j + l] * scale - p[j + l]) - m[j + l];
          ci[j + l] = v;
          lanes[l] += v * v;
        }
      double sq = 0.0;
      for (int l = 0; l < kLanes; ++l) sq += lanes[l];
      for (; j < F; ++j) {
        ci[j] = (xi[j] * scale - p[j]) - m[j];
        sq += double(ci[j]) * ci[j];
      }
      const float n2 = float(sq);
      mx = (n2 > mx || std::isnan(n2)) ? n2 : mx;
      const float w = 1.0f / std::max(std::sqrt(n2), eps);
      st.weights[i] = w;
      return w;
    };
    float* c0 = c.data();
    float* c1 = c0 + F;
    float* bl = block.data();
    // Blocks in reverse order (rows forward within a block, for the prefetcher): the rows
    // the previous pass read last are still in the last-level cache.
    for (int64_t e = hi; e > lo; e -= kBlockRows) {
      std::fill(block.begin(), block.end(), 0.0f);
      const int64_t b = std::max(lo, e - kBlockRows);
      int64_t i = b;
      for (; i + 2 <= e; i += 2) {  // two rows per sweep of the block accumulator
        const float w0 = centre(i, c0), w1 = centre(i + 1, c1);
        if (o.center_output)
          for (int64_t j = 0; j < F; ++j) bl[j] += c0[j] * w0 + c1[j] * w1;
      }
      if (i < e) {
        const float w0 = centre(i, c0);
        if (o.center_output)
          for (int64_t j = 0; j < F; ++j) bl[j] += c0[j] * w0;
      }
      if (o.center_output)
        for (int64_t j = 0; j < F; ++j) total[j] += bl[j];
    }
    max_part[t] = mx;
  });
  for (int64_t j = 0; j < F; ++j) {
    double s = 0.0;
    for (int t = 0; t < T; ++t) s += part[t][j];
    st.colsum[j] = float(s / double(nv));
  }
  for (float v : max_part) st.max_n2 = (v > st.max_n2 || std::isnan(v)) ? v : st.max_n2;
  return st;
}

void token_rows(const float* x, float* y, int64_t V, int64_t F, const Options& o) {
  float scale = 1.0f, eps = o.eps;
  Stats st = row_stats(x, F, o, scale, eps);
  if (suspect(st.max_n2)) {
    guard(max_abs(x, F, o.num_valid, F, o.threads), o.eps, &scale, &eps);
    st = row_stats(x, F, o, scale, eps);
  }
  const int64_t nv = o.num_valid;
  parallel(o.threads, [&](int t) {
    int64_t lo, hi;
    split(V, o.threads, t, &lo, &hi);
    const float* p = st.pivot.data();
    const float* m = st.mean.data();
    const float* s = st.colsum.data();
    for (int64_t i = lo; i < hi; ++i) {
      const float* xi = x + i * F;
      float* yi = y + i * F;
      if (i >= nv) {
        std::memset(yi, 0, sizeof(float) * F);
        continue;
      }
      const float w = st.weights[i];
      for (int64_t j = 0; j < F; ++j) yi[j] = ((xi[j] * scale - p[j]) - m[j]) * w - s[j];
    }
  });
}

// ---------------------------------------------------------- tokens are columns: (F, V)

Stats col_stats(const float* x, int64_t F, int64_t V, const Options& o, float scale,
                float eps) {
  const int64_t nv = o.num_valid;
  const int T = o.threads;
  Stats st(F, nv);
  const int64_t k = std::min<int64_t>(2, nv);
  // Each thread takes whole feature rows: their mean, then (the row still in cache) their
  // squares into a private copy of the token norms.
  std::vector<std::vector<float>> n2(T, std::vector<float>(nv, 0.0f));
  parallel(T, [&](int t) {
    int64_t lo, hi;
    split(F, T, t, &lo, &hi);
    float* acc = n2[t].data();
    for (int64_t j = lo; j < hi; ++j) {
      const float* xj = x + j * V;
      float p = 0.0f, m = 0.0f;
      if (o.center_input) {
        for (int64_t i = 0; i < k; ++i) p += xj[i] * scale;
        p *= 1.0f / float(k);
        m = sum_lanes(xj, nv, scale, p) / float(nv);
      }
      st.pivot[j] = p;
      st.mean[j] = m;
      for (int64_t i = 0; i < nv; ++i) {
        const float c = (xj[i] * scale - p) - m;
        acc[i] += c * c;
      }
    }
  });
  float mx = 0.0f;
  for (int64_t i = 0; i < nv; ++i) {
    float s = 0.0f;
    for (int t = 0; t < T; ++t) s += n2[t][i];
    mx = (s > mx || std::isnan(s)) ? s : mx;
    st.weights[i] = 1.0f / std::max(std::sqrt(s), eps);
  }
  st.max_n2 = mx;
  return st;
}

void tokens_minor(const float* x, float* y, int64_t F, int64_t V, const Options& o) {
  float scale = 1.0f, eps = o.eps;
  Stats st = col_stats(x, F, V, o, scale, eps);
  if (suspect(st.max_n2)) {
    guard(max_abs(x, V, F, o.num_valid, o.threads), o.eps, &scale, &eps);
    st = col_stats(x, F, V, o, scale, eps);
  }
  const int64_t nv = o.num_valid;
  const float* w = st.weights.data();
  parallel(o.threads, [&](int t) {
    int64_t lo, hi;
    split(F, o.threads, t, &lo, &hi);
    for (int64_t j = lo; j < hi; ++j) {
      const float* xj = x + j * V;
      float* yj = y + j * V;
      const float p = st.pivot[j], m = st.mean[j];
      float s = 0.0f;
      if (o.center_output) {
        float acc[kLanes] = {0};
        int64_t i = 0;
        for (; i + kLanes <= nv; i += kLanes)
          for (int l = 0; l < kLanes; ++l)
            acc[l] += ((xj[i + l] * scale - p) - m) * w[i + l];
        double total = 0.0;
        for (int l = 0; l < kLanes; ++l) total += acc[l];
        for (; i < nv; ++i) total += double(((xj[i] * scale - p) - m) * w[i]);
        s = float(total / double(nv));
      }
      for (int64_t i = 0; i < nv; ++i) yj[i] = ((xj[i] * scale - p) - m) * w[i] - s;
      for (int64_t i = nv; i < V; ++i) yj[i] = 0.0f;
    }
  });
}

ffi::Error RowNormImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y,
                       bool tokens_are_rows, int64_t num_valid, float eps, bool center_input,
                       bool center_output, int64_t threads) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("rowgeom_rownorm: expected 2-D");
  const int64_t rows = dims[0], cols = dims[1];
  const int64_t vocab = tokens_are_rows ? rows : cols;
  if (num_valid < 1 || num_valid > vocab)
    return ffi::Error::InvalidArgument("rowgeom_rownorm: num_valid out of range");
  const int64_t work = tokens_are_rows ? num_valid : rows;
  Options o{num_valid, eps, center_input, center_output,
            rowgeom::thread_count(threads, work, rows * cols)};
  if (tokens_are_rows)
    token_rows(x.typed_data(), y->typed_data(), rows, cols, o);
  else
    tokens_minor(x.typed_data(), y->typed_data(), rows, cols, o);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowgeomRowNorm, RowNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("tokens_are_rows")
                                  .Attr<int64_t>("num_valid")
                                  .Attr<float>("eps")
                                  .Attr<bool>("center_input")
                                  .Attr<bool>("center_output")
                                  .Attr<int64_t>("threads"));
