// ampx._C: Python bindings and argument checks for the multi-tensor kernels.
//
// Every public function checks its arguments here, once, with messages that name
// the API function and the offending list index (the same text ampx/_reference.py
// raises), then dispatches on the device of the first tensor to the CPU kernels
// (kernels_cpu.cpp) or the CUDA kernels (kernels_cuda.cu, when compiled).
//
// Exception types follow the Python side: TORCH_CHECK_TYPE raises TypeError (wrong
// dtype), TORCH_CHECK_VALUE raises ValueError (device, length, size, layout).
#include <torch/extension.h>

#include <string>

#include "ampx.h"

namespace ampx {
namespace {

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::ScalarType::Float:
      return "torch.float32";
    case at::ScalarType::Half:
      return "torch.float16";
    case at::ScalarType::BFloat16:
      return "torch.bfloat16";
    case at::ScalarType::Double:
      return "torch.float64";
    case at::ScalarType::Int:
      return "torch.int32";
    case at::ScalarType::Long:
      return "torch.int64";
    case at::ScalarType::Short:
      return "torch.int16";
    case at::ScalarType::Char:
      return "torch.int8";
    case at::ScalarType::Byte:
      return "torch.uint8";
    case at::ScalarType::Bool:
      return "torch.bool";
    case at::ScalarType::ComplexFloat:
      return "torch.complex64";
    case at::ScalarType::ComplexDouble:
      return "torch.complex128";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

bool is_kernel_dtype(at::ScalarType t) {
  return t == at::ScalarType::Float || t == at::ScalarType::Half ||
         t == at::ScalarType::BFloat16;
}

// Checks list[i]: dtype, then device against ref (ref_label names it), then layout.
void check_element(const char* api, const char* name, int64_t i, const at::Tensor& t,
                   const at::Device& ref, const std::string& ref_label) {
  TORCH_CHECK_TYPE(is_kernel_dtype(t.scalar_type()), "ampx.", api, ": ", name, "[", i,
                   "] has dtype ", dtype_name(t.scalar_type()),
                   "; expected torch.float32, torch.float16 or torch.bfloat16");
  TORCH_CHECK_VALUE(t.device() == ref, "ampx.", api, ": ", name, "[", i, "] is on ",
                    t.device().str(), " but ", ref_label, " is on ", ref.str(),
                    "; all tensors must be on one device");
  TORCH_CHECK_VALUE(t.is_contiguous(), "ampx.", api, ": ", name, "[", i,
                    "] is not contiguous; ampx kernels need contiguous tensors");
}

void check_list(const char* api, const char* name, const TensorList& list,
                const at::Device& ref, const std::string& ref_label) {
  for (size_t i = 0; i < list.size(); ++i) {
    check_element(api, name, static_cast<int64_t>(i), list[i], ref, ref_label);
  }
}

// Two lists of equal length, element-wise equal numel; checks src[i] then dst[i].
void check_pair(const char* api, const char* a, const TensorList& src, const char* b,
                const TensorList& dst) {
  const at::Device ref = src[0].device();
  const std::string ref_label = std::string(a) + "[0]";
  for (size_t k = 0; k < src.size(); ++k) {
    const auto i = static_cast<int64_t>(k);
    check_element(api, a, i, src[k], ref, ref_label);
    check_element(api, b, i, dst[k], ref, ref_label);
    TORCH_CHECK_VALUE(dst[k].numel() == src[k].numel(), "ampx.", api, ": ", b, "[", i,
                      "] has ", dst[k].numel(), " elements but ", a, "[", i, "] has ",
                      src[k].numel());
  }
}

void check_lengths(const char* api, const char* a, const TensorList& src, const char* b,
                   const TensorList& dst) {
  TORCH_CHECK_VALUE(src.size() == dst.size(), "ampx.", api, ": ", a, " has ", src.size(),
                    " tensors but ", b, " has ", dst.size(),
                    "; pass lists of equal length");
}

// A one-element bookkeeping tensor (inv_scale, found_inf, scale, trackers).
void check_scalar(const char* api, const char* name, const at::Tensor& t,
                  at::ScalarType dtype, const at::Device& ref, const std::string& ref_label) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "ampx.", api, ": ", name, " must be a ",
                   dtype_name(dtype), " tensor; got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.numel() == 1, "ampx.", api, ": ", name,
                    " must have 1 element; got ", t.numel());
  TORCH_CHECK_VALUE(t.device() == ref, "ampx.", api, ": ", name, " is on ",
                    t.device().str(), " but ", ref_label, " is on ", ref.str(),
                    "; all tensors must be on one device");
}

