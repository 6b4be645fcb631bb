// ampx._C: the clean unscale pass and the scaler's next state, each one call per scale_loss.
//
// ampx/scaling/unscale.py plans a pass in Python: for every parameter it reads `.grad`,
// sorts it by kernel (checked in place, or unscaled into a fresh buffer), allocates the
// buffers and calls the kernels. That is the general path (sparse gradients, accumulation
// onto earlier gradients, any layout, any device, tensor subclasses). Almost every pass of
// real training is the clean case: dense contiguous plain tensors on one device, nothing
// accumulated. `unscale_pass` does exactly that case in one call, with the same rules and
// the same kernels, so its results are bitwise the general path's; on anything else it
// returns None before touching a tensor, and the caller takes the general path.
//
// Nothing here assigns `.grad`: the caller commits the results through its journal.
#include <torch/extension.h>

#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <limits>
#include <vector>

#include "ampx.h"

namespace ampx {
namespace {

namespace py = pybind11;

bool kernel_dtype(at::ScalarType t) {
  return t == at::ScalarType::Float || t == at::ScalarType::Half ||
         t == at::ScalarType::BFloat16;
}

// The Python object a tensor already has (nullptr: none yet), where this torch can tell
// without making one (`PyObjectSlot::load_pyobj`, recent torch); false where it cannot.
template <typename Slot>
auto pyobj_of(const Slot* slot, int, PyObject** out) -> decltype(slot->load_pyobj(), bool()) {
  *out = slot->load_pyobj();
  return true;
}
template <typename Slot>
bool pyobj_of(const Slot*, long, PyObject**) {
  return false;
}

// A gradient the clean pass takes as it is (the general path's in-place rule, plus what the
// kernels need): dense, contiguous, a kernel dtype, on `device`, not requiring grad, not an
// inference tensor, and exactly a torch.Tensor (no subclass: those go the general way).
bool plain(const at::Tensor& g, const at::Device& device) {
  if (g.layout() != at::kStrided || !kernel_dtype(g.scalar_type()) || g.device() != device ||
      !g.is_contiguous() || g.requires_grad() || g.is_inference() ||
      g.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python))
    return false;
  // A __torch_function__ subclass is told by its Python object. A gradient the autograd
  // engine made has none until `.grad` is read, and then it is a plain torch.Tensor: making
  // one here only to look at it would cost an allocation per parameter (torch versions
  // without `load_pyobj` do make it).
  PyObject* existing = nullptr;
  if (!pyobj_of(g.unsafeGetTensorImpl()->pyobj_slot(), 0, &existing)) {
    py::object obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(g));
    return Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
  }
  return existing == nullptr ||
         Py_TYPE(existing) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
}

