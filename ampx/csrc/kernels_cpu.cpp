// ampx CPU kernels: one pass over memory, vectorised with at::vec::Vectorized and
// spread over threads with at::parallel_for.
//
// Work decomposition: every list is cut into items of at most kChunk elements
// (an item never spans two tensors); at::parallel_for hands contiguous runs of
// items to threads, so a list of many small tensors and a list of one huge tensor
// both keep every core busy. Per-item results (non-finite flags, partial sums) are
// written to per-item slots and combined serially afterwards, so there are no data
// races and results do not depend on the number of threads.
//
// Numerics (the contract of ampx/_reference.py):
//   * every element is converted to float32, multiplied by the float32 inv_scale
//     (and added to float32(dst) for accumulate), each operation rounded to float32
//     separately (the build passes -ffp-contract=off: no fused multiply-add), then
//     rounded to the output dtype with round-to-nearest-even;
//   * unscale_ with inv_scale == 1 leaves the values untouched (as torch does);
//   * l2norm squares and sums in float64 and rounds sqrt(sum) to float32 once, per
//     tensor and for the total (the sum over all tensors' float64 sums of squares);
//     the reference computes torch._foreach_norm(..., dtype=torch.float64).
//
// The instruction set is fixed at compile time by ampx/_build.py (CPU_CAPABILITY_*
// macros and -m flags); cpu_capability() reports it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "ampx.h"
#include "vec_io.h"

namespace ampx {
namespace {

using vec_io::Io;
using vec_io::kStep;
using vec_io::kVF;
using vec_io::Vf;
// Elements per work item. A multiple of every step size; 32K elements keep an
// item's data (<= 128 KiB) in L2 while amortising the per-item overhead.
constexpr int64_t kChunk = int64_t{1} << 15;
// Below this many elements in total, run on the calling thread.
constexpr int64_t kSerialBelow = int64_t{1} << 16;

static_assert(kChunk % kStep == 0, "kChunk must be a multiple of the vector step");

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}
template <typename T>
inline T from_float(float v) {
  return static_cast<T>(v);  // c10::Half / c10::BFloat16: round to nearest even
}

// ---- work items ----
using vec_io::Item;

std::vector<Item> make_items(const TensorList& list, int64_t* total) {
  return vec_io::make_items(list, kChunk, total);
}

template <typename F>
void run_items(const std::vector<Item>& items, int64_t total, const F& f) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) {
    return;
  }
  // parallel_for runs serially when the range is below the grain size.
  const int64_t grain = total < kSerialBelow ? n + 1 : 1;
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      f(k, items[k]);
    }
  });
}

// Records per-item non-finite flags into found_inf and per_tensor (never clears).
void publish_flags(const std::vector<Item>& items, const std::vector<uint8_t>& bad,
                   const at::Tensor& found_inf, const OptTensor& per_tensor) {
  float* found = found_inf.data_ptr<float>();
  float* flags = per_tensor.has_value() ? per_tensor->data_ptr<float>() : nullptr;
  for (size_t k = 0; k < items.size(); ++k) {
    if (bad[k]) {
      found[0] = 1.f;
      if (flags != nullptr) {
        flags[items[k].tensor] = 1.f;
      }
    }
  }
}

// ---- unscale_ ----
// NaN-sentinel trick: (x - x) is 0 for finite x and NaN for inf/NaN, so a running
// sum of (x - x) is NaN exactly when some element was non-finite. Branch-free.
template <typename T, bool kScale>
bool unscale_span(T* p, int64_t n, float inv) {
  const Vf vinv(inv);
  Vf acc(0.f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vf a, b;
    Io<T>::load(p + i, a, b);
    acc = acc + (a - a) + (b - b);
    if constexpr (kScale) {
      Io<T>::store(p + i, a * vinv, b * vinv);
    }
  }
  float tail = 0.f;
  for (; i < n; ++i) {
    const float v = to_float(p[i]);
    tail += v - v;
    if constexpr (kScale) {
      p[i] = from_float<T>(v * inv);
    }
  }
  return acc.has_inf_nan() || std::isnan(tail);
}

