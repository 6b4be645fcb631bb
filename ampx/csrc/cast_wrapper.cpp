// ampx._C.CastWrapper: O1's cast wrapper as a C-implemented callable (CPython vectorcall).
//
// One instance per patched torch function. It holds the original, the cast rule, the
// session's half dtype and device types, the session object (whose `live` it reads) and the
// Python closure of ampx/o1/wrappers.py, which is the reference: every call this code cannot
// handle exactly as the closure would (while compiling, under a TorchFunctionMode, a tensor
// or container subclass among the arguments, an error to raise, the RNN input check) is
// handed to that closure unchanged, so results are always the closure's. What it handles:
// tensors among the positional and keyword arguments and inside (exact) lists, tuples and
// dicts, walked as ampx.o1.casting.map_tensors walks them, the casts made by the same
// `Tensor.to` call as TensorBase.half/float (GIL released, as torch's binding does), and the
// weight-cast cache's hit path (same table, same validity test, same hit counter; a miss
// calls the cache's Python closure). The casts-disabled flag is the ContextVar that
// ampx/o1/regions.py sets, read with PyContextVar_Get and truth-tested like the closure does.
//
// ampx/o1/wrappers.py subclasses the type in Python with a Python `__call__` (the closure),
// which dynamo inlines, then `_seal_cast_wrapper` puts this file's call slot back on that
// subclass, so eager calls never run Python bytecode on the fast path.
#include <torch/extension.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <structmember.h>

#include <vector>