// The tensor behind a list item, or nullptr when it is not one.
const at::Tensor* tensor_of(PyObject* obj) {
  return THPVariable_Check(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

void run_unscale(const TensorList& grads, const at::Tensor& inv, const at::Tensor& found,
                 const OptTensor& flags) {
  if (inv.is_cpu()) {
    unscale_cpu(grads, inv, found, flags);
    return;
  }
#ifdef AMPX_WITH_CUDA
  unscale_cuda(grads, inv, found, flags);
#endif
}

void run_unscale_into(const TensorList& src, const TensorList& dst, const at::Tensor& inv,
                      const at::Tensor& found, const OptTensor& flags) {
  if (inv.is_cpu()) {
    unscale_into_cpu(src, dst, inv, found, flags, false);
    return;
  }
#ifdef AMPX_WITH_CUDA
  unscale_into_cuda(src, dst, inv, found, flags, false);
#endif
}

struct Entry {
  py::object target;  // the parameter that gets the new gradient
  py::object source;  // the parameter whose .grad holds this pass's scaled gradient
  at::Tensor grad;    // that gradient
};

// Reads every source's gradient; false (nothing written) when the pass is not clean.
// `fresh_masters`: every target that is not its own source (an O2 master) must have no
// gradient at all, so that the caller's undo of a committed pass is "masters back to None".
bool collect(const py::list& sources, const py::list& targets, const at::Device& device,
             bool fresh_masters, std::vector<Entry>* out) {
  const Py_ssize_t n = PyList_GET_SIZE(sources.ptr());
  if (PyList_GET_SIZE(targets.ptr()) != n) return false;
  out->reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* src = PyList_GET_ITEM(sources.ptr(), i);
    PyObject* dst = PyList_GET_ITEM(targets.ptr(), i);
    const at::Tensor* param = tensor_of(src);
    const at::Tensor* target = tensor_of(dst);
    if (param == nullptr || target == nullptr) return false;
    // a master must have no gradient of an earlier pass (that is an accumulation)
    const bool master_has_grad = dst != src && target->grad().defined();
    if (fresh_masters && master_has_grad) return false;
    at::Tensor g = param->grad();
    if (!g.defined()) continue;
    if (!plain(g, device) || master_has_grad) return false;
    out->push_back({py::reinterpret_borrow<py::object>(dst),
                    py::reinterpret_borrow<py::object>(src), std::move(g)});
  }
  return true;
}

// Whether any two gradients overlap in memory (the same tensor twice, or overlapping views
// of one storage): an in-place unscale would then scale those elements twice.
bool shares_memory(const std::vector<Entry>& entries) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  spans.reserve(entries.size());
  for (const Entry& e : entries) {
    const auto start = reinterpret_cast<uintptr_t>(e.grad.data_ptr());
    spans.emplace_back(start, start + static_cast<uintptr_t>(e.grad.nbytes()));
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return true;
  }
  return false;
}

bool scalar_of(const at::Tensor& t, at::ScalarType dtype, const at::Device& device) {
  return t.scalar_type() == dtype && t.numel() == 1 && t.device() == device &&
         t.is_contiguous();
}

using State = std::array<at::Tensor, 5>;

// LossScaler.next_state: five tensors (fresh, or `into`'s on CPU), or nothing when the
// inputs are not the plain scalars the fused rule needs (the caller's general path raises
// the checked errors).
std::optional<State> next_state(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                const at::Tensor& hysteresis_tracker,
                                const at::Tensor& overflows_since_report,
                                const at::Tensor& scale_before_overflow,
                                const at::Tensor& found_inf, const ScaleParams& p,
                                const State* into = nullptr) {
  const at::Device d = scale.device();
  const auto f32 = at::ScalarType::Float;
  const auto i32 = at::ScalarType::Int;
  if (!scalar_of(scale, f32, d) || !scalar_of(growth_tracker, i32, d) ||
      !scalar_of(hysteresis_tracker, i32, d) || !scalar_of(overflows_since_report, f32, d) ||
      !scalar_of(scale_before_overflow, f32, d) || !scalar_of(found_inf, f32, d))
    return std::nullopt;
#ifndef AMPX_WITH_CUDA
  if (!d.is_cpu()) return std::nullopt;
#endif
  if (d.is_cpu()) {  // five scalars: no kernel launch is worth its dispatch here
    const State out =
        into != nullptr ? *into
                        : State{at::empty_like(scale), at::empty_like(growth_tracker),
                                at::empty_like(hysteresis_tracker),
                                at::empty_like(overflows_since_report),
                                at::empty_like(scale_before_overflow)};
    const float old_since = overflows_since_report.data_ptr<float>()[0];
    const float found = found_inf.data_ptr<float>()[0];
    *out[0].data_ptr<float>() = *scale.data_ptr<float>();
    *out[1].data_ptr<int32_t>() = *growth_tracker.data_ptr<int32_t>();
    *out[2].data_ptr<int32_t>() = *hysteresis_tracker.data_ptr<int32_t>();
    // torch.where(since > 0, before, scale) and torch.maximum(since, found) (NaN wins)
    *out[4].data_ptr<float>() =
        old_since > 0.f ? *scale_before_overflow.data_ptr<float>() : *scale.data_ptr<float>();
    *out[3].data_ptr<float>() = (std::isnan(old_since) || std::isnan(found))
                                    ? std::numeric_limits<float>::quiet_NaN()
                                    : std::max(old_since, found);
    update_scale_cpu(out[0], out[1], out[2], found_inf, p);
    return out;
  }
  at::Tensor s = scale.clone();
  at::Tensor g = growth_tracker.clone();
  at::Tensor h = hysteresis_tracker.clone();
  at::Tensor before = at::where(overflows_since_report > 0, scale_before_overflow, scale);
  at::Tensor since = at::maximum(overflows_since_report, found_inf);
#ifdef AMPX_WITH_CUDA
  update_scale_cuda(s, g, h, found_inf, p);
#endif
  return State{s, g, h, since, before};
}

