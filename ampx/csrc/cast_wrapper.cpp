// ampx._C.CastWrapper: O1's cast wrapper as a C-implemented callable (CPython vectorcall),
// the Python type: object layout, construction, GC, binding, and the per-call entry.
//
// One instance per patched torch function. It holds the original, the cast rule, the
// session's half dtype and device types, the session object (whose `live` it reads) and the
// Python closure of ampx/o1/wrappers.py, which is the reference: every call the native code
// cannot handle exactly as the closure would (while compiling, under a TorchFunctionMode, a
// tensor or container subclass or an fx Proxy among the arguments, an error to raise, the RNN
// input check) is handed to that closure unchanged, so results are always the closure's. The
// entry here makes the closure's checks (an explicit `out=`, which runs the original as
// written; then, in eager code, a running optimizer step, whose StepScope is tested here
// exactly as StepScope.running tests it, so the optimizer's update loop calls the original
// without any Python: the closure would call it whatever else it found; then in the
// closure's order session.live, compiling, the casts-disabled ContextVar that
// ampx/o1/regions.py sets, read with PyContextVar_Get and truth-tested like the closure
// does, a TorchFunctionMode), then hands the call to apply_rule in cast_rules.cpp, which
// walks the arguments and casts them.
//
// ampx/o1/wrappers.py subclasses the type in Python with a Python `__call__` (the closure),
// which dynamo inlines, then `_seal_cast_wrapper` puts this file's call slot back on that
// subclass, so eager calls never run Python bytecode on the fast path.
#include <torch/extension.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Dtype.h>

#include <structmember.h>

#include <string>

#include "cast_wrapper.h"

namespace ampx {
namespace cast {

Globals G;

namespace {

int truth(PyObject* v) {
  return v == Py_False ? 0 : v == Py_True ? 1 : PyObject_IsTrue(v);
}

// An explicit `out=` tensor (not None) among the keywords: the call runs as written, as
// under torch.autocast. Only calls with keywords pay for the test.
bool explicit_out(PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t n = PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, i);
    if ((name == G.str_out || PyUnicode_Compare(name, G.str_out) == 0) &&
        args[nargs + i] != Py_None) {
      return true;
    }
  }
  return false;
}

// The slot of a StepScope `scope` at `offset` (borrowed; nullptr when unset).
PyObject*& scope_slot(PyObject* scope, Py_ssize_t offset) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(scope) + offset);
}

// StepScope.running(frame), natively, for `frame` the Python code calling the wrapper (what
// StepScope.__bool__ reads as sys._getframe(1)): the same tests in the same order, the same
// walk down the callers, the same `_below` written. 1: the step runs (casts off), 0: its frame
// is gone (StepScope.__bool__ then puts the value of before the step back), -1: error.
int running(PyObject* scope) {
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  if (frame == nullptr) {
    return 0;
  }
  PyObject* target = scope_slot(scope, G.frame_offset);
  PyObject* below = scope_slot(scope, G.below_offset);
  PyFrameObject* first = PyFrame_GetBack(frame);  // new reference (or nullptr)
  if (first != nullptr && reinterpret_cast<PyObject*>(first) == below) {
    Py_DECREF(first);
    return 1;
  }
  PyObject* self_frame = reinterpret_cast<PyObject*>(frame);
  if (self_frame == target || (below != nullptr && self_frame == below)) {
    Py_XDECREF(first);
    return 1;
  }
  PyFrameObject* walk = first;
  Py_XINCREF(walk);
  while (walk != nullptr) {
    PyObject* w = reinterpret_cast<PyObject*>(walk);
    if (w == target || w == below) {
      Py_DECREF(walk);
      PyCodeObject* code = PyFrame_GetCode(first);  // new reference
      const bool resumable = (code->co_flags & G.resumable) != 0;
      Py_DECREF(code);
      if (!resumable) {
        PyObject*& slot = scope_slot(scope, G.below_offset);
        PyObject* old = slot;
        Py_INCREF(first);
        slot = reinterpret_cast<PyObject*>(first);
        Py_XDECREF(old);
      }
      Py_DECREF(first);
      return 1;
    }
    PyFrameObject* next = PyFrame_GetBack(walk);
    Py_DECREF(walk);
    walk = next;
  }
  Py_XDECREF(first);
  return 0;
}

// The casts-disabled value `value` is a step's scope whose step is running: casts are off,
// without StepScope.__bool__'s Python. (Its other answer, a step that ended without its
// post-hook, is left to __bool__, which also puts the value of before the step back.)
int in_step(PyObject* value) {
  return Py_TYPE(value) == G.step_scope ? running(value) : 0;
}

