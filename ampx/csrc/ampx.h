// ampx native kernels: declarations shared by the bindings (ampx.cpp), the CPU
// kernels (kernels_cpu.cpp) and the CUDA kernels (kernels_cuda.cu).
//
// The contract is documented in docs/internals.md and docs/native-kernels.md and
// is specified, executable, by ampx/_reference.py. Argument checking happens once,
// in ampx.cpp, before any of these functions is called: the kernels may assume
// non-empty lists of contiguous float32/float16/bfloat16 tensors on one device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace ampx {

// Element type of a tensor in a kernel list. Kept as a small integer so the
// CUDA kernels can carry it in their launch metadata.
enum class Kind : uint8_t { F32 = 0, F16 = 1, BF16 = 2 };

// Maps a (checked) scalar type to its Kind.
inline Kind kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::ScalarType::Half:
      return Kind::F16;
    case at::ScalarType::BFloat16:
      return Kind::BF16;
    default:
      return Kind::F32;
  }
}

using TensorList = std::vector<at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

// A kernel that writes destinations through raw pointers moves each one's version counter
// once, as a torch in-place op does: autograd's "modified by an inplace operation" check on a
// saved tensor and O1's weight-cast cache both read it. `check_writable` runs before any
// write: an inference tensor outside InferenceMode is refused with torch's own error (its
// counter's `bump` raises it), as the reference's in-place foreach op refuses it.
inline void check_writable(const std::vector<at::Tensor>& dst) {
  if (c10::InferenceMode::is_enabled()) return;
  for (const auto& d : dst) {
    if (d.is_inference()) d.unsafeGetTensorImpl()->bump_version();  // throws
  }
}
inline void bump_versions(const std::vector<at::Tensor>& dst) {
  for (const auto& d : dst) d.unsafeGetTensorImpl()->bump_version();
}

// Parameters of update_scale_, already converted the way the contract says:
// factors and bounds are rounded to float32 before any arithmetic.
struct ScaleParams {
  float growth;
  float backoff;
  int64_t interval;
  int32_t hysteresis;
  float min_scale;
  float max_scale;
};

// ---- CPU (kernels_cpu.cpp) ----
void unscale_cpu(const TensorList& grads, const at::Tensor& inv_scale,
                 const at::Tensor& found_inf, const OptTensor& per_tensor);
void unscale_into_cpu(const TensorList& src, const TensorList& dst,
                      const at::Tensor& inv_scale, const at::Tensor& found_inf,
                      const OptTensor& per_tensor, bool accumulate);
std::tuple<at::Tensor, at::Tensor> l2norm_cpu(const TensorList& tensors, bool per_tensor);
void copy_cpu(const TensorList& src, const TensorList& dst);
void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                      const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                      const ScaleParams& p);
// The CPU instruction set the CPU kernels were compiled for ("AVX512", "AVX2" or
// "DEFAULT"); ampx/_ext.py refuses to load a build the running CPU cannot execute.
const char* cpu_capability();

#ifdef AMPX_WITH_CUDA
// ---- CUDA (kernels_cuda.cu) ----
void unscale_cuda(const TensorList& grads, const at::Tensor& inv_scale,
                  const at::Tensor& found_inf, const OptTensor& per_tensor);
void unscale_into_cuda(const TensorList& src, const TensorList& dst,
                       const at::Tensor& inv_scale, const at::Tensor& found_inf,
                       const OptTensor& per_tensor, bool accumulate);
std::tuple<at::Tensor, at::Tensor> l2norm_cuda(const TensorList& tensors, bool per_tensor);
void copy_cuda(const TensorList& src, const TensorList& dst);
void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                       const ScaleParams& p);
// How the CUDA kernels cut their work: elements per block, tensors and blocks per
// launch, threads per block, bytes per vector access. The selftest sizes its cases
// from these, so it exercises chunk edges and multi-launch batching whatever they are.
struct CudaLimits {
  int64_t chunk;
  int max_tensors;
  int max_blocks;
  int threads;
  int pack_bytes;
};
CudaLimits cuda_limits();
// "" when `device` can run the kernels, else the CUDA runtime's reason.
std::string cuda_probe(int device);
#endif

}  // namespace ampx