ScaleParams rule_of(double growth, double backoff, int64_t interval, int64_t hysteresis,
                    double min_scale, double max_scale) {
  return ScaleParams{static_cast<float>(growth),    static_cast<float>(backoff),
                     interval,                      static_cast<int32_t>(hysteresis),
                     static_cast<float>(min_scale), static_cast<float>(max_scale)};
}

py::object wrap(const at::Tensor& t) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}

// How many references a tensor's Python object gets from its C++ holders (1 where the
// tensor keeps its Python object alive while C++ holds it, recent torch; else 0), measured
// once on a probe: a tensor held by C++ (`probe`) and by one Python reference (`obj`).
Py_ssize_t owned_pyobj_refs() {
  static const Py_ssize_t extra = [] {
    at::Tensor probe = at::zeros({1});
    PyObject* obj = THPVariable_Wrap(probe);
    const Py_ssize_t n = obj == nullptr ? -1 : Py_REFCNT(obj) - 1;
    Py_XDECREF(obj);
    if (obj == nullptr) PyErr_Clear();
    return n;
  }();
  return extra;
}

// Whether `obj` (a tensor in the spare tuple) is held by nothing else: no other Python
// reference, no other C++ holder but `holders` (the scale: its view's base), and not
// exported as a view (`storage_users` tensors on its storage: itself, and the view).
bool unheld(PyObject* obj, long holders, long storage_users) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return false;
  const at::Tensor& x = THPVariable_Unpack(obj);
  const long uses = static_cast<long>(x.use_count());  // its Python object's, and holders
  const Py_ssize_t extra = owned_pyobj_refs();
  if (extra < 0 || uses < 1 || uses > 1 + holders) return false;
  if (Py_REFCNT(obj) != 1 + (uses > 1 ? extra : 0)) return false;
  return static_cast<long>(x.storage().use_count()) <= storage_users && !x.is_inference() &&
         !x.requires_grad() && x.is_cpu() && x.numel() == 1 && x.is_contiguous() &&
         x.layout() == at::kStrided;
}

// The scaler's spare set (its state of two passes ago: scale, growth tracker, hysteresis
// tracker, overflows since report, scale before overflow, 1/scale, the 0-d scale view) when
// nothing but the spare tuple can reach it (`unheld`): an autograd graph that saved the view,
// a caller that kept `scaler.scale`, another view of it: any of these makes the set not
// spare. CPU only: five scalars and 1/scale are written there in place of seven fresh
// tensors (an allocation each, per pass).
std::optional<std::array<at::Tensor, 7>> spare_set(const py::object& spare) {
  if (!PyTuple_CheckExact(spare.ptr()) || PyTuple_GET_SIZE(spare.ptr()) != 7) {
    return std::nullopt;
  }
  PyObject* const* items = &PyTuple_GET_ITEM(spare.ptr(), 0);
  // the scale: held by its view (as the view's base) too, its storage shared with the view
  if (!unheld(items[0], 1, 2) || !unheld(items[6], 0, 2)) return std::nullopt;
  for (size_t i = 1; i < 6; ++i) {
    if (!unheld(items[i], 0, 1)) return std::nullopt;
  }
  std::array<at::Tensor, 7> t;
  const auto f32 = at::ScalarType::Float;
  const auto i32 = at::ScalarType::Int;
  const at::ScalarType dtypes[7] = {f32, i32, i32, f32, f32, f32, f32};
  for (size_t i = 0; i < 7; ++i) {
    t[i] = THPVariable_Unpack(items[i]);
    if (t[i].scalar_type() != dtypes[i]) return std::nullopt;
  }
  if (t[0].dim() != 1 || t[6].dim() != 0 || t[6].data_ptr() != t[0].data_ptr() ||
      !t[6].storage().is_alias_of(t[0].storage()))
    return std::nullopt;
  return t;
}