// The check alone (inv_scale == 1) of a 16-bit float type, on the bits: a value is
// inf/NaN exactly when its exponent bits are all ones (`kExp`), the same verdict as the
// float sentinel above, without converting (twice the elements per vector).
template <int16_t kExp>
bool nonfinite_bits(const void* data, int64_t n) {
  using Vi = at::vec::Vectorized<int16_t>;
  const auto* p = static_cast<const int16_t*>(data);
  const Vi mask(kExp);
  Vi acc(0);
  int64_t i = 0;
  for (; i + Vi::size() <= n; i += Vi::size()) {
    const Vi v = Vi::loadu(p + i);
    acc = acc | ((v & mask) == mask);
  }
  int16_t lanes[Vi::size()];
  acc.store(lanes);
  bool bad = false;
  for (int64_t k = 0; k < Vi::size(); ++k) bad |= lanes[k] != 0;
  for (; i < n; ++i) bad |= (p[i] & kExp) == kExp;
  return bad;
}

template <bool kScale>
bool unscale_item(const at::Tensor& t, const Item& it, float inv) {
  const int64_t n = it.end - it.begin;
  switch (kind_of(t)) {
    case Kind::F16:
      if constexpr (!kScale) {
        return nonfinite_bits<0x7C00>(t.data_ptr<at::Half>() + it.begin, n);
      }
      return unscale_span<at::Half, kScale>(t.data_ptr<at::Half>() + it.begin, n, inv);
    case Kind::BF16:
      if constexpr (!kScale) {
        return nonfinite_bits<0x7F80>(t.data_ptr<at::BFloat16>() + it.begin, n);
      }
      return unscale_span<at::BFloat16, kScale>(t.data_ptr<at::BFloat16>() + it.begin, n,
                                                inv);
    default:
      return unscale_span<float, kScale>(t.data_ptr<float>() + it.begin, n, inv);
  }
}

// ---- unscale_into_ ----
template <typename S, typename D, bool kAcc>
bool unscale_into_span(const S* s, D* d, int64_t n, float inv) {
  const Vf vinv(inv);
  Vf acc(0.f);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vf a, b;
    Io<S>::load(s + i, a, b);
    acc = acc + (a - a) + (b - b);
    a = a * vinv;
    b = b * vinv;
    if constexpr (kAcc) {
      Vf c, e;
      Io<D>::load(d + i, c, e);
      a = c + a;
      b = e + b;
    }
    Io<D>::store(d + i, a, b);
  }
  float tail = 0.f;
  for (; i < n; ++i) {
    const float v = to_float(s[i]);
    tail += v - v;
    float r = v * inv;
    if constexpr (kAcc) {
      r = to_float(d[i]) + r;
    }
    d[i] = from_float<D>(r);
  }
  return acc.has_inf_nan() || std::isnan(tail);
}

template <typename S, bool kAcc>
bool unscale_into_item_s(const S* s, char* d, Kind dk, int64_t n, float inv) {
  switch (dk) {
    case Kind::F16:
      return unscale_into_span<S, at::Half, kAcc>(s, reinterpret_cast<at::Half*>(d), n, inv);
    case Kind::BF16:
      return unscale_into_span<S, at::BFloat16, kAcc>(s, reinterpret_cast<at::BFloat16*>(d),
                                                      n, inv);
    default:
      return unscale_into_span<S, float, kAcc>(s, reinterpret_cast<float*>(d), n, inv);
  }
}

inline char* byte_ptr(const at::Tensor& t, int64_t offset) {
  return static_cast<char*>(t.data_ptr()) + offset * t.element_size();
}

template <bool kAcc>
bool unscale_into_item(const at::Tensor& src, const at::Tensor& dst, const Item& it,
                       float inv) {
  const int64_t n = it.end - it.begin;
  char* d = byte_ptr(dst, it.begin);
  const Kind dk = kind_of(dst);
  switch (kind_of(src)) {
    case Kind::F16:
      return unscale_into_item_s<at::Half, kAcc>(src.data_ptr<at::Half>() + it.begin, d, dk,
                                                 n, inv);
    case Kind::BF16:
      return unscale_into_item_s<at::BFloat16, kAcc>(src.data_ptr<at::BFloat16>() + it.begin,
                                                     d, dk, n, inv);
    default:
      return unscale_into_item_s<float, kAcc>(src.data_ptr<float>() + it.begin, d, dk, n,
                                              inv);
  }
}

// ---- copy_ ----
template <typename S, typename D>
void copy_span(const S* s, D* d, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::memcpy(d, s, static_cast<size_t>(n) * sizeof(S));
  } else {
    int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      Vf a, b;
      Io<S>::load(s + i, a, b);
      Io<D>::store(d + i, a, b);
    }
    for (; i < n; ++i) {
      d[i] = from_float<D>(to_float(s[i]));
    }
  }
}

