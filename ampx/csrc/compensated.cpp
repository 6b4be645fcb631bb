// ampx._C.compensated_sgd_ / compensated_adam_: one SGD or Adam/AdamW step on compensated
// half weights (w, c), in place, bit for bit ampx/_reference_compensated.py.
//
// Per element: read w, c, the gradient and the state (each float32 or the weight's half
// dtype), do the optimizer's math in float32 registers, write back w = half(x),
// c = half(x - float(w)) and the state rounded to its dtype. No float32 weight is ever
// stored and nothing is allocated per parameter. The math is written once (sgd_math,
// adam_math) for a float and for at::vec::Vectorized<float>: both only use IEEE
// add/sub/mul/div/sqrt/negate (the build passes -ffp-contract=off: no FMA), and the
// half conversions are round-to-nearest-even like torch's .to(). Work is cut into items
// of at most kChunk elements of one tensor, spread over threads by at::parallel_for.
//
// The arguments are checked here, with the GIL held, with the reference's exception types
// and messages; the kernels then run without the GIL.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/DynamicTypes.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "compensated.h"
#include "vec_io.h"

namespace ampx {
namespace {

namespace py = pybind11;
using vec_io::Io;
using vec_io::kStep;
using vec_io::kVF;
using vec_io::Vf;
constexpr int64_t kChunk = int64_t{1} << 14;  // elements per work item (5 streams in L2)
constexpr int64_t kSerialBelow = int64_t{1} << 15;  // fewer elements: the calling thread

static_assert(at::vec::Vectorized<at::Half>::size() == kStep, "two float vectors per half");
static_assert(kChunk % kStep == 0, "items start on a vector step");

inline float vneg(float a) { return -a; }
inline Vf vneg(const Vf& a) { return a.neg(); }
inline float vsqrt(float a) { return std::sqrt(a); }
inline Vf vsqrt(const Vf& a) { return a.sqrt(); }

// ---- the math (the reference's operations, in its order) ----
template <typename V>
inline void sgd_math(const SgdScalars& p, V& x, V g, const V& buf, V& b_out) {
  if (p.maximize) g = vneg(g);
  if (p.decay) g = g + x * V(p.wd);
  if (p.momentum) {
    const V b = p.first ? g : buf * V(p.mu) + g * V(p.keep);
    b_out = b;
    g = p.nesterov ? g + b * V(p.mu) : b;
  }
  x = x - g * V(p.lr);
}

template <typename V>
inline void adam_math(const AdamScalars& p, V& x, V g, V& m, V& v) {
  if (p.maximize) g = vneg(g);
  if (p.decoupled) {
    x = x * V(p.decay);
  } else if (p.coupled_decay) {
    g = g + x * V(p.wd);
  }
  m = m * V(p.b1) + g * V(p.one_b1);
  v = v * V(p.b2) + (g * g) * V(p.one_b2);
  x = x - (m / (vsqrt(v) / V(p.root2) + V(p.eps))) * V(p.size);
}

// w = half(x); c = half(x - float(w)).
template <typename W>
inline void write_back(W* w, W* c, const Vf& xa, const Vf& xb) {
  const auto high = at::vec::convert_from_float<W>(xa, xb);
  high.store(w);
  Vf ha, hb;
  std::tie(ha, hb) = at::vec::convert_to_float<W>(high);
  Io<W>::store(c, xa - ha, xb - hb);
}
template <typename W>
inline void write_back(W* w, W* c, float x) {
  const W high = static_cast<W>(x);  // round to nearest even
  *w = high;
  *c = static_cast<W>(x - static_cast<float>(high));
}

template <typename W, typename G, typename B>
void sgd_span(W* w, W* c, const G* g, B* buf, int64_t n, const SgdScalars& p) {
  const bool read = p.momentum && !p.first;
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vf wa, wb, ca, cb, ga, gb, ba(0.f), bb(0.f);
    Io<W>::load(w + i, wa, wb);
    Io<W>::load(c + i, ca, cb);
    Io<G>::load(g + i, ga, gb);
    if (read) Io<B>::load(buf + i, ba, bb);
    Vf xa = wa + ca, xb = wb + cb, oa, ob;
    sgd_math(p, xa, ga, ba, oa);
    sgd_math(p, xb, gb, bb, ob);
    if (p.momentum) Io<B>::store(buf + i, oa, ob);
    write_back(w + i, c + i, xa, xb);
  }
  for (; i < n; ++i) {
    float x = static_cast<float>(w[i]) + static_cast<float>(c[i]);
    float out = 0.f;
    sgd_math(p, x, static_cast<float>(g[i]), read ? static_cast<float>(buf[i]) : 0.f, out);
    if (p.momentum) buf[i] = static_cast<B>(out);
    write_back(w + i, c + i, x);
  }
}

template <typename W, typename G, typename S>
void adam_span(W* w, W* c, const G* g, S* ms, S* vs, int64_t n, const AdamScalars& p) {
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    Vf wa, wb, ca, cb, ga, gb, ma, mb, va, vb;
    Io<W>::load(w + i, wa, wb);
    Io<W>::load(c + i, ca, cb);
    Io<G>::load(g + i, ga, gb);
    Io<S>::load(ms + i, ma, mb);
    Io<S>::load(vs + i, va, vb);
    Vf xa = wa + ca, xb = wb + cb;
    adam_math(p, xa, ga, ma, va);
    adam_math(p, xb, gb, mb, vb);
    Io<S>::store(ms + i, ma, mb);
    Io<S>::store(vs + i, va, vb);
    write_back(w + i, c + i, xa, xb);
  }
  for (; i < n; ++i) {
    float x = static_cast<float>(w[i]) + static_cast<float>(c[i]);
    float m = static_cast<float>(ms[i]), v = static_cast<float>(vs[i]);
    adam_math(p, x, static_cast<float>(g[i]), m, v);
    ms[i] = static_cast<S>(m);
    vs[i] = static_cast<S>(v);
    write_back(w + i, c + i, x);
  }
}

