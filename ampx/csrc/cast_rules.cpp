// O1's native cast wrapper, the argument side: what a call's arguments are and what to cast.
//
// Classifies each argument as ampx.o1.casting.map_tensors' walker would (tensors, plain
// values, exact lists/tuples/dicts, and what only the Python closure handles), tests a
// tensor's device against the session's (ampx.o1.casters._device_predicate), collects the
// floating dtypes present as bitsets, and plans per rule what to cast to what (apply_rule).
// Casts are made by the same `Tensor.to` call as TensorBase.half/float (GIL released, as
// torch's binding does), and parameters go through the weight-cast cache's hit path (same
// table, same validity test, same counters; a miss is made as the cache's closure makes it).
// Anything this side cannot do exactly as the closure would goes to the closure
// (call_python). The Python type that calls apply_rule is cast_wrapper.cpp.
#include <torch/extension.h>

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include "cast_wrapper.h"

#include <vector>

namespace ampx {
namespace cast {
namespace {

constexpr int kMaxDepth = 16;

// Floating dtypes as bits (the dtype sets of ampx.o1.casters).
constexpr unsigned kF16 = 1, kBF16 = 2, kF32 = 4, kF64 = 8;
constexpr unsigned kHalves = kF16 | kBF16, kPromotable = kF16 | kBF16 | kF32;

unsigned bit(at::ScalarType s) {
  switch (s) {
    case at::ScalarType::Half:
      return kF16;
    case at::ScalarType::BFloat16:
      return kBF16;
    case at::ScalarType::Float:
      return kF32;
    case at::ScalarType::Double:
      return kF64;
    default:
      return 0;
  }
}

// What one cast does: the session's half dtype through the cache, or `to` for `froms`.
struct Cast {
  bool half;
  at::ScalarType to;
  unsigned froms;
};

// The weight cache is off: inside a torch.func transform (ampx.o1.casting.cacheable), or
// while torch.jit.trace records (a cast made outside the trace would be baked in as a
// constant that requires grad; autocast's cache_enabled=False, automatically).
bool cache_off() {
  // torch._C._are_functorch_transforms_active()
  auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) ||
         torch::jit::tracer::isTracing();
}

// 1 eligible, 0 not, -1 error (the device test of ampx.o1.casters._device_predicate).
int eligible(CastWrapper* self, const at::Tensor& t) {
  const int type = static_cast<int>(t.device().type());
  if (type < 0 || type >= kDeviceSlots) {
    return 0;
  }
  int8_t ok = self->device_ok[type];
  if (ok < 0) {
    std::string name;
    try {
      name = c10::DeviceTypeName(t.device().type(), /*lower_case=*/true);
    } catch (const std::exception&) {
      return 0;
    }
    PyObject* py = PyUnicode_FromStringAndSize(name.data(), static_cast<Py_ssize_t>(name.size()));
    if (py == nullptr) {
      return -1;
    }
    const int found = PySet_Contains(self->devices, py);
    Py_DECREF(py);
    if (found < 0) {
      return -1;
    }
    ok = self->device_ok[type] = static_cast<int8_t>(found);
  }
  return ok;
}

enum Kind { K_PLAIN, K_TENSOR, K_SEQ, K_DICT, K_ODD, K_ERROR };

// How the closure's walker would treat `o`; K_ODD for what only the closure handles.
Kind classify(PyObject* o) {
  PyTypeObject* tp = Py_TYPE(o);
  if (tp == G.tensor || tp == G.parameter) {
    return K_TENSOR;
  }
  if (o == Py_None || tp == &PyLong_Type || tp == &PyFloat_Type || tp == &PyBool_Type ||
      tp == &PyUnicode_Type) {
    return K_PLAIN;
  }
  if (tp == &PyTuple_Type || tp == &PyList_Type) {
    return K_SEQ;
  }
  if (tp == &PyDict_Type) {
    return K_DICT;
  }
  for (PyTypeObject* plain : G.plain) {
    if (tp == plain) {
      return K_PLAIN;
    }
  }
  // isinstance, as the closure tests it (subclasses and __class__ included).
  int r = PyObject_IsInstance(o, reinterpret_cast<PyObject*>(G.tensor));
  if (r == 0) {
    r = PyObject_IsInstance(o, G.containers);
  }
  return r < 0 ? K_ERROR : r > 0 ? K_ODD : K_PLAIN;
}

// Walks `o` without side effects. 0: fine, 1: the closure must run, -1: error.
// `dtypes` (if given) collects the floating dtypes of eligible tensors; `half_only` stops at
// the first eligible half tensor (returning 1).
int scan(CastWrapper* self, PyObject* o, int depth, bool* has_tensor, unsigned* dtypes,
         bool half_only) {
  switch (classify(o)) {
    case K_PLAIN:
      return 0;
    case K_TENSOR: {
      *has_tensor = true;
      if (dtypes != nullptr || half_only) {
        const at::Tensor& t = THPVariable_Unpack(o);
        const unsigned b = bit(t.scalar_type());
        if (b != 0) {
          const int e = eligible(self, t);
          if (e < 0) {
            return -1;
          }
          if (e) {
            if (half_only && (b & kHalves)) {
              return 1;
            }
            if (dtypes != nullptr) {
              *dtypes |= b;
            }
          }
        }
      }
      return 0;
    }
    case K_SEQ: {
      if (depth >= kMaxDepth) {
        return 1;
      }
      const bool tuple = PyTuple_CheckExact(o);
      const Py_ssize_t n = tuple ? PyTuple_GET_SIZE(o) : PyList_GET_SIZE(o);
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (!tuple && i >= PyList_GET_SIZE(o)) {
          return 1;
        }
        PyObject* item = tuple ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i);
        Py_INCREF(item);
        const int r = scan(self, item, depth + 1, has_tensor, dtypes, half_only);
        Py_DECREF(item);
        if (r != 0) {
          return r;
        }
      }
      return 0;
    }
    case K_DICT: {
      if (depth >= kMaxDepth) {
        return 1;
      }
      Py_ssize_t pos = 0;
      PyObject *key, *value;
      while (PyDict_Next(o, &pos, &key, &value)) {
        Py_INCREF(value);
        const int r = scan(self, value, depth + 1, has_tensor, dtypes, half_only);
        Py_DECREF(value);
        if (r != 0) {
          return r;
        }
      }
      return 0;
    }
    case K_ODD:
      return 1;
    case K_ERROR:
    default:
      return -1;
  }
}