template <typename S>
void copy_item_s(const S* s, char* d, Kind dk, int64_t n) {
  switch (dk) {
    case Kind::F16:
      copy_span<S, at::Half>(s, reinterpret_cast<at::Half*>(d), n);
      break;
    case Kind::BF16:
      copy_span<S, at::BFloat16>(s, reinterpret_cast<at::BFloat16*>(d), n);
      break;
    default:
      copy_span<S, float>(s, reinterpret_cast<float*>(d), n);
      break;
  }
}

// ---- l2norm ----
// Squares and sums in float64 so the result is accurate to float32 rounding whatever
// the length and never overflows before the final rounding to float32. SqAcc widens
// two float vectors to float64 in registers (AVX512/AVX2) and keeps four independent
// accumulators; the portable fallback goes through a small buffer.
#if defined(CPU_CAPABILITY_AVX512)
struct SqAcc {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  __m512d a2 = _mm512_setzero_pd(), a3 = _mm512_setzero_pd();
  static __m512d lo(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
  static __m512d hi(__m512 v) {
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  void add(const Vf& x, const Vf& y) {
    const __m512 xv = x;
    const __m512 yv = y;
    const __m512d x0 = lo(xv), x1 = hi(xv), y0 = lo(yv), y1 = hi(yv);
    a0 = _mm512_add_pd(a0, _mm512_mul_pd(x0, x0));
    a1 = _mm512_add_pd(a1, _mm512_mul_pd(x1, x1));
    a2 = _mm512_add_pd(a2, _mm512_mul_pd(y0, y0));
    a3 = _mm512_add_pd(a3, _mm512_mul_pd(y1, y1));
  }
  double sum() const {
    alignas(64) double buf[8];
    _mm512_store_pd(buf, _mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
    double total = 0.0;
    for (double v : buf) {
      total += v;
    }
    return total;
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
struct SqAcc {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  __m256d a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
  static __m256d lo(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
  static __m256d hi(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }
  void add(const Vf& x, const Vf& y) {
    const __m256 xv = x;
    const __m256 yv = y;
    const __m256d x0 = lo(xv), x1 = hi(xv), y0 = lo(yv), y1 = hi(yv);
    a0 = _mm256_add_pd(a0, _mm256_mul_pd(x0, x0));
    a1 = _mm256_add_pd(a1, _mm256_mul_pd(x1, x1));
    a2 = _mm256_add_pd(a2, _mm256_mul_pd(y0, y0));
    a3 = _mm256_add_pd(a3, _mm256_mul_pd(y1, y1));
  }
  double sum() const {
    alignas(32) double buf[4];
    _mm256_store_pd(buf, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    return (buf[0] + buf[1]) + (buf[2] + buf[3]);
  }
};
#else
struct SqAcc {
  double acc[kStep] = {};
  void add(const Vf& x, const Vf& y) {
    float buf[kStep];
    x.store(buf);
    y.store(buf + kVF);
    for (int64_t k = 0; k < kStep; ++k) {
      const double v = static_cast<double>(buf[k]);
      acc[k] += v * v;
    }
  }
  double sum() const {
    double total = 0.0;
    for (double v : acc) {
      total += v;
    }
    return total;
  }
};
#endif

template <typename T>
double sumsq_span(const T* p, int64_t n) {
  SqAcc acc;
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vf a, b;
    Io<T>::load(p + i, a, b);
    acc.add(a, b);
  }
  double total = acc.sum();
  for (; i < n; ++i) {
    const double v = static_cast<double>(to_float(p[i]));
    total += v * v;
  }
  return total;
}

double sumsq_item(const at::Tensor& t, const Item& it) {
  const int64_t n = it.end - it.begin;
  switch (kind_of(t)) {
    case Kind::F16:
      return sumsq_span(t.data_ptr<at::Half>() + it.begin, n);
    case Kind::BF16:
      return sumsq_span(t.data_ptr<at::BFloat16>() + it.begin, n);
    default:
      return sumsq_span(t.data_ptr<float>() + it.begin, n);
  }
}

}  // namespace

const char* cpu_capability() {
#if defined(CPU_CAPABILITY_AVX512)
  return "AVX512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "AVX2";
#else
  return "DEFAULT";
#endif
}

void unscale_cpu(const TensorList& grads, const at::Tensor& inv_scale,
                 const at::Tensor& found_inf, const OptTensor& per_tensor) {
  int64_t total = 0;
  const auto items = make_items(grads, &total);
  std::vector<uint8_t> bad(items.size(), 0);
  const float inv = inv_scale.data_ptr<float>()[0];
  if (inv == 1.f) {
    run_items(items, total, [&](int64_t k, const Item& it) {
      bad[k] = unscale_item<false>(grads[it.tensor], it, inv);
    });
  } else {
    run_items(items, total, [&](int64_t k, const Item& it) {
      bad[k] = unscale_item<true>(grads[it.tensor], it, inv);
    });
  }
  publish_flags(items, bad, found_inf, per_tensor);
}

void unscale_into_cpu(const TensorList& src, const TensorList& dst,
                      const at::Tensor& inv_scale, const at::Tensor& found_inf,
                      const OptTensor& per_tensor, bool accumulate) {
  int64_t total = 0;
  const auto items = make_items(src, &total);
  std::vector<uint8_t> bad(items.size(), 0);
  const float inv = inv_scale.data_ptr<float>()[0];
  if (accumulate) {
    run_items(items, total, [&](int64_t k, const Item& it) {
      bad[k] = unscale_into_item<true>(src[it.tensor], dst[it.tensor], it, inv);
    });
  } else {
    run_items(items, total, [&](int64_t k, const Item& it) {
      bad[k] = unscale_into_item<false>(src[it.tensor], dst[it.tensor], it, inv);
    });
  }
  publish_flags(items, bad, found_inf, per_tensor);
}

void copy_cpu(const TensorList& src, const TensorList& dst) {
  int64_t total = 0;
  const auto items = make_items(src, &total);
  run_items(items, total, [&](int64_t, const Item& it) {
    const at::Tensor& s = src[it.tensor];
    const at::Tensor& d = dst[it.tensor];
    const int64_t n = it.end - it.begin;
    char* dp = byte_ptr(d, it.begin);
    const Kind dk = kind_of(d);
    switch (kind_of(s)) {
      case Kind::F16:
        copy_item_s(s.data_ptr<at::Half>() + it.begin, dp, dk, n);
        break;
      case Kind::BF16:
        copy_item_s(s.data_ptr<at::BFloat16>() + it.begin, dp, dk, n);
        break;
      default:
        copy_item_s(s.data_ptr<float>() + it.begin, dp, dk, n);
        break;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> l2norm_cpu(const TensorList& tensors, bool per_tensor) {
  int64_t total = 0;
  const auto items = make_items(tensors, &total);
  std::vector<double> partial(items.size(), 0.0);
  run_items(items, total, [&](int64_t k, const Item& it) {
    partial[k] = sumsq_item(tensors[it.tensor], it);
  });
  // Combine in item order: deterministic, independent of the thread count.
  std::vector<double> sums(tensors.size(), 0.0);
  for (size_t k = 0; k < items.size(); ++k) {
    sums[items[k].tensor] += partial[k];
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor norms = at::empty({per_tensor ? static_cast<int64_t>(tensors.size()) : 0}, opts);
  float* out = norms.data_ptr<float>();
  double all = 0.0;
  for (size_t t = 0; t < sums.size(); ++t) {
    all += sums[t];
    if (per_tensor) {
      out[t] = static_cast<float>(std::sqrt(sums[t]));
    }
  }
  at::Tensor result = at::empty({}, opts);
  result.data_ptr<float>()[0] = static_cast<float>(std::sqrt(all));
  return {result, norms};
}

void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                      const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                      const ScaleParams& p) {
  float* s = scale.data_ptr<float>();
  int32_t* gt = growth_tracker.data_ptr<int32_t>();
  int32_t* ht = hysteresis_tracker.data_ptr<int32_t>();
  const float found = found_inf.data_ptr<float>()[0];
  if (found > 0.f) {
    *gt = 0;
    if (*ht <= 1) {
      *s = std::min(std::max(*s * p.backoff, p.min_scale), p.max_scale);
    } else {
      *ht -= 1;
    }
  } else {
    const int64_t next = static_cast<int64_t>(*gt) + 1;
    if (next >= p.interval) {
      const float grown = *s * p.growth;
      if (std::isfinite(grown)) {
        *s = std::min(grown, p.max_scale);
      }
      *gt = 0;
      *ht = p.hysteresis;
    } else {
      *gt = static_cast<int32_t>(next);
    }
  }
}

}  // namespace ampx