// ---- dispatch: W in {Half, BFloat16}; G and the state in {float, W} ----
template <typename F>
void with_half(const at::Tensor& t, const F& f) {
  if (t.scalar_type() == at::ScalarType::Half) {
    f(at::Half{});
  } else {
    f(at::BFloat16{});
  }
}
template <typename W, typename F>
void with_float_or(const at::Tensor* t, const F& f) {
  if (t != nullptr && t->scalar_type() == at::ScalarType::Float) {
    f(float{});
  } else {
    f(W{});
  }
}

template <typename T>
T* at_offset(const at::Tensor& t, int64_t offset) {
  return static_cast<T*>(t.data_ptr()) + offset;
}

// Calls f(tensor index, begin, end) for every item, on threads when the work is large.
template <typename F>
void for_items(const TensorList& params, const F& f) {
  int64_t total = 0;
  const auto items = vec_io::make_items(params, kChunk, &total);
  const auto count = static_cast<int64_t>(items.size());
  if (count == 0) return;
  at::parallel_for(0, count, total < kSerialBelow ? count + 1 : 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) f(items[k].tensor, items[k].begin, items[k].end);
  });
}

void sgd_cpu(const TensorList& params, const TensorList& comps, const TensorList& grads,
             const TensorList& bufs, const SgdScalars& p) {
  for_items(params, [&](int64_t t, int64_t b, int64_t e) {
    const at::Tensor* buf = p.momentum ? &bufs[t] : nullptr;
    with_half(params[t], [&](auto w_tag) {
      using W = decltype(w_tag);
      with_float_or<W>(&grads[t], [&](auto g_tag) {
        using G = decltype(g_tag);
        with_float_or<W>(buf, [&](auto b_tag) {
          using B = decltype(b_tag);
          sgd_span<W, G, B>(at_offset<W>(params[t], b), at_offset<W>(comps[t], b),
                            at_offset<const G>(grads[t], b),
                            buf != nullptr ? at_offset<B>(*buf, b) : nullptr, e - b, p);
        });
      });
    });
  });
}