int scan_all(CastWrapper* self, PyObject* const* args, Py_ssize_t n, bool* has_tensor,
             unsigned* dtypes, bool half_only) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int r = scan(self, args[i], 0, has_tensor, dtypes, half_only);
    if (r != 0) {
      return r;
    }
  }
  return 0;
}

PyObject* to_dtype(const at::Tensor& t, at::ScalarType dtype) {
  HANDLE_TH_ERRORS
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;  // as TensorBase.half/float do
    out = t.to(dtype, /*non_blocking=*/false, /*copy=*/false, c10::MemoryFormat::Preserve);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// id(param) as the table's key, without allocating an int per lookup: a direct-mapped
// memo of the int objects (an int's value is the address, so a reused address maps to an
// equal key, as id() would give).
struct KeySlot {
  void* ptr;
  PyObject* key;
};
KeySlot g_keys[512];

PyObject* id_key(PyObject* o) {  // borrowed
  KeySlot& slot = g_keys[(reinterpret_cast<uintptr_t>(o) >> 4) & 511];
  if (slot.ptr != o || slot.key == nullptr) {
    PyObject* key = PyLong_FromVoidPtr(o);
    if (key == nullptr) {
      return nullptr;
    }
    Py_XSETREF(slot.key, key);
    slot.ptr = o;
  }
  return slot.key;
}

// 1 when the half cast lowers `t` (float32 or the other half dtype, on a session device),
// 0 when it passes `t` through, -1 on an error (the half cast's `accepts`).
int lowers(CastWrapper* self, const at::Tensor& t) {
  const at::ScalarType st = t.scalar_type();
  if (st != at::ScalarType::Float && st != self->other_half) {
    return 0;
  }
  return eligible(self, t);
}

// A miss of WeightCastCache.bind's closure, as that closure makes it: a tensor its `accepts`
// refuses (not float32 or the other half dtype, or not on a session device) comes back as it
// is; else the cast, the miss counter, and the entry (unless a `.data` alias of the tensor
// lives: `WeightCastCache.note_data_access`). Natively because every weight misses once per
// iteration (the cache is cleared at `scale_loss`): in Python that was O1's forward excess.
PyObject* cache_miss(CastWrapper* self, PyObject* o, const at::Tensor& t) {
  const int lower = lowers(self, t);
  if (lower <= 0) {
    return lower < 0 ? nullptr : (Py_INCREF(o), o);
  }
  PyObject* cast = to_dtype(t, self->half);
  if (cast == nullptr) {
    return nullptr;
  }
  self->hits[1] += 1;  // counts[1]: misses
  PyObject* key = id_key(o);
  const int seen = key == nullptr ? -1 : PyDict_Contains(self->aliased, key);
  if (seen != 0) {
    if (seen < 0) {
      Py_DECREF(cast);
      return nullptr;
    }
    return cast;
  }
  PyObject* version = PyLong_FromLongLong(t._version());
  PyObject* ptr = version == nullptr ? nullptr : PyLong_FromVoidPtr(t.data_ptr());
  PyObject* entry = ptr == nullptr ? nullptr : PyTuple_Pack(4, o, version, ptr, cast);
  Py_XDECREF(version);
  Py_XDECREF(ptr);
  if (entry == nullptr || PyDict_SetItem(self->table, key, entry) < 0) {
    Py_XDECREF(entry);
    Py_DECREF(cast);
    return nullptr;
  }
  Py_DECREF(entry);
  return cast;
}

// WeightCastCache.bind's closure, natively: the hit path, then the miss (the closure's only
// for a wrapper made without the cache's alias table).
PyObject* cached_cast(CastWrapper* self, PyObject* o, const at::Tensor& t) {
  HANDLE_TH_ERRORS
  if (self->table != Py_None) {
    PyObject* key = id_key(o);  // id(param)
    if (key == nullptr) {
      return nullptr;
    }
    PyObject* entry = PyDict_GetItemWithError(self->table, key);  // borrowed
    if (entry == nullptr && PyErr_Occurred()) {
      return nullptr;
    }
    if (entry != nullptr && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 4 &&
        PyTuple_GET_ITEM(entry, 0) == o) {
      PyObject* cast = PyTuple_GET_ITEM(entry, 3);
      const long long version = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1));
      if (version == -1 && PyErr_Occurred()) {
        return nullptr;
      }
      if (version == t._version() && Py_TYPE(cast) == G.tensor) {
        void* ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 2));
        if (ptr == nullptr && PyErr_Occurred()) {
          return nullptr;
        }
        if (ptr == t.data_ptr()) {
          const at::Tensor& c = THPVariable_Unpack(cast);
          if (c.requires_grad() ||
              (!(t.requires_grad() && c10::GradMode::is_enabled()) &&
               !(c.is_inference() && !c10::InferenceMode::is_enabled()))) {
            *self->hits += 1;
            Py_INCREF(cast);
            return cast;
          }
        }
      }
    }
  }
  if (self->table == Py_None || !PyDict_CheckExact(self->aliased)) {
    return PyObject_CallOneArg(self->cached, o);
  }
  return cache_miss(self, o, t);
  END_HANDLE_TH_ERRORS
}