PyObject* cw_vectorcall(PyObject* op, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<CastWrapper*>(op);
  if (kwnames != nullptr && explicit_out(args, nargsf, kwnames)) {
    return call_original(self, args, nargsf, kwnames);
  }
  PyObject* flag = PyDict_GetItemWithError(G.compiler_dict, G.str_flag);  // borrowed
  if (flag == nullptr && PyErr_Occurred()) {
    return nullptr;
  }
  PyObject* value = nullptr;
  if (flag == Py_False) {
    // The optimizer's update loop first: inside a step the closure calls the original
    // whatever session.live says (casts are off either way), so its answer comes first.
    if (PyContextVar_Get(G.disabled, nullptr, &value) < 0) {
      return nullptr;
    }
    const int step = value == nullptr ? 0 : in_step(value);
    if (step != 0) {
      Py_DECREF(value);
      return step < 0 ? nullptr : call_original(self, args, nargsf, kwnames);
    }
  }
  // Otherwise the closure's order: session.live, then compiling(), then disabled().
  PyObject* live = PyObject_GetAttr(self->session, G.str_live);
  const int on = live == nullptr ? -1 : truth(live);
  Py_XDECREF(live);
  if (on <= 0) {
    Py_XDECREF(value);
    return on < 0 ? nullptr : call_original(self, args, nargsf, kwnames);
  }
  if (flag != Py_False) {
    return call_python(self, args, nargsf, kwnames);
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
  PyObject *original, *python, *session, *half, *devices, *counts, *table, *cached, *aliased;
  int rule, allow_banned;
  if (!PyArg_ParseTuple(args, "OOOiO!O!pOOOO:CastWrapper", &original, &python, &session, &rule,
                        &THPDtypeType, &half, &PyFrozenSet_Type, &devices, &allow_banned,
                        &counts, &table, &cached, &aliased)) {
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
  if ((rule == LOWER || rule == RNN) && (!PyDict_CheckExact(table) || !PyCallable_Check(cached) ||
                                         !PyDict_CheckExact(aliased))) {
    PyErr_SetString(PyExc_TypeError,
                    "ampx._C.CastWrapper: lower rules need the cache's table, cast and aliases");
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
  PyObject* fields[] = {original, python, session, counts, table, cached, aliased, devices};
  for (PyObject* f : fields) {
    Py_INCREF(f);
  }
  self->original = original;
  self->python = python;
  self->session = session;
  self->counts = counts;
  self->table = table;
  self->cached = cached;
  self->aliased = aliased;
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
  Py_VISIT(self->aliased);
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
  Py_CLEAR(self->aliased);
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

// The offset of a `__slots__` attribute of `type` (its member descriptor), or -1 (error set).
Py_ssize_t slot_offset(PyObject* type, const char* name) {
  PyObject* descr = PyObject_GetAttrString(type, name);
  if (descr == nullptr) {
    return -1;
  }
  Py_ssize_t offset = -1;
  if (Py_TYPE(descr) == &PyMemberDescr_Type) {
    PyMemberDef* def = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
    if (def->type == T_OBJECT_EX) {
      offset = def->offset;
    }
  }
  Py_DECREF(descr);
  if (offset < 0) {
    PyErr_Format(PyExc_TypeError, "_cast_wrapper_setup: %s is not a slot of the step scope",
                 name);
  }
  return offset;
}

PyObject* setup(PyObject* /*module*/, PyObject* args) {
  PyObject *tensor, *parameter, *size, *device, *layout, *memory_format, *compiler_dict,
      *disabled, *step_scope, *odd;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!OO!O!:_cast_wrapper_setup", &PyType_Type, &tensor,
                        &PyType_Type, &parameter, &PyType_Type, &size, &PyType_Type, &device,
                        &PyType_Type, &layout, &PyType_Type, &memory_format, &PyDict_Type,
                        &compiler_dict, &disabled, &PyType_Type, &step_scope, &PyTuple_Type,
                        &odd)) {
    return nullptr;
  }
  if (!PyContextVar_CheckExact(disabled)) {
    PyErr_SetString(PyExc_TypeError, "_cast_wrapper_setup: expected a ContextVar");
    return nullptr;
  }
  PyObject* keep[] = {tensor, parameter, size, device, layout, memory_format, compiler_dict,
                      disabled, step_scope};
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
  G.step_scope = reinterpret_cast<PyTypeObject*>(step_scope);
  if (G.containers == nullptr) {
    // Containers, then the types only the closure handles (fx's Proxy): both go there.
    PyObject* builtin = PyTuple_Pack(3, &PyList_Type, &PyTuple_Type, &PyDict_Type);
    G.containers = builtin == nullptr ? nullptr : PySequence_Concat(builtin, odd);
    Py_XDECREF(builtin);
    G.str_live = PyUnicode_InternFromString("live");
    G.str_flag = PyUnicode_InternFromString("_is_compiling_flag");
    G.str_out = PyUnicode_InternFromString("out");
    if (!G.containers || !G.str_live || !G.str_flag || !G.str_out) {
      return nullptr;
    }
  }
  G.frame_offset = slot_offset(step_scope, "frame");
  G.below_offset = slot_offset(step_scope, "_below");
  if (G.frame_offset < 0 || G.below_offset < 0) {
    return nullptr;
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
     "vars(torch.compiler), casts_disabled_var, StepScope, closure_types): the types and "
     "flags CastWrapper reads."},
    {"_seal_cast_wrapper", seal, METH_O,
     "_seal_cast_wrapper(cls): give a Python subclass of CastWrapper the C call slot."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace
}  // namespace cast

// Called from the module init in ampx.cpp.
void init_cast_wrapper(PyObject* module) {
  using namespace cast;
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