void adam_cpu(const TensorList& params, const TensorList& comps, const TensorList& grads,
              const TensorList& ms, const TensorList& vs, const AdamScalars& p) {
  for_items(params, [&](int64_t t, int64_t b, int64_t e) {
    with_half(params[t], [&](auto w_tag) {
      using W = decltype(w_tag);
      with_float_or<W>(&grads[t], [&](auto g_tag) {
        using G = decltype(g_tag);
        with_float_or<W>(&ms[t], [&](auto s_tag) {
          using S = decltype(s_tag);
          adam_span<W, G, S>(at_offset<W>(params[t], b), at_offset<W>(comps[t], b),
                             at_offset<const G>(grads[t], b), at_offset<S>(ms[t], b),
                             at_offset<S>(vs[t], b), e - b, p);
        });
      });
    });
  });
}

// ---- argument checks: _reference_compensated._check, same order, types and messages ----
std::string dtype_repr(at::ScalarType t) {
  return py::repr(py::handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(t))));
}

bool is_half(at::ScalarType t) {
  return t == at::ScalarType::Half || t == at::ScalarType::BFloat16;
}

using Named = std::vector<std::pair<const char*, const TensorList*>>;

void check(const char* api, const TensorList& params, const TensorList& comps,
           const TensorList& grads, const Named& state) {
  std::vector<const TensorList*> lists{&params, &comps, &grads};
  for (const auto& s : state) lists.push_back(s.second);
  bool same = true;
  std::string lengths;
  for (const TensorList* l : lists) {
    same = same && l->size() == params.size();
    lengths += (lengths.empty() ? "" : ", ") + std::to_string(l->size());
  }
  TORCH_CHECK_VALUE(same, "ampx.", api, ": the tensor lists differ in length (", lengths, ")");
  Named named{{"grads", &grads}};
  named.insert(named.end(), state.begin(), state.end());
  for (size_t k = 0; k < params.size(); ++k) {
    const at::Tensor& p = params[k];
    const auto i = static_cast<int64_t>(k);
    TORCH_CHECK_TYPE(is_half(p.scalar_type()), "ampx.", api, ": params[", i, "] is ",
                     dtype_repr(p.scalar_type()),
                     "; compensated updates are for float16/bfloat16 weights");
    TORCH_CHECK_VALUE(p.is_contiguous(), "ampx.", api, ": tensor ", i, " is not contiguous");
    for (size_t l = 1; l < lists.size(); ++l) {
      const at::Tensor& t = (*lists[l])[k];
      TORCH_CHECK_VALUE(t.sizes() == p.sizes() && t.device() == p.device(), "ampx.", api,
                        ": tensor ", i, " differs from its parameter in shape or device");
      TORCH_CHECK_VALUE(t.is_contiguous(), "ampx.", api, ": tensor ", i, " is not contiguous");
    }
    TORCH_CHECK_TYPE(comps[k].scalar_type() == p.scalar_type(), "ampx.", api, ": comps[", i,
                     "] is ", dtype_repr(comps[k].scalar_type()), ", not ",
                     dtype_repr(p.scalar_type()));
    for (const auto& [name, list] : named) {
      const at::ScalarType d = (*list)[k].scalar_type();
      TORCH_CHECK_TYPE(d == at::ScalarType::Float || d == p.scalar_type(), "ampx.", api, ": ",
                       name, "[", i, "] is ", dtype_repr(d), "; expected torch.float32 or ",
                       dtype_repr(p.scalar_type()));
    }
    if (state.size() == 2) {  // Adam: the moments share a dtype
      const at::ScalarType m = (*state[0].second)[k].scalar_type();
      const at::ScalarType v = (*state[1].second)[k].scalar_type();
      TORCH_CHECK_TYPE(v == m, "ampx.", api, ": exp_avg_sqs[", i, "] is ", dtype_repr(v),
                       ", not ", dtype_repr(m), " like exp_avgs[", i, "]");
    }
  }
}