py::object next_scale_state(const py::tuple& state, const at::Tensor& found_inf,
                            const py::tuple& rule, const py::object& spare) {
  if (state.size() != 5 || rule.size() != 6) throw py::value_error("next_scale_state: arity");
  std::array<const at::Tensor*, 5> cur{};
  for (size_t i = 0; i < 5; ++i) {
    cur[i] = tensor_of(state[i].ptr());
    if (cur[i] == nullptr) return py::none();
  }
  const ScaleParams p = rule_of(rule[0].cast<double>(), rule[1].cast<double>(),
                                rule[2].cast<int64_t>(), rule[3].cast<int64_t>(),
                                rule[4].cast<double>(), rule[5].cast<double>());
  const at::Tensor& scale = *cur[0];
  auto set = found_inf.is_cpu() && scale.is_cpu() ? spare_set(spare) : std::nullopt;
  if (set) {
    auto& t = *set;
    const State five{t[0], t[1], t[2], t[3], t[4]};
    if (!next_state(scale, *cur[1], *cur[2], *cur[3], *cur[4], found_inf, p, &five)) {
      return py::none();
    }
    *t[5].data_ptr<float>() = 1.0f / *t[0].data_ptr<float>();
    // written through raw pointers: the version counters must still move (the scaler's
    // caches test identity and version; the view shares the scale's counter)
    for (size_t i = 0; i < 6; ++i) t[i].unsafeGetTensorImpl()->bump_version();
    // a new tuple: from here the set is held twice (the scaler's spare tuple and the caller's
    // result) until the caller commits or drops it, so no other pass (another thread's, before
    // this one commits) can take it as spare too
    PyObject* const* items = &PyTuple_GET_ITEM(spare.ptr(), 0);
    py::tuple out(7);
    for (Py_ssize_t i = 0; i < 7; ++i) {
      out[i] = py::reinterpret_borrow<py::object>(items[i]);
    }
    return std::move(out);
  }
  auto next = next_state(scale, *cur[1], *cur[2], *cur[3], *cur[4], found_inf, p);
  if (!next) return py::none();
  const State& n = *next;
  // and 1/scale, which the next pass unscales by (torch.reciprocal's value: IEEE division)
  at::Tensor inv;
  if (n[0].is_cpu()) {
    inv = at::empty_like(n[0]);
    *inv.data_ptr<float>() = 1.0f / *n[0].data_ptr<float>();
  } else {
    inv = at::reciprocal(n[0]);
  }
  // and the scale as a 0-d view, which the next `scale_loss` multiplies the loss by
  return py::make_tuple(wrap(n[0]), wrap(n[1]), wrap(n[2]), wrap(n[3]), wrap(n[4]), wrap(inv),
                        wrap(n[0].view(at::IntArrayRef{})));
}

