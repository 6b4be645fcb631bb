// ampx._C.CastWrapper's shared declarations: the object layout, the rule codes and the
// process-wide globals, used by the Python type (cast_wrapper.cpp) and by the argument side
// that classifies, plans and casts a call's arguments (cast_rules.cpp).
#pragma once

#include <Python.h>

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ampx {
namespace cast {

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
  PyObject* containers = nullptr;  // (list, tuple, dict, *closure_types): isinstance -> closure
  PyObject* compiler_dict = nullptr;  // vars(torch.compiler)
  PyObject* disabled = nullptr;  // ampx.o1.regions._CASTS_DISABLED
  PyTypeObject* step_scope = nullptr;  // ampx.o1.regions.StepScope (its value during a step)
  PyObject* str_live = nullptr;
  PyObject* str_flag = nullptr;
  PyObject* str_out = nullptr;
  Py_ssize_t frame_offset = -1;  // StepScope's `frame` and `_below` slots
  Py_ssize_t below_offset = -1;
  int resumable = CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR;  // regions._RESUMABLE
};
extern Globals G;  // defined in cast_wrapper.cpp

constexpr int kDeviceSlots = 64;

struct CastWrapper {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* original;
  PyObject* python;  // the reference closure (fallback)
  PyObject* session;  // reads `.live`
  PyObject* counts;  // the cache's [hits, misses] int64 array (WeightCastCache.counters())
  PyObject* table;  // the cache's table for the half dtype (id -> entry), or None
  PyObject* cached;  // the cache's bound Python cast (the reference of a miss), or None
  PyObject* aliased;  // the cache's id -> live `.data` aliases (kept out of the table), or None
  PyObject* devices;  // frozenset of device type names
  Py_buffer counts_view;  // held: the array cannot be resized while it is exported
  long long* hits;  // counts[0]
  int rule;
  at::ScalarType half;
  at::ScalarType other_half;
  bool allow_banned;
  int8_t device_ok[kDeviceSlots];  // -1: not looked up yet
};

inline PyObject* call_python(CastWrapper* self, PyObject* const* args, size_t nargsf,
                             PyObject* kwnames) {
  return PyObject_Vectorcall(self->python, args, nargsf, kwnames);
}

inline PyObject* call_original(CastWrapper* self, PyObject* const* args, size_t nargsf,
                               PyObject* kwnames) {
  return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

// The rule, with casts on in this thread (the closure's eager branch); cast_rules.cpp.
PyObject* apply_rule(CastWrapper* self, PyObject* const* args, size_t nargsf,
                     PyObject* kwnames);

}  // namespace cast
}  // namespace ampx
