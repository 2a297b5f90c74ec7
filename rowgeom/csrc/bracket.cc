// The O(Vd) row-diameter bracket on one CPU device, as an XLA FFI custom call (built and called
// by rowgeom/_native.py; the maths: rowgeom._geometry._bounds3 and row_diameter_bounds).
//
//   row_sum = sum_i x_i;  c = row_sum / V;  r_c^2 = max_i ||x_i - c||^2 (argmax a_0);
//   upper = 2 r_c;  each of `sweeps` farthest-point sweeps: from anchor a, the farthest row b,
//   lower = max(lower, ||x_a - x_b||), a = b;  with no sweep the centroid lower bound
//   max(r_c, sqrt(2 / (V - 1)) sqrt(sum_i ||x_i - c||^2));  finally lower = min(lower, upper).
//
// Passes over memory: a (d, V) kernel is read once for the centroid distances (each feature
// row's mean is known once the row is read; its squares go into the token distances while it
// is in cache) and once per sweep; a (V, d) table needs one more read (the column sum first).
// Max and argmax follow jnp.max / jnp.argmax: NaN wins, the first index among equals.
// Over- or underflow of the squares is handled by the caller (it redoes the bracket on
// power-of-two rescaled rows when the upper bound is out of range), as for the XLA formulation.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using rowgeom::kBlockRows;
using rowgeom::kLanes;
using rowgeom::parallel;
using rowgeom::split;

// Running (max, argmax, sum) with jnp semantics: NaN wins, first index among equals.
struct Top {
  float max = -INFINITY;
  int64_t index = 0;
  double sum = 0.0;
  bool any = false;
  void add(float v, int64_t i) {
    if (!any || (!std::isnan(max) && (v > max || std::isnan(v)))) {
      max = v;
      index = i;
      any = true;
    }
    sum += v;
  }
  void merge(const Top& o) {  // `o` covers later indices
    if (!o.any) return;
    if (!any || (!std::isnan(max) && (o.max > max || std::isnan(o.max)))) {
      max = o.max;
      index = o.index;
      any = true;
    }
    sum += o.sum;
  }
};

// Squared distance of each valid row of a (V, F) array to `point`, reduced to a Top.
Top rows_to_point(const float* x, int64_t V, int64_t F, const float* point, int T) {
  std::vector<Top> part(T);
  parallel(T, [&](int t) {
    int64_t lo, hi;
    split(V, T, t, &lo, &hi);
    Top top;
    for (int64_t i = lo; i < hi; ++i) {
      const float* xi = x + i * F;
      float lanes[kLanes] = {0};
      int64_t j = 0;
      for (; j + kLanes <= F; j += kLanes)
        for (int l = 0; l < kLanes; ++l) {
          const float d = xi[j + l] - point[j + l];
          lanes[l] += d * d;
        }
      double s = 0.0;
      for (int l = 0; l < kLanes; ++l) s += lanes[l];
      for (; j < F; ++j) s += double(xi[j] - point[j]) * (xi[j] - point[j]);
      top.add(float(s), i);
    }
    part[t] = top;
  });
  Top all;
  for (const Top& p : part) all.merge(p);
  return all;
}

// Squared distance of each token (column) of an (F, V) array to the point given per feature
// row (`point[j]`), reduced to a Top. Threads take whole feature rows into private sums.
Top tokens_to_point(const float* x, int64_t F, int64_t V, const float* point, int T,
                    std::vector<float>* row_sum) {
  std::vector<std::vector<float>> acc(T, std::vector<float>(V, 0.0f));
  parallel(T, [&](int t) {
    int64_t lo, hi;
    split(F, T, t, &lo, &hi);
    float* a = acc[t].data();
    for (int64_t j = lo; j < hi; ++j) {
      const float* xj = x + j * V;
      float p;
      if (row_sum != nullptr) {  // the centroid pass: this feature row's mean first
        float lanes[kLanes] = {0};
        int64_t i = 0;
        for (; i + kLanes <= V; i += kLanes)
          for (int l = 0; l < kLanes; ++l) lanes[l] += xj[i + l];
        double s = 0.0;
        for (int l = 0; l < kLanes; ++l) s += lanes[l];
        for (; i < V; ++i) s += xj[i];
        (*row_sum)[j] = float(s);
        p = float(s) / float(V);
      } else {
        p = point[j];
      }
      for (int64_t i = 0; i < V; ++i) {
        const float d = xj[i] - p;
        a[i] += d * d;
      }
    }
  });
  Top all;
  for (int64_t i = 0; i < V; ++i) {
    float s = 0.0f;
    for (int t = 0; t < T; ++t) s += acc[t][i];
    all.add(s, i);
  }
  return all;
}