// The clean pass (see the file comment). Returns None, or
// (found_inf, flags or None, assign, results, clear, flag_params):
//   assign/results: the (target, source grad, None) entries that got a fresh buffer, and
//   those buffers (entries checked in place already are their own new gradient);
//   clear: sources whose gradient went into another tensor (the half model params);
//   flag_params: the targets in the order of `flags` (fresh ones, then in-place ones).
//
// With `written` (a list: the committing pass of ampx.scaling.scaled_pass) the pass also
// commits its gradients, all under the GIL (no Python runs in between, so no interrupt
// lands half-way): each fresh buffer becomes its target's `.grad` (a parameter's own
// gradient is this pass's, nobody else's: the caller drops it if the pass fails), a master
// that got one is appended to `written` (the caller's undo: those go back to None), and the
// half model gradients are released; assign, results and clear then come back empty. Every
// master must be without a gradient then (else None: the general path).
py::object unscale_pass(const py::list& sources, const py::list& targets,
                        const at::Tensor& inv_scale, bool unit, bool per_tensor,
                        const std::optional<at::Tensor>& found_in, const py::object& written) {
  if (inv_scale.scalar_type() != at::ScalarType::Float || inv_scale.numel() != 1 ||
      !inv_scale.is_contiguous())
    return py::none();
  const at::Device device = inv_scale.device();
#ifndef AMPX_WITH_CUDA
  if (!device.is_cpu()) return py::none();
#endif
  if (found_in.has_value()) {
    const at::Tensor& f = *found_in;
    if (f.scalar_type() != at::ScalarType::Float || f.numel() != 1 || f.device() != device ||
        !f.is_contiguous())
      return py::none();
  }
  const bool commit = !written.is_none();
  if (commit && !PyList_Check(written.ptr())) return py::none();
  std::vector<Entry> entries;
  if (!collect(sources, targets, device, commit, &entries)) return py::none();

  // A committing pass unscales a parameter's own gradient in place, as GradScaler does: the
  // gradient is this pass's (nothing was there before it), so the undo of a failure anywhere
  // is dropping it, whatever the kernel left in it. Unless two entries share memory (one
  // tensor assigned to two parameters, overlapping views): then each gets its own buffer.
  const bool own_in_place = commit && !shares_memory(entries);
  // Sort as the general path does: fresh buffers first, then the in-place ones.
  std::vector<const Entry*> fresh, in_place;
  TensorList fresh_src, fresh_dst, in_place_grads;
  for (const Entry& e : entries) {
    const at::Tensor& target = THPVariable_Unpack(e.target.ptr());
    const bool same_dtype = e.grad.scalar_type() == target.scalar_type();
    if ((unit && same_dtype) || (own_in_place && e.target.is(e.source))) {
      in_place.push_back(&e);
      in_place_grads.push_back(e.grad);
      continue;
    }
    // the general path's `_fresh`: the target's layout when the dtype changes at one shape
    const at::Tensor& like = (target.scalar_type() != e.grad.scalar_type() &&
                              target.sizes() == e.grad.sizes()) ? target : e.grad;
    if (!kernel_dtype(target.scalar_type()) || like.numel() != e.grad.numel()) {
      return py::none();
    }
    fresh.push_back(&e);
    fresh_src.push_back(e.grad);
    fresh_dst.push_back(at::empty_like(like, like.options().dtype(target.scalar_type())));
    if (!fresh_dst.back().is_contiguous()) return py::none();  // staged by the general path
  }
  at::Tensor found = found_in.has_value()
                         ? *found_in
                         : at::zeros({1}, inv_scale.options().dtype(at::kFloat));
  const auto total = static_cast<int64_t>(entries.size());
  OptTensor flags;
  if (per_tensor) flags = at::zeros({total}, inv_scale.options().dtype(at::kFloat));
  const auto n_fresh = static_cast<int64_t>(fresh.size());
  {
    py::gil_scoped_release nogil;
    if (n_fresh > 0) {
      OptTensor part;
      if (flags.has_value()) part = flags->narrow(0, 0, n_fresh);
      run_unscale_into(fresh_src, fresh_dst, inv_scale, found, part);
    }
    if (!in_place.empty()) {
      OptTensor part;
      if (flags.has_value()) part = flags->narrow(0, n_fresh, total - n_fresh);
      run_unscale(in_place_grads, inv_scale, found, part);
    }
  }
  py::list assign, results, clear, flag_params;
  if (commit) {  // no Python runs from here to the return: all of it, or (before) none
    py::list out = py::reinterpret_borrow<py::list>(written);
    for (size_t i = 0; i < fresh.size(); ++i) {
      const Entry& e = *fresh[i];
      THPVariable_Unpack(e.target.ptr()).mutable_grad() = fresh_dst[i];
      if (!e.target.is(e.source)) out.append(e.target);
    }
    for (const Entry& e : entries) {
      if (!e.target.is(e.source)) THPVariable_Unpack(e.source.ptr()).mutable_grad().reset();
    }
  } else {
    for (size_t i = 0; i < fresh.size(); ++i) {
      const Entry& e = *fresh[i];
      assign.append(py::make_tuple(e.target, wrap(e.grad), py::none()));
      results.append(wrap(fresh_dst[i]));
    }
    for (const Entry& e : entries) {
      if (!e.target.is(e.source)) clear.append(e.source);
    }
  }
  for (const Entry* e : fresh) flag_params.append(e->target);
  for (const Entry* e : in_place) flag_params.append(e->target);
  py::object flag_obj = flags.has_value() ? wrap(*flags) : py::none();
  return py::make_tuple(wrap(found), flag_obj, assign, results, clear, flag_params);
}