void check_flags(const char* api, const char* list_name, size_t n, const at::Tensor& inv_scale,
                 const at::Tensor& found_inf, const OptTensor& per_tensor,
                 const at::Device& ref, const std::string& ref_label) {
  check_scalar(api, "inv_scale", inv_scale, at::ScalarType::Float, ref, ref_label);
  check_scalar(api, "found_inf", found_inf, at::ScalarType::Float, ref, ref_label);
  if (per_tensor.has_value()) {
    const at::Tensor& p = *per_tensor;
    TORCH_CHECK_TYPE(p.scalar_type() == at::ScalarType::Float, "ampx.", api,
                     ": per_tensor must be a torch.float32 tensor; got ",
                     dtype_name(p.scalar_type()));
    TORCH_CHECK_VALUE(p.numel() == static_cast<int64_t>(n), "ampx.", api,
                      ": per_tensor must have ", n, " elements (one per tensor in ",
                      list_name, "); got ", p.numel());
    TORCH_CHECK_VALUE(p.device() == ref, "ampx.", api, ": per_tensor is on ",
                      p.device().str(), " but ", ref_label, " is on ", ref.str(),
                      "; all tensors must be on one device");
    TORCH_CHECK_VALUE(p.is_contiguous(), "ampx.", api,
                      ": per_tensor is not contiguous; ampx kernels need contiguous tensors");
  }
}

[[noreturn]] void no_kernels(const char* api, const at::Device& d) {
#ifdef AMPX_WITH_CUDA
  const char* hint = "ampx._C has kernels for cpu and cuda; ampx._ext uses the reference "
                     "implementation for other devices";
#else
  const char* hint = "this ampx._C build has CPU kernels only; ampx._ext uses the reference "
                     "implementation for other devices";
#endif
  TORCH_CHECK_VALUE(false, "ampx.", api, ": no native kernels for device ", d.str(), "; ",
                    hint);
  // TORCH_CHECK_VALUE(false, ...) always throws; this keeps [[noreturn]] honest.
  throw std::logic_error("unreachable");
}

// ---------------------------------------------------------------------------
// Public functions
// ---------------------------------------------------------------------------

void unscale_(const TensorList& grads, const at::Tensor& inv_scale,
              const at::Tensor& found_inf, const OptTensor& per_tensor) {
  constexpr const char* api = "unscale_";
  if (grads.empty()) {
    return;
  }
  const at::Device ref = grads[0].device();
  check_list(api, "grads", grads, ref, "grads[0]");
  check_flags(api, "grads", grads.size(), inv_scale, found_inf, per_tensor, ref, "grads[0]");
  if (ref.is_cpu()) {
    unscale_cpu(grads, inv_scale, found_inf, per_tensor);
    return;
  }
#ifdef AMPX_WITH_CUDA
  if (ref.is_cuda()) {
    unscale_cuda(grads, inv_scale, found_inf, per_tensor);
    return;
  }
#endif
  no_kernels(api, ref);
}

void unscale_into_(const TensorList& src, const TensorList& dst, const at::Tensor& inv_scale,
                   const at::Tensor& found_inf, const OptTensor& per_tensor,
                   bool accumulate) {
  constexpr const char* api = "unscale_into_";
  check_lengths(api, "src", src, "dst", dst);
  if (src.empty()) {
    return;
  }
  check_pair(api, "src", src, "dst", dst);
  const at::Device ref = src[0].device();
  check_flags(api, "src", src.size(), inv_scale, found_inf, per_tensor, ref, "src[0]");
  if (ref.is_cpu()) {
    unscale_into_cpu(src, dst, inv_scale, found_inf, per_tensor, accumulate);
    return;
  }
#ifdef AMPX_WITH_CUDA
  if (ref.is_cuda()) {
    unscale_into_cuda(src, dst, inv_scale, found_inf, per_tensor, accumulate);
    return;
  }
#endif
  no_kernels(api, ref);
}

std::tuple<at::Tensor, at::Tensor> l2norm(const TensorList& tensors, bool per_tensor) {
  constexpr const char* api = "l2norm";
  if (tensors.empty()) {
    auto opts = at::TensorOptions().dtype(at::kFloat);
    return {at::zeros({}, opts), at::zeros({0}, opts)};
  }
  const at::Device ref = tensors[0].device();
  check_list(api, "tensors", tensors, ref, "tensors[0]");
  if (ref.is_cpu()) {
    return l2norm_cpu(tensors, per_tensor);
  }
#ifdef AMPX_WITH_CUDA
  if (ref.is_cuda()) {
    return l2norm_cuda(tensors, per_tensor);
  }
#endif
  no_kernels(api, ref);
}