[[noreturn]] void no_device(const char* api, const at::Device& d) {
  TORCH_CHECK_VALUE(false, "ampx.", api, ": no native kernels for device ", d.str(),
                    "; ampx._ext uses the reference implementation for other devices");
  throw std::logic_error("unreachable");
}

// ---- public functions ----
void compensated_sgd(const TensorList& params, const TensorList& comps,
                     const TensorList& grads, const TensorList& bufs, double lr,
                     double weight_decay, double momentum, double dampening, bool nesterov,
                     bool maximize, bool first) {
  constexpr const char* api = "compensated_sgd_";
  check(api, params, comps, grads,
        momentum != 0 ? Named{{"momentum_bufs", &bufs}} : Named{});
  if (params.empty()) return;
  const SgdScalars p{static_cast<float>(lr),       static_cast<float>(weight_decay),
                     static_cast<float>(momentum), static_cast<float>(1.0 - dampening),
                     weight_decay != 0,            momentum != 0,
                     nesterov,                     maximize,
                     first};
  const at::Device device = params[0].device();
  py::gil_scoped_release nogil;
  if (device.is_cpu()) {
    sgd_cpu(params, comps, grads, bufs, p);
    return;
  }
#ifdef AMPX_WITH_CUDA
  if (device.is_cuda()) {
    compensated_sgd_cuda(params, comps, grads, bufs, p);
    return;
  }
#endif
  no_device(api, device);
}

void compensated_adam(const TensorList& params, const TensorList& comps,
                      const TensorList& grads, const TensorList& exp_avgs,
                      const TensorList& exp_avg_sqs, double lr, double beta1, double beta2,
                      double eps, double weight_decay, bool decoupled, bool maximize,
                      double step_size, double bias2_sqrt) {
  constexpr const char* api = "compensated_adam_";
  check(api, params, comps, grads, Named{{"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}});
  if (params.empty()) return;
  const AdamScalars p{static_cast<float>(beta1),
                      static_cast<float>(beta2),
                      static_cast<float>(1.0 - beta1),
                      static_cast<float>(1.0 - beta2),
                      static_cast<float>(eps),
                      static_cast<float>(weight_decay),
                      static_cast<float>(1.0 - lr * weight_decay),
                      static_cast<float>(step_size),
                      static_cast<float>(bias2_sqrt),
                      decoupled,
                      !decoupled && weight_decay != 0,
                      maximize};
  const at::Device device = params[0].device();
  py::gil_scoped_release nogil;
  if (device.is_cpu()) {
    adam_cpu(params, comps, grads, exp_avgs, exp_avg_sqs, p);
    return;
  }
#ifdef AMPX_WITH_CUDA
  if (device.is_cuda()) {
    compensated_adam_cuda(params, comps, grads, exp_avgs, exp_avg_sqs, p);
    return;
  }
#endif
  no_device(api, device);
}

}  // namespace

void init_compensated(py::module& m) {
  using py::arg;
  m.def("compensated_sgd_", &compensated_sgd, arg("params"), arg("comps"), arg("grads"),
        arg("momentum_bufs"), py::kw_only(), arg("lr"), arg("weight_decay"), arg("momentum"),
        arg("dampening"), arg("nesterov"), arg("maximize"), arg("first"),
        "One SGD step on compensated half weights (ampx/_reference_compensated.py).");
  m.def("compensated_adam_", &compensated_adam, arg("params"), arg("comps"), arg("grads"),
        arg("exp_avgs"), arg("exp_avg_sqs"), py::kw_only(), arg("lr"), arg("beta1"),
        arg("beta2"), arg("eps"), arg("weight_decay"), arg("decoupled"), arg("maximize"),
        arg("step_size"), arg("bias2_sqrt"),
        "One Adam/AdamW step on compensated half weights (ampx/_reference_compensated.py).");
}

}  // namespace ampx