// Sets every (object, name, value) of a flat tuple, in order: all of them or, when one
// raises, none (the ones set are put back, then the error propagates). It runs no Python
// bytecode between two assignments (plain objects: their __dict__; tensors: `.grad`'s C
// setter), so a KeyboardInterrupt lands before or after all of them: the commit of a
// transition in one call, where a journal of Python assignments could be cut half-way.
void assign(const py::tuple& triples) {
  PyObject* items = triples.ptr();
  const Py_ssize_t n = PyTuple_GET_SIZE(items);
  if (n % 3 != 0) throw py::value_error("assign: a flat tuple of (object, name, value)");
  std::vector<py::object> old;
  old.reserve(static_cast<size_t>(n / 3));
  for (Py_ssize_t i = 0; i < n; i += 3) {
    PyObject* obj = PyTuple_GET_ITEM(items, i);
    PyObject* name = PyTuple_GET_ITEM(items, i + 1);
    PyObject* prev = PyObject_GetAttr(obj, name);
    if (prev != nullptr) old.push_back(py::reinterpret_steal<py::object>(prev));
    if (prev == nullptr || PyObject_SetAttr(obj, name, PyTuple_GET_ITEM(items, i + 2)) < 0) {
      py::error_already_set error;  // fetched: the undo below runs with no error set
      for (Py_ssize_t k = static_cast<Py_ssize_t>(old.size()) - 1 - (prev != nullptr ? 1 : 0);
           k >= 0; --k) {
        if (PyObject_SetAttr(PyTuple_GET_ITEM(items, 3 * k),
                             PyTuple_GET_ITEM(items, 3 * k + 1), old[k].ptr()) < 0)
          PyErr_Clear();
      }
      throw error;
    }
  }
}