// ampx.o1.casters: Caster._make_half_cast's to_half, or dtype_cast's to_dtype.
PyObject* cast_tensor(CastWrapper* self, PyObject* o, const Cast& cast) {
  const at::Tensor& t = THPVariable_Unpack(o);
  if (cast.half) {
    const bool param = Py_TYPE(o) == G.parameter;
    if (param && !cache_off()) {
      return cached_cast(self, o, t);
    }
    const int lower = lowers(self, t);
    if (lower <= 0) {
      return lower < 0 ? nullptr : (Py_INCREF(o), o);
    }
    if ((param || (t.requires_grad() && t.is_leaf())) && !cache_off()) {
      return cached_cast(self, o, t);
    }
    return to_dtype(t, self->half);
  }
  if (!(bit(t.scalar_type()) & cast.froms)) {
    Py_INCREF(o);
    return o;
  }
  const int e = eligible(self, t);
  if (e <= 0) {
    if (e < 0) {
      return nullptr;
    }
    Py_INCREF(o);
    return o;
  }
  return to_dtype(t, cast.to);
}

PyObject* map(CastWrapper* self, PyObject* o, const Cast& cast);

// The items of tuple `seq` mapped: a new tuple (or list), or nullptr with no error set when
// every item came back as itself.
PyObject* map_items(CastWrapper* self, PyObject* seq, const Cast& cast, bool as_list) {
  const Py_ssize_t n = PyTuple_GET_SIZE(seq);
  PyObject* out = nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyTuple_GET_ITEM(seq, i);
    PyObject* m = map(self, item, cast);
    if (m == nullptr) {
      Py_XDECREF(out);
      return nullptr;
    }
    if (m != item && out == nullptr) {
      out = as_list ? PyList_New(n) : PyTuple_New(n);
      if (out == nullptr) {
        Py_DECREF(m);
        return nullptr;
      }
      for (Py_ssize_t j = 0; j < i; ++j) {
        PyObject* same = PyTuple_GET_ITEM(seq, j);
        Py_INCREF(same);
        if (as_list) {
          PyList_SET_ITEM(out, j, same);
        } else {
          PyTuple_SET_ITEM(out, j, same);
        }
      }
    }
    if (out == nullptr) {
      Py_DECREF(m);
    } else if (as_list) {
      PyList_SET_ITEM(out, i, m);
    } else {
      PyTuple_SET_ITEM(out, i, m);
    }
  }
  return out;
}

