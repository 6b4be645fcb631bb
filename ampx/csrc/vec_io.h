// What the CPU kernels (kernels_cpu.cpp, compensated.cpp) share: float32-register access to
// float32, float16 and bfloat16 arrays (kStep elements load as two Vectorized<float> and store
// back with round-to-nearest-even, exactly as torch's `.to()` converts), and the split of a
// tensor list into work items of at most `chunk` elements of one tensor.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

namespace ampx {
namespace vec_io {

using Vf = at::vec::Vectorized<float>;
constexpr int64_t kVF = Vf::size();
// Elements per vector step: one Vectorized<Half/BFloat16>, i.e. two float vectors.
constexpr int64_t kStep = 2 * kVF;

static_assert(at::vec::Vectorized<at::Half>::size() == kStep,
              "ampx assumes Vectorized<Half> holds two float vectors");
static_assert(at::vec::Vectorized<at::BFloat16>::size() == kStep,
              "ampx assumes Vectorized<BFloat16> holds two float vectors");

template <typename T>
struct Io {
  static void load(const T* p, Vf& a, Vf& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
  static void store(T* p, const Vf& a, const Vf& b) {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
};
template <>
struct Io<float> {
  static void load(const float* p, Vf& a, Vf& b) {
    a = Vf::loadu(p);
    b = Vf::loadu(p + kVF);
  }
  static void store(float* p, const Vf& a, const Vf& b) {
    a.store(p);
    b.store(p + kVF);
  }
};

// One work item: elements [begin, end) of tensor `tensor` of a list.
struct Item {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// The items of `list`, at most `chunk` elements each; `*total` receives the element count.
inline std::vector<Item> make_items(const std::vector<at::Tensor>& list, int64_t chunk,
                                    int64_t* total) {
  std::vector<Item> items;
  int64_t sum = 0;
  for (size_t t = 0; t < list.size(); ++t) {
    const int64_t n = list[t].numel();
    sum += n;
    for (int64_t b = 0; b < n; b += chunk) {
      items.push_back({static_cast<int64_t>(t), b, std::min(n, b + chunk)});
    }
  }
  *total = sum;
  return items;
}

}  // namespace vec_io
}  // namespace ampx