// `copy_` for the usual lists (the O2 master -> model copy of every step): every pair dense,
// contiguous, of a kernel dtype, equal in size, all on one device, plain tensors or
// Parameters (no DTensor or other Python-dispatched tensor: those need `_ext.copy_`'s local
// shards). Copies, moves each destination's version counter, and returns true, or returns
// false having touched nothing, and the caller takes `_ext.copy_`'s general path (per-pair
// staging in Python).
bool copy_plain(const py::list& src, const py::list& dst) {
  const Py_ssize_t n = PyList_GET_SIZE(src.ptr());
  if (n == 0 || PyList_GET_SIZE(dst.ptr()) != n) return false;
  TensorList s, d;
  s.reserve(static_cast<size_t>(n));
  d.reserve(static_cast<size_t>(n));
  std::optional<at::Device> device;
  for (Py_ssize_t i = 0; i < n; ++i) {
    for (PyObject* obj : {PyList_GET_ITEM(src.ptr(), i), PyList_GET_ITEM(dst.ptr(), i)}) {
      const at::Tensor* t = tensor_of(obj);
      if (t == nullptr || !t->defined() || t->layout() != at::kStrided ||
          !kernel_dtype(t->scalar_type()) || !t->is_contiguous() ||
          t->unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python))
        return false;
      if (!device) device = t->device();
      if (t->device() != *device) return false;
    }
    s.push_back(THPVariable_Unpack(PyList_GET_ITEM(src.ptr(), i)));
    d.push_back(THPVariable_Unpack(PyList_GET_ITEM(dst.ptr(), i)));
    if (s.back().numel() != d.back().numel()) return false;
  }
  if (!device->is_cpu() && !device->is_cuda()) return false;
  check_writable(d);
  py::gil_scoped_release nogil;
  if (device->is_cpu()) {
    copy_cpu(s, d);
  } else {
#ifdef AMPX_WITH_CUDA
    copy_cuda(s, d);
#else
    return false;
#endif
  }
  bump_versions(d);  // one per parameter, as an in-place op (ampx.h)
  return true;
}

// `p.grad = None` for every parameter of `params`, in one call under the GIL (the O2 step
// consumes its masters' gradients); anything but a plain tensor or Parameter goes through
// its `grad` setter.
void drop_grads(const py::list& params) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyList_GET_ITEM(params.ptr(), i);
    const at::Tensor* t = tensor_of(p);
    if (t != nullptr && !t->unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python)) {
      const_cast<at::Tensor*>(t)->mutable_grad().reset();
    } else if (PyObject_SetAttrString(p, "grad", Py_None) < 0) {
      throw py::error_already_set();
    }
  }
}

// The parameters of `params` that have a gradient (one call instead of a Python loop).
py::list with_grads(const py::list& params) {
  py::list out;
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyList_GET_ITEM(params.ptr(), i);
    const at::Tensor* t = tensor_of(p);
    if (t == nullptr) {  // not a tensor: ask Python, as a comprehension would
      py::object grad = py::reinterpret_borrow<py::object>(p).attr("grad");
      if (!grad.is_none()) out.append(py::reinterpret_borrow<py::object>(p));
    } else if (t->grad().defined()) {
      out.append(py::reinterpret_borrow<py::object>(p));
    }
  }
  return out;
}

}  // namespace

void init_grad_pass(py::module& m) {
  using py::arg;
  m.def("unscale_pass", &unscale_pass, arg("sources"), arg("targets"), arg("inv_scale"),
        arg("unit"), arg("per_tensor"), arg("found_inf") = py::none(),
        arg("written") = py::none(),
        "The clean unscale pass in one call, or None (see grad_pass.cpp).");
  m.def("assign", &assign, arg("triples"),
        "setattr for each (object, name, value) of a flat tuple: all or none.");
  m.def("copy_plain", &copy_plain, arg("src"), arg("dst"),
        "copy_ of plain contiguous lists on one device in one call; False: not such lists.");
  m.def("drop_grads", &drop_grads, arg("params"),
        "Set every parameter's .grad to None (one call).");
  m.def("with_grads", &with_grads, arg("params"),
        "The parameters of a list that have a gradient.");
  m.def("next_scale_state", &next_scale_state, arg("state"), arg("found_inf"), arg("rule"),
        arg("spare") = py::none(),
        "LossScaler.next_state in one call: the five state tensors, 1/scale and the 0-d "
        "scale, fresh or written into `spare` (see spare_set).");
}

}  // namespace ampx