void copy_(const TensorList& src, const TensorList& dst) {
  constexpr const char* api = "copy_";
  check_lengths(api, "src", src, "dst", dst);
  if (src.empty()) {
    return;
  }
  check_pair(api, "src", src, "dst", dst);
  const at::Device ref = src[0].device();
  if (ref.is_cpu()) {
    copy_cpu(src, dst);
    return;
  }
#ifdef AMPX_WITH_CUDA
  if (ref.is_cuda()) {
    copy_cuda(src, dst);
    return;
  }
#endif
  no_kernels(api, ref);
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                   const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                   double growth, double backoff, int64_t interval, int64_t hysteresis,
                   double min_scale, double max_scale) {
  constexpr const char* api = "update_scale_";
  const at::Device ref = scale.device();
  check_scalar(api, "scale", scale, at::ScalarType::Float, ref, "scale");
  check_scalar(api, "growth_tracker", growth_tracker, at::ScalarType::Int, ref, "scale");
  check_scalar(api, "hysteresis_tracker", hysteresis_tracker, at::ScalarType::Int, ref,
               "scale");
  check_scalar(api, "found_inf", found_inf, at::ScalarType::Float, ref, "scale");
  const ScaleParams p{static_cast<float>(growth),     static_cast<float>(backoff),
                      interval,                       static_cast<int32_t>(hysteresis),
                      static_cast<float>(min_scale),  static_cast<float>(max_scale)};
  if (ref.is_cpu()) {
    update_scale_cpu(scale, growth_tracker, hysteresis_tracker, found_inf, p);
    return;
  }
#ifdef AMPX_WITH_CUDA
  if (ref.is_cuda()) {
    update_scale_cuda(scale, growth_tracker, hysteresis_tracker, found_inf, p);
    return;
  }
#endif
  no_kernels(api, ref);
}

bool has_cuda() {
#ifdef AMPX_WITH_CUDA
  return true;
#else
  return false;
#endif
}

#define AMPX_STRINGIFY_(x) #x
#define AMPX_STRINGIFY(x) AMPX_STRINGIFY_(x)

// The CUDA architectures compiled in, as ampx/_build.py's arch_token ("80_90p": sm_80,
// sm_90 and PTX for 9.0); "" without CUDA kernels.
std::string cuda_archs() {
#if defined(AMPX_WITH_CUDA) && defined(AMPX_CUDA_ARCHS)
  return AMPX_STRINGIFY(AMPX_CUDA_ARCHS);
#else
  return "";
#endif
}

}  // namespace

void init_cast_wrapper(PyObject* module);  // cast_wrapper.cpp
void init_grad_pass(pybind11::module& m);  // grad_pass.cpp
void init_compensated(pybind11::module& m);  // compensated.cpp

}  // namespace ampx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using py::arg;
  m.doc() = "ampx native multi-tensor kernels (see ampx/_reference.py for the contract)";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("unscale_", &ampx::unscale_, arg("grads"), arg("inv_scale"), arg("found_inf"),
        arg("per_tensor") = py::none(), nogil);
  m.def("unscale_into_", &ampx::unscale_into_, arg("src"), arg("dst"), arg("inv_scale"),
        arg("found_inf"), arg("per_tensor") = py::none(), arg("accumulate") = false, nogil);
  ampx::init_grad_pass(m);
  ampx::init_compensated(m);  // Kahan half-weight SGD/Adam steps
  m.def("l2norm", &ampx::l2norm, arg("tensors"), arg("per_tensor") = false, nogil);
  m.def("copy_", &ampx::copy_, arg("src"), arg("dst"), nogil);
  m.def("update_scale_", &ampx::update_scale_, arg("scale"), arg("growth_tracker"),
        arg("hysteresis_tracker"), arg("found_inf"), arg("growth"), arg("backoff"),
        arg("interval"), arg("hysteresis"), arg("min_scale"), arg("max_scale"), nogil);
  m.def("has_cuda", &ampx::has_cuda, "Whether the CUDA kernels were compiled in.");
  m.def("cpu_capability", &ampx::cpu_capability,
        "The CPU instruction set the CPU kernels were compiled for.");
  m.def("cuda_archs", &ampx::cuda_archs,
        "The CUDA architectures compiled in (\"80_90p\": sm_80, sm_90, PTX 9.0); \"\" "
        "without CUDA.");
  m.def("cuda_limits", []() {
    py::dict out;
#ifdef AMPX_WITH_CUDA
    const ampx::CudaLimits l = ampx::cuda_limits();
    out["chunk"] = l.chunk;
    out["max_tensors"] = l.max_tensors;
    out["max_blocks"] = l.max_blocks;
    out["threads"] = l.threads;
    out["pack_bytes"] = l.pack_bytes;
#endif
    return out;
  }, "How the CUDA kernels split work (empty without CUDA).");
  m.def("cuda_probe", [](int64_t device) {
#ifdef AMPX_WITH_CUDA
    return ampx::cuda_probe(static_cast<int>(device));
#else
    (void)device;
    return std::string("this build has no CUDA kernels");
#endif
  }, arg("device"), "\"\" when the device can run the CUDA kernels, else why not.");
  ampx::init_cast_wrapper(m.ptr());  // O1's native cast wrapper
}