namespace ampx {
namespace {

// Same order as ampx.o1.wrappers._RULE_CODES.
enum Rule : int {
  LOWER = 0,
  FP32 = 1,
  PROMOTE = 2,
  SEQUENCE_PROMOTE = 3,
  BANNED = 4,
  INPLACE_MATCH_SELF = 5,
  INPLACE_FP32_ERROR = 6,
  RNN = 7,
  RNN_CHECK = 8,
};

// Set once by `_cast_wrapper_setup` (before any wrapper is made).
struct Globals {
  PyTypeObject* tensor = nullptr;
  PyTypeObject* parameter = nullptr;
  PyTypeObject* plain[5] = {};  // torch.Size, device, layout, memory_format, dtype
  PyObject* containers = nullptr;  // (list, tuple, dict)
  PyObject* compiler_dict = nullptr;  // vars(torch.compiler)
  PyObject* disabled = nullptr;  // ampx.o1.regions._CASTS_DISABLED
  PyObject* str_live = nullptr;
  PyObject* str_flag = nullptr;
};
Globals G;

constexpr int kMaxDepth = 16;
constexpr int kDeviceSlots = 64;

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

struct CastWrapper {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* original;
  PyObject* python;  // the reference closure (fallback)
  PyObject* session;  // reads `.live`
  PyObject* counts;  // the cache's [hits, misses] int64 array (WeightCastCache.counters())
  PyObject* table;  // the cache's table for the half dtype (id -> entry), or None
  PyObject* cached;  // the cache's bound Python cast (misses), or None
  PyObject* devices;  // frozenset of device type names
  Py_buffer counts_view;  // held: the array cannot be resized while it is exported
  long long* hits;  // counts[0]
  int rule;
  at::ScalarType half;
  at::ScalarType other_half;
  bool allow_banned;
  int8_t device_ok[kDeviceSlots];  // -1: not looked up yet
};

// What one cast does: the session's half dtype through the cache, or `to` for `froms`.
struct Cast {
  bool half;
  at::ScalarType to;
  unsigned froms;
};

bool transforms_active() {
  // torch._C._are_functorch_transforms_active()
  auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
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

// WeightCastCache.bind's closure: the hit path here, a miss (or anything unusual) there.
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
  return PyObject_CallOneArg(self->cached, o);
  END_HANDLE_TH_ERRORS
}

// ampx.o1.casters: Caster._make_half_cast's to_half, or dtype_cast's to_dtype.
PyObject* cast_tensor(CastWrapper* self, PyObject* o, const Cast& cast) {
  const at::Tensor& t = THPVariable_Unpack(o);
  if (cast.half) {
    const bool param = Py_TYPE(o) == G.parameter;
    if (param && !transforms_active()) {
      return cached_cast(self, o, t);
    }
    const at::ScalarType st = t.scalar_type();
    if (st != at::ScalarType::Float && st != self->other_half) {
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
    if ((param || (t.requires_grad() && t.is_leaf())) && !transforms_active()) {
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

PyObject* call_python(CastWrapper* self, PyObject* const* args, size_t nargsf,
                      PyObject* kwnames) {
  return PyObject_Vectorcall(self->python, args, nargsf, kwnames);
}

PyObject* call_original(CastWrapper* self, PyObject* const* args, size_t nargsf,
                        PyObject* kwnames) {
  return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
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

int truth(PyObject* v) {
  return v == Py_False ? 0 : v == Py_True ? 1 : PyObject_IsTrue(v);
}

PyObject* cw_vectorcall(PyObject* op, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<CastWrapper*>(op);
  // The closure's order: session.live, then compiling(), then disabled().
  PyObject* live = PyObject_GetAttr(self->session, G.str_live);
  if (live == nullptr) {
    return nullptr;
  }
  const int on = truth(live);
  Py_DECREF(live);
  if (on <= 0) {
    return on < 0 ? nullptr : call_original(self, args, nargsf, kwnames);
  }
  PyObject* flag = PyDict_GetItemWithError(G.compiler_dict, G.str_flag);  // borrowed
  if (flag != Py_False) {
    return flag == nullptr && PyErr_Occurred() ? nullptr
                                               : call_python(self, args, nargsf, kwnames);
  }
  PyObject* value = nullptr;
  if (PyContextVar_Get(G.disabled, nullptr, &value) < 0) {
    return nullptr;
  }
  const int off = value == nullptr ? 0 : truth(value);
  Py_XDECREF(value);
  if (off != 0) {
    return off < 0 ? nullptr : call_original(self, args, nargsf, kwnames);
  }
  if (at::impl::torch_function_mode_enabled()) {
    return call_python(self, args, nargsf, kwnames);  // the mode sees the closure's casts
  }
  return apply_rule(self, args, nargsf, kwnames);
}

PyObject* cw_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  if (G.tensor == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "ampx._C.CastWrapper: call _cast_wrapper_setup first");
    return nullptr;
  }
  PyObject *original, *python, *session, *half, *devices, *counts, *table, *cached;
  int rule, allow_banned;
  if (!PyArg_ParseTuple(args, "OOOiO!O!pOOO:CastWrapper", &original, &python, &session, &rule,
                        &THPDtypeType, &half, &PyFrozenSet_Type, &devices, &allow_banned,
                        &counts, &table, &cached)) {
    return nullptr;
  }
  if (rule < LOWER || rule > RNN_CHECK) {
    PyErr_Format(PyExc_ValueError, "ampx._C.CastWrapper: unknown rule %d", rule);
    return nullptr;
  }
  const at::ScalarType dtype = reinterpret_cast<THPDtype*>(half)->scalar_type;
  if (dtype != at::ScalarType::Half && dtype != at::ScalarType::BFloat16) {
    PyErr_SetString(PyExc_ValueError, "ampx._C.CastWrapper: the dtype must be a half dtype");
    return nullptr;
  }
  if ((rule == LOWER || rule == RNN) && (!PyDict_CheckExact(table) || !PyCallable_Check(cached))) {
    PyErr_SetString(PyExc_TypeError,
                    "ampx._C.CastWrapper: lower rules need the cache's table and cast");
    return nullptr;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(counts, &view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
    return nullptr;
  }
  if (view.itemsize != sizeof(long long) || view.len < 2 * view.itemsize || !view.format ||
      std::string(view.format) != "q") {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_TypeError, "ampx._C.CastWrapper: counts must be array('q', [h, m])");
    return nullptr;
  }
  auto* self = reinterpret_cast<CastWrapper*>(type->tp_alloc(type, 0));
  if (self == nullptr) {
    PyBuffer_Release(&view);
    return nullptr;
  }
  self->counts_view = view;
  self->hits = static_cast<long long*>(view.buf);
  self->vectorcall = cw_vectorcall;
  PyObject* fields[] = {original, python, session, counts, table, cached, devices};
  for (PyObject* f : fields) {
    Py_INCREF(f);
  }
  self->original = original;
  self->python = python;
  self->session = session;
  self->counts = counts;
  self->table = table;
  self->cached = cached;
  self->devices = devices;
  self->rule = rule;
  self->half = dtype;
  self->other_half =
      dtype == at::ScalarType::Half ? at::ScalarType::BFloat16 : at::ScalarType::Half;
  self->allow_banned = allow_banned != 0;
  for (auto& ok : self->device_ok) {
    ok = -1;
  }
  return reinterpret_cast<PyObject*>(self);
}

int cw_traverse(PyObject* op, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<CastWrapper*>(op);
  Py_VISIT(self->original);
  Py_VISIT(self->python);
  Py_VISIT(self->session);
  Py_VISIT(self->counts);
  Py_VISIT(self->table);
  Py_VISIT(self->cached);
  Py_VISIT(self->devices);
  return 0;
}

int cw_clear(PyObject* op) {
  auto* self = reinterpret_cast<CastWrapper*>(op);
  Py_CLEAR(self->original);
  Py_CLEAR(self->python);
  Py_CLEAR(self->session);
  Py_CLEAR(self->counts);
  Py_CLEAR(self->table);
  Py_CLEAR(self->cached);
  Py_CLEAR(self->devices);
  return 0;
}

void cw_dealloc(PyObject* op) {
  PyObject_GC_UnTrack(op);
  auto* self = reinterpret_cast<CastWrapper*>(op);
  if (self->counts_view.obj != nullptr) {
    PyBuffer_Release(&self->counts_view);  // before the array reference goes
  }
  cw_clear(op);
  Py_TYPE(op)->tp_free(op);
}

// A function's binding: the wrapper is set on classes (Tensor methods, RNNBase.check_input).
PyObject* cw_descr_get(PyObject* self, PyObject* obj, PyObject* /*type*/) {
  if (obj == nullptr || obj == Py_None) {
    Py_INCREF(self);
    return self;
  }
  return PyMethod_New(self, obj);
}

PyMemberDef cw_members[] = {
    {"_ampx_original", T_OBJECT, offsetof(CastWrapper, original), READONLY,
     "The wrapped function."},
    {"_ampx_rule", T_INT, offsetof(CastWrapper, rule), READONLY, "The rule's code."},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject CastWrapperType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* setup(PyObject* /*module*/, PyObject* args) {
  PyObject *tensor, *parameter, *size, *device, *layout, *memory_format, *compiler_dict,
      *disabled;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O:_cast_wrapper_setup", &PyType_Type, &tensor,
                        &PyType_Type, &parameter, &PyType_Type, &size, &PyType_Type, &device,
                        &PyType_Type, &layout, &PyType_Type, &memory_format, &PyDict_Type,
                        &compiler_dict, &disabled)) {
    return nullptr;
  }
  if (!PyContextVar_CheckExact(disabled)) {
    PyErr_SetString(PyExc_TypeError, "_cast_wrapper_setup: expected a ContextVar");
    return nullptr;
  }
  PyObject* keep[] = {tensor, parameter, size, device, layout, memory_format, compiler_dict,
                      disabled};
  for (PyObject* k : keep) {
    Py_INCREF(k);  // held for the life of the process
  }
  G.tensor = reinterpret_cast<PyTypeObject*>(tensor);
  G.parameter = reinterpret_cast<PyTypeObject*>(parameter);
  G.plain[0] = reinterpret_cast<PyTypeObject*>(size);
  G.plain[1] = reinterpret_cast<PyTypeObject*>(device);
  G.plain[2] = reinterpret_cast<PyTypeObject*>(layout);
  G.plain[3] = reinterpret_cast<PyTypeObject*>(memory_format);
  G.plain[4] = &THPDtypeType;
  G.compiler_dict = compiler_dict;
  G.disabled = disabled;
  if (G.containers == nullptr) {
    G.containers = PyTuple_Pack(3, &PyList_Type, &PyTuple_Type, &PyDict_Type);
    G.str_live = PyUnicode_InternFromString("live");
    G.str_flag = PyUnicode_InternFromString("_is_compiling_flag");
    if (!G.containers || !G.str_live || !G.str_flag) {
      return nullptr;
    }
  }
  Py_RETURN_NONE;
}

// Gives a Python subclass (whose Python __call__ dynamo inlines) this type's C call slot
// and a function's binding for eager calls.
PyObject* seal(PyObject* /*module*/, PyObject* arg) {
  if (!PyType_Check(arg) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(arg), &CastWrapperType) ||
      !(reinterpret_cast<PyTypeObject*>(arg)->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
    PyErr_SetString(PyExc_TypeError, "_seal_cast_wrapper: expected a subclass of CastWrapper");
    return nullptr;
  }
  auto* tp = reinterpret_cast<PyTypeObject*>(arg);
  tp->tp_call = PyVectorcall_Call;
  tp->tp_vectorcall_offset = offsetof(CastWrapper, vectorcall);
  tp->tp_descr_get = cw_descr_get;
  tp->tp_flags |= Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR;
  PyType_Modified(tp);
  Py_RETURN_NONE;
}

PyMethodDef functions[] = {
    {"_cast_wrapper_setup", setup, METH_VARARGS,
     "_cast_wrapper_setup(Tensor, Parameter, Size, device, layout, memory_format, "
     "vars(torch.compiler), casts_disabled_var): the types and flags CastWrapper reads."},
    {"_seal_cast_wrapper", seal, METH_O,
     "_seal_cast_wrapper(cls): give a Python subclass of CastWrapper the C call slot."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// Called from the module init in ampx.cpp.
void init_cast_wrapper(PyObject* module) {
  CastWrapperType.tp_name = "ampx._C.CastWrapper";
  CastWrapperType.tp_basicsize = sizeof(CastWrapper);
  CastWrapperType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC |
                             Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR;
  CastWrapperType.tp_doc = "O1's native cast wrapper (see ampx/csrc/cast_wrapper.cpp).";
  CastWrapperType.tp_new = cw_new;
  CastWrapperType.tp_dealloc = cw_dealloc;
  CastWrapperType.tp_traverse = cw_traverse;
  CastWrapperType.tp_clear = cw_clear;
  CastWrapperType.tp_call = PyVectorcall_Call;
  CastWrapperType.tp_vectorcall_offset = offsetof(CastWrapper, vectorcall);
  CastWrapperType.tp_descr_get = cw_descr_get;
  CastWrapperType.tp_members = cw_members;
  if (PyType_Ready(&CastWrapperType) < 0) {
    throw pybind11::error_already_set();
  }
  Py_INCREF(&CastWrapperType);
  if (PyModule_AddObject(module, "CastWrapper", reinterpret_cast<PyObject*>(&CastWrapperType)) <
          0 ||
      PyModule_AddFunctions(module, functions) < 0) {
    throw pybind11::error_already_set();
  }
}

}  // namespace ampx
