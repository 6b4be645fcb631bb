// Float32-register access to float32, float16 and bfloat16 arrays, shared by the CPU kernels
// (kernels_cpu.cpp, compensated.cpp): kStep elements load as two Vectorized<float> and store
// back with round-to-nearest-even, exactly as torch's `.to()` converts.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <tuple>

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

}  // namespace vec_io
}  // namespace ampx