// ampx.o1.casting.map_tensors over a scanned value: `o` itself (a new reference) if unchanged.
PyObject* map(CastWrapper* self, PyObject* o, const Cast& cast) {
  switch (classify(o)) {
    case K_TENSOR:
      return cast_tensor(self, o, cast);
    case K_SEQ: {
      // The items are held (a cast releases the GIL, and another thread may change a list).
      const bool tuple = PyTuple_CheckExact(o);
      PyObject* seq = tuple ? o : PyList_AsTuple(o);
      if (seq == nullptr) {
        return nullptr;
      }
      if (tuple) {
        Py_INCREF(seq);
      }
      PyObject* out = map_items(self, seq, cast, !tuple);
      Py_DECREF(seq);
      if (out == nullptr && !PyErr_Occurred()) {
        Py_INCREF(o);
        return o;
      }
      return out;
    }
    case K_DICT: {
      PyObject* items = PyDict_Items(o);  // held, as above
      if (items == nullptr) {
        return nullptr;
      }
      PyObject* out = nullptr;
      bool changed = false;
      const Py_ssize_t n = PyList_GET_SIZE(items);
      for (Py_ssize_t i = 0; i < n && !PyErr_Occurred(); ++i) {
        PyObject* pair = PyList_GET_ITEM(items, i);
        PyObject* value = PyTuple_GET_ITEM(pair, 1);
        PyObject* m = map(self, value, cast);
        if (m == nullptr) {
          break;
        }
        if (m != value && out == nullptr) {
          out = PyDict_New();
          for (Py_ssize_t j = 0; out != nullptr && j < i; ++j) {
            PyObject* same = PyList_GET_ITEM(items, j);
            if (PyDict_SetItem(out, PyTuple_GET_ITEM(same, 0), PyTuple_GET_ITEM(same, 1)) < 0) {
              Py_CLEAR(out);
            }
          }
          if (out == nullptr) {
            Py_DECREF(m);
            break;
          }
        }
        changed = changed || m != value;
        if (out != nullptr && PyDict_SetItem(out, PyTuple_GET_ITEM(pair, 0), m) < 0) {
          Py_DECREF(m);
          break;
        }
        Py_DECREF(m);
      }
      Py_DECREF(items);
      if (PyErr_Occurred()) {
        Py_XDECREF(out);
        return nullptr;
      }
      if (!changed) {
        Py_XDECREF(out);
        Py_INCREF(o);
        return o;
      }
      return out;
    }
    case K_ERROR:
      return nullptr;
    default:
      Py_INCREF(o);
      return o;
  }
}