std::vector<float> column_sum(const float* x, int64_t V, int64_t F, int T) {
  std::vector<std::vector<double>> part(T, std::vector<double>(F, 0.0));
  parallel(T, [&](int t) {
    int64_t lo, hi;
    split(V, T, t, &lo, &hi);
    std::vector<float> block(F);
    for (int64_t b = lo; b < hi; b += kBlockRows) {
      std::fill(block.begin(), block.end(), 0.0f);
      const int64_t e = std::min(hi, b + kBlockRows);
      for (int64_t i = b; i < e; ++i)
        for (int64_t j = 0; j < F; ++j) block[j] += x[i * F + j];
      for (int64_t j = 0; j < F; ++j) part[t][j] += block[j];
    }
  });
  std::vector<float> out(F);
  for (int64_t j = 0; j < F; ++j) {
    double s = 0.0;
    for (int t = 0; t < T; ++t) s += part[t][j];
    out[j] = float(s);
  }
  return out;
}

ffi::Error BracketImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> lower_out,
                       ffi::ResultBuffer<ffi::F32> upper_out,
                       ffi::ResultBuffer<ffi::F32> row_sum_out, bool tokens_are_rows,
                       int64_t sweeps, int64_t threads) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("rowgeom_bracket: expected 2-D");
  const int64_t rows = dims[0], cols = dims[1];
  const int64_t V = tokens_are_rows ? rows : cols, F = tokens_are_rows ? cols : rows;
  const float* data = x.typed_data();
  const int T = rowgeom::thread_count(threads, rows, rows * cols);
  std::vector<float> row_sum(F, 0.0f), point(F);
  Top top;
  if (tokens_are_rows) {
    row_sum = column_sum(data, V, F, T);
    for (int64_t j = 0; j < F; ++j) point[j] = row_sum[j] / float(V);
    top = rows_to_point(data, V, F, point.data(), T);
  } else {
    top = tokens_to_point(data, F, V, nullptr, T, &row_sum);
  }
  std::copy(row_sum.begin(), row_sum.end(), row_sum_out->typed_data());
  float lower = 0.0f, upper = 0.0f;
  if (V > 1) {
    const float r_c = std::sqrt(top.max);
    upper = 2.0f * r_c;
    if (sweeps == 0) {
      lower = std::max(r_c, std::sqrt(2.0f / float(V - 1)) * std::sqrt(float(top.sum)));
    } else {
      for (int64_t s = 0; s < sweeps; ++s) {
        const int64_t a = top.index;
        for (int64_t j = 0; j < F; ++j)
          point[j] = tokens_are_rows ? data[a * F + j] : data[j * V + a];
        top = tokens_are_rows ? rows_to_point(data, V, F, point.data(), T)
                              : tokens_to_point(data, F, V, point.data(), T, nullptr);
        const float d = std::sqrt(top.max);
        lower = (d > lower || std::isnan(d)) ? d : lower;  // jnp.maximum propagates NaN
      }
    }
    lower = (std::isnan(lower) || std::isnan(upper)) ? NAN : std::min(lower, upper);
  }
  *lower_out->typed_data() = lower;
  *upper_out->typed_data() = upper;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowgeomBracket, BracketImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("tokens_are_rows")
                                  .Attr<int64_t>("sweeps")
                                  .Attr<int64_t>("threads"));