// Map every argument (positional and keyword values) with `cast`, then call the original.
PyObject* map_call(CastWrapper* self, PyObject* const* args, size_t nargsf, PyObject* kwnames,
                   Py_ssize_t first, Py_ssize_t last, const Cast& cast) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  PyObject* small[8];
  std::vector<PyObject*> big;
  PyObject** out = small;
  if (total > 8) {
    big.resize(static_cast<size_t>(total));
    out = big.data();
  }
  bool changed = false;
  for (Py_ssize_t i = 0; i < total; ++i) {
    if (i < first || i >= last) {
      Py_INCREF(args[i]);
      out[i] = args[i];
      continue;
    }
    PyTypeObject* tp = Py_TYPE(args[i]);
    PyObject* m = tp == G.tensor || tp == G.parameter ? cast_tensor(self, args[i], cast)
                                                      : map(self, args[i], cast);
    if (m == nullptr) {
      for (Py_ssize_t j = 0; j < i; ++j) {
        Py_DECREF(out[j]);
      }
      return nullptr;
    }
    out[i] = m;
    changed = changed || m != args[i];
  }
  PyObject* result = changed ? PyObject_Vectorcall(self->original, out, nargs, kwnames)
                             : call_original(self, args, nargsf, kwnames);
  for (Py_ssize_t i = 0; i < total; ++i) {
    Py_DECREF(out[i]);
  }
  return result;
}

Cast to_cast(at::ScalarType to, unsigned froms) {
  return Cast{false, to, froms};
}

at::ScalarType widest(unsigned dtypes) {
  return (dtypes & kF64) ? at::ScalarType::Double : at::ScalarType::Float;
}

int popcount(unsigned v) {
  int n = 0;
  for (; v; v &= v - 1) {
    ++n;
  }
  return n;
}

}  // namespace

// The rule, with casts on in this thread (the closure's eager branch).
PyObject* apply_rule(CastWrapper* self, PyObject* const* args, size_t nargsf,
                     PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  bool has_tensor = false;
  switch (self->rule) {
    case LOWER:
    case RNN:
    case FP32: {
      const int r = scan_all(self, args, total, &has_tensor, nullptr, false);
      if (r != 0) {
        return r < 0 ? nullptr : call_python(self, args, nargsf, kwnames);
      }
      if (!has_tensor) {
        return call_original(self, args, nargsf, kwnames);
      }
      const Cast cast = self->rule == FP32 ? to_cast(at::ScalarType::Float, kHalves)
                                           : Cast{true, self->half, 0};
      return map_call(self, args, nargsf, kwnames, 0, total, cast);
    }
    case PROMOTE: {
      unsigned dtypes = 0;
      const int r = scan_all(self, args, total, &has_tensor, &dtypes, false);
      if (r != 0) {
        return r < 0 ? nullptr : call_python(self, args, nargsf, kwnames);
      }
      if (popcount(dtypes) < 2) {
        return call_original(self, args, nargsf, kwnames);
      }
      const at::ScalarType to = widest(dtypes);
      return map_call(self, args, nargsf, kwnames, 0, total,
                      to_cast(to, kPromotable & ~bit(to)));
    }
    case SEQUENCE_PROMOTE: {
      if (nargs == 0) {
        return call_original(self, args, nargsf, kwnames);
      }
      const Kind k = classify(args[0]);
      if (k == K_ERROR) {
        return nullptr;
      }
      if (k == K_ODD) {
        return call_python(self, args, nargsf, kwnames);
      }
      if (k != K_SEQ) {
        return call_original(self, args, nargsf, kwnames);
      }
      unsigned dtypes = 0;
      // The items of the sequence only (a dict directly in it is not walked for dtypes by
      // the closure's exact-dict rule either; scan follows the same rule).
      const int r = scan(self, args[0], 0, &has_tensor, &dtypes, false);
      if (r != 0) {
        return r < 0 ? nullptr : call_python(self, args, nargsf, kwnames);
      }
      if (popcount(dtypes) < 2) {
        return call_original(self, args, nargsf, kwnames);
      }
      const at::ScalarType to = widest(dtypes);
      return map_call(self, args, nargsf, kwnames, 0, 1, to_cast(to, kPromotable & ~bit(to)));
    }
    case INPLACE_MATCH_SELF: {
      if (nargs == 0) {
        return call_original(self, args, nargsf, kwnames);
      }
      const Kind k = classify(args[0]);
      if (k == K_ERROR) {
        return nullptr;
      }
      if (k == K_ODD) {
        return call_python(self, args, nargsf, kwnames);
      }
      if (k != K_TENSOR) {
        return call_original(self, args, nargsf, kwnames);
      }
      const at::Tensor& target = THPVariable_Unpack(args[0]);
      const at::ScalarType to = target.scalar_type();
      if (bit(to) == 0) {
        return call_original(self, args, nargsf, kwnames);
      }
      const int e = eligible(self, target);
      if (e <= 0) {
        return e < 0 ? nullptr : call_original(self, args, nargsf, kwnames);
      }
      const int r = scan_all(self, args, total, &has_tensor, nullptr, false);
      if (r != 0) {
        return r < 0 ? nullptr : call_python(self, args, nargsf, kwnames);
      }
      return map_call(self, args, nargsf, kwnames, 0, total,
                      to_cast(to, kPromotable & ~bit(to)));
    }
    case INPLACE_FP32_ERROR: {
      if (nargs > 0) {
        const Kind k = classify(args[0]);
        if (k == K_ERROR) {
          return nullptr;
        }
        if (k == K_ODD) {
          return call_python(self, args, nargsf, kwnames);
        }
        if (k == K_TENSOR) {
          const at::Tensor& target = THPVariable_Unpack(args[0]);
          if (bit(target.scalar_type()) & kHalves) {
            const int e = eligible(self, target);
            if (e != 0) {  // the closure raises ampx's CastError (or e < 0: error)
              return e < 0 ? nullptr : call_python(self, args, nargsf, kwnames);
            }
          }
        }
      }
      const int r = scan_all(self, args, total, &has_tensor, nullptr, false);
      if (r != 0) {
        return r < 0 ? nullptr : call_python(self, args, nargsf, kwnames);
      }
      if (!has_tensor) {
        return call_original(self, args, nargsf, kwnames);
      }
      return map_call(self, args, nargsf, kwnames, 0, total,
                      to_cast(at::ScalarType::Float, kHalves));
    }
    case BANNED: {
      // An eligible half input: the closure raises CastError, or (allow_banned) casts.
      const int r = scan_all(self, args, total, &has_tensor, nullptr, true);
      if (r != 0) {
        return r < 0 ? nullptr : call_python(self, args, nargsf, kwnames);
      }
      return call_original(self, args, nargsf, kwnames);
    }
    case RNN_CHECK:
    default:
      // Once per RNN forward (not a hot path): the closure's stand-in input.
      return call_python(self, args, nargsf, kwnames);
  }
}

}  // namespace cast
}  // namespace ampx
