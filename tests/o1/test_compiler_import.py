"""O1 imports no part of torch's compiler; imported later, the compiler sees torch's originals.

The orders that matter run in fresh processes (this test process imported dynamo long ago):
`torch.compile` after `initialize`, dynamo imported before `initialize`, dynamo imported by
another module after `initialize`. Each compiles an O1 model with eager O1's ops and dtypes
and no graph break, and finds dynamo's rule map and inductor's extern kernels holding the
originals. The pristine view itself (one thread reads originals, the others the wrappers)
is tested here, in process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ampx
from ampx.o1 import compiler, patch, pristine


@pytest.fixture(autouse=True)
def _no_view_left() -> Iterator[None]:
    """After each test here: no import hook, no view (module types and Tensor's dict plain).
    (conftest's pristine check compares torch's namespaces; this adds sys.meta_path.)"""
    meta_path = list(sys.meta_path)
    yield
    ampx.restore()
    assert sys.meta_path == meta_path
    assert not any(isinstance(f, pristine.ImportHook) for f in sys.meta_path)
    assert not pristine.view_open()
    assert type(torch) is type(sys) and type(torch.nn.functional) is type(sys)
    assert type(torch._VF) not in pristine._VIEWED_TYPES.values()
    assert not any(isinstance(v, pristine._View) for v in vars(torch.Tensor).values())


def _run(script: str, tmp_path: Path, timeout: int = 900) -> dict[str, str]:
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # no compile-worker pool
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)


def _compiler_modules() -> str:
    return 'sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))'


def test_o1_initialize_and_a_step_import_no_compiler(tmp_path: Path) -> None:
    """A fresh process: O1 initialize and one training step (a hand-written SGD update: torch's
    optimizers import dynamo themselves) load no dynamo or inductor module; the import hook
    is there during the session only."""
    out = _run(f"""
        import sys
        import torch
        from torch import nn
        import ampx
        from ampx.o1 import pristine
        layers = []
        for _ in range(10):
            layers += [nn.Linear(32, 32), nn.ReLU()]
        model = ampx.initialize(nn.Sequential(*layers), opt_level="O1", dtype="bf16",
                                verbosity=0)
        out = model(torch.randn(4, 32))
        out.float().pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        print("dtype", out.dtype)
        print("compiler", {_compiler_modules()})
        print("hook", sum(isinstance(f, pristine.ImportHook) for f in sys.meta_path))
        ampx.restore()
        print("hook_after", sum(isinstance(f, pristine.ImportHook) for f in sys.meta_path))
    """, tmp_path)
    assert out["dtype"] == "torch.bfloat16"
    assert out["compiler"] == "[]"
    assert (out["hook"], out["hook_after"]) == ("1", "0")


def test_o1_initialize_adds_no_compiler_module_to_torchs_own(tmp_path: Path) -> None:
    """A torch optimizer imports dynamo when constructed; O1's initialize then adds nothing."""
    out = _run(f"""
        import sys
        import torch
        from torch import nn
        import ampx
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        opt = torch.optim.AdamW(model.parameters())
        before = {_compiler_modules()}
        model, opt = ampx.initialize(model, opt, opt_level="O1", dtype="bf16", verbosity=0)
        print("dynamo_before", "torch._dynamo" in before)
        print("new", sorted(set({_compiler_modules()}) - set(before)))
    """, tmp_path)
    assert out["dynamo_before"] == "True"
    assert out["new"] == "[]"


# The check run in each order: eager O1's aten ops and dtypes, op by op, on backend=eager (the
# dynamo graph run under the recorder) and aot_eager (the forward graph's node dtypes); one
# graph, no break; inductor's output and dtype; the tables the compiler fills at import hold
# the originals; after restore, a plain model compiles in fp32.
_ORDERS = """
import collections, sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
import ampx
from ampx.o1 import patch, pristine

ORDER = {order!r}
if ORDER == "before":
    import torch._dynamo


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)

    def forward(self, x):
        y = self.b(self.norm(F.gelu(self.a(x))))
        return (y @ y.t()).softmax(-1), torch.mm(y, y.t())


IGNORED = {{"t", "view", "_unsafe_view", "transpose", "expand", "clone", "detach", "_to_copy",
           "alias", "lift_fresh", "empty", "copy"}}


def key(op, value):
    name = op._schema.name.split("::")[-1].removesuffix("_functional").rstrip("_")
    while isinstance(value, (tuple, list)) and value:
        value = value[0]
    if name in IGNORED or not isinstance(value, torch.Tensor):
        return None
    return name, value.dtype


class Recorder(TorchDispatchMode):
    def __init__(self, trace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {{}}))
        k = key(func, out)
        if k is not None:
            self.trace[k] += 1
        return out


def eager_backend(trace):
    def backend(gm, inputs):
        def run(*args):
            with Recorder(trace):
                return gm(*args)
        return run
    return backend


def aot_backend(trace):
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def forward(gm, inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                k = key(node.target, node.meta.get("val"))
                if k is not None:
                    trace[k] += 1
        return make_boxed_func(gm.forward)
    return aot_autograd(fw_compiler=forward)


model, x = Model(), torch.randn(4, 16)
ampx.initialize(nn.Linear(2, 2), opt_level="O1", dtype="bf16", verbosity=0)
print("compiler_at_initialize", "torch._dynamo" in sys.modules)
if ORDER == "other":
    sys.path.insert(0, ".")
    import other_library  # imports torch._dynamo
expected = collections.Counter()
with Recorder(expected):
    eager = model(x)
assert ("addmm", torch.bfloat16) in expected, expected
for name in ("eager", "aot_eager"):
    seen = collections.Counter()
    make = eager_backend if name == "eager" else aot_backend
    got = torch.compile(model, backend=make(seen), fullgraph=True)(x)
    print(name, dict(seen) == dict(expected), [t.dtype for t in got] == [t.dtype for t in eager])
explained = torch._dynamo.explain(model)(x)
print("graphs", explained.graph_count, explained.graph_break_count)
got = torch.compile(model, backend="inductor", fullgraph=True)(x)
print("inductor", [t.dtype for t in got] == [t.dtype for t in eager],
      all(torch.allclose(a, b, atol=2e-2, rtol=2e-2) for a, b in zip(got, eager)))
originals = patch.active().patches.originals()
session = {{id(vars(o)[n] if isinstance(o, type) else getattr(o, n)) for o, n, _ in originals}}
rules = sys.modules["torch._dynamo.trace_rules"].get_torch_obj_rule_map()
print("rule_map", sum(id(k) in session for k in rules),
      all(any(v is k for k in rules) for o, n, v in originals
          if o is torch.nn.functional and n in ("linear", "gelu", "layer_norm")))
from torch._inductor.select_algorithm import extern_kernels
torch_originals = {{n: v for o, n, v in originals if o is torch}}
print("extern", all(getattr(extern_kernels, n) is torch_originals[n]
                    for n in ("mm", "addmm", "bmm", "baddbmm")))
ampx.restore()
print("hooks", sum(isinstance(f, pristine.ImportHook) for f in sys.meta_path),
      type(torch) is type(sys), type(torch.nn.functional) is type(sys))
plain = torch.compile(model, backend="inductor", fullgraph=True)(x)
print("after", [t.dtype for t in plain] == [torch.float32] * 2,
      all(torch.allclose(a, b, atol=1e-5) for a, b in zip(plain, model(x))))
"""


@pytest.mark.parametrize("order", ["after", "before", "other"])
def test_compile_in_every_import_order(order: str, tmp_path: Path) -> None:
    """`torch.compile` after initialize, dynamo imported before initialize, dynamo imported
    by another module after initialize: the same compiled O1 in each."""
    (tmp_path / "other_library.py").write_text("import torch._dynamo\n")
    out = _run(_ORDERS.format(order=order), tmp_path)
    assert out["compiler_at_initialize"] == str(order == "before")
    assert out["eager"] == out["aot_eager"] == "True True"
    assert out["graphs"] == "1 0"
    assert out["inductor"] == "True True"
    assert out["rule_map"] == "0 True"  # no wrapper in dynamo's rule map, the originals are
    assert out["extern"] == "True"
    assert out["hooks"] == "0 True True"
    assert out["after"] == "True True"


_THREADS = """
import sys, threading
import torch
import torch.nn.functional as F
from torch import nn
import ampx
from ampx.o1 import patch, pristine

torch.set_num_threads(1)
ampx.initialize(nn.Linear(2, 2), opt_level="O1", dtype="bf16", verbosity=0)
installed = {(id(o), n): (vars(o)[n] if isinstance(o, type) else getattr(o, n))
             for o, n, _ in patch.active().patches.originals()}
x, w = torch.randn(4, 8), torch.randn(8, 8)
done = threading.Event()
results = []


def forwards():
    while not done.is_set():
        during = pristine.view_open()
        y = F.linear(x, w)
        z = x @ w
        s = y.softmax(-1)
        m = torch.mm(x, w)
        results.append((during, (y.dtype, z.dtype, s.dtype, m.dtype)))


def compile_once():
    try:
        out = torch.compile(lambda a, b: (F.linear(a, b), a @ b), backend="aot_eager",
                            fullgraph=True)(x, w)
        results.append(("compiled", tuple(t.dtype for t in out)))
    finally:
        done.set()


worker = threading.Thread(target=forwards)
worker.start()
compiler_thread = threading.Thread(target=compile_once)
compiler_thread.start()
compiler_thread.join()
worker.join()
casts = [r for d, r in results if d != "compiled"]
b, f = torch.bfloat16, torch.float32
print("forwards", len(casts), sum(d is True for d, _ in results))
print("all_cast", all(r == (b, b, f, b) for r in casts))
print("compiled", [r for d, r in results if d == "compiled"] == [(b, b)])
now = {(id(o), n): (vars(o)[n] if isinstance(o, type) else getattr(o, n))
       for o, n, _ in patch.active().patches.originals()}
print("wrappers_kept", now == installed and all(now[k] is installed[k] for k in now))
print("modules", type(torch) is type(sys),
      type(torch._VF) not in pristine._VIEWED_TYPES.values(), len(pristine._VIEWED_TYPES))
"""


def test_a_threads_first_compile_keeps_other_threads_cast(tmp_path: Path) -> None:
    """One thread's torch.compile imports the compiler while another runs O1 forwards: every
    forward is cast (during the import too), and afterwards every wrapper is in place."""
    out = _run(_THREADS, tmp_path)
    forwards, during = map(int, out["forwards"].split())
    assert during > 0, out  # forwards ran while the compiler imported
    assert out["all_cast"] == "True"
    assert out["compiled"] == "True"
    assert out["wrappers_kept"] == "True"
    assert out["modules"] == "True True 2"  # views were open (module and VFModule types)


# -- the pristine view, in process ------------------------------------------------------------

def _o1() -> patch.O1Patches:
    return patch.activate(patch.CastConfig(dtype=torch.bfloat16, device_types=frozenset({"cpu"})))


def test_the_view_shows_originals_to_its_thread_only() -> None:
    session = _o1()
    originals = {(id(o), n): v for o, n, v in session.patches.originals()}
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    wrapper_mm, wrapper_softmax = torch.mm, torch.Tensor.softmax
    entered, release, seen = threading.Event(), threading.Event(), {}

    def viewer() -> None:
        with pristine.pristine_view(compiler._originals):
            seen["mm"], seen["linear"] = torch.mm, F.linear
            seen["softmax"], seen["matmul"] = torch.Tensor.softmax, torch.Tensor.__matmul__
            seen["dtypes"] = (torch.mm(x, w).dtype, (x @ w).dtype, F.linear(x, w).dtype)
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=viewer)
    thread.start()
    assert entered.wait(30)
    try:
        assert pristine.view_open()
        # other threads: the wrappers, and their casts
        assert torch.mm is wrapper_mm and torch.Tensor.softmax is wrapper_softmax
        assert (torch.mm(x, w).dtype, (x @ w).dtype, F.linear(x, w).dtype) == (torch.bfloat16,) * 3
        assert torch.randn(3, 4).bfloat16().softmax(-1).dtype == torch.float32
    finally:
        release.set()
        thread.join()
    assert seen["mm"] is originals[id(torch), "mm"]
    assert seen["linear"] is originals[id(torch.nn.functional), "linear"]
    assert seen["softmax"] is torch._C.TensorBase.softmax
    assert seen["matmul"] is originals[id(torch.Tensor), "__matmul__"]
    assert seen["dtypes"] == (torch.float32,) * 3
    assert not pristine.view_open()
    assert type(torch) is type(sys) and torch.mm is wrapper_mm
    assert vars(torch.Tensor)["softmax"] is wrapper_softmax


def test_session_changes_wait_for_an_open_view() -> None:
    """restore() while another thread's view is open waits for it, then restores exactly."""
    _o1()
    entered, release = threading.Event(), threading.Event()

    def viewer() -> None:
        with pristine.pristine_view(compiler._originals):
            entered.set()
            release.wait(30)

    thread = threading.Thread(target=viewer)
    thread.start()
    assert entered.wait(30)
    restorer = threading.Thread(target=ampx.restore)
    restorer.start()
    time.sleep(0.2)
    waited = restorer.is_alive()
    release.set()
    thread.join()
    restorer.join(30)
    assert waited and not restorer.is_alive()
    assert patch.active() is None
    assert not any(isinstance(v, pristine._View) for v in vars(torch.Tensor).values())


def test_restore_leaves_no_hook_behind() -> None:
    def hooks() -> int:
        return sum(isinstance(f, pristine.ImportHook) for f in sys.meta_path)

    assert hooks() == 0
    _o1()
    _o1()  # a second session replaces the first: one hook
    assert hooks() == 1
    ampx.restore()
    assert hooks() == 0
    broken = patch.CastConfig(dtype=torch.bfloat16, device_types=frozenset({"cpu"}))

    class Boom(Exception):
        pass

    def fail(*args: object) -> None:
        raise Boom

    original = patch.O1Patches.install
    patch.O1Patches.install = fail  # type: ignore[method-assign]
    try:
        with pytest.raises(Boom):
            patch.activate(broken)
    finally:
        patch.O1Patches.install = original  # type: ignore[method-assign]
    assert hooks() == 0 and patch.active() is None


def test_a_module_of_the_compiler_runs_in_the_view(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook runs any module it is given for the compiler in the view: it captures the
    originals, while this thread sees the wrappers before and after."""
    package = tmp_path / "fake_compiler"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import torch\nimport torch.nn.functional as F\n"
        "CAPTURED = (torch.mm, F.linear, torch.Tensor.softmax)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(pristine, "_CAPTURING", (*pristine._CAPTURING, "fake_compiler"))
    session = _o1()
    originals = {(id(o), n): v for o, n, v in session.patches.originals()}
    try:
        import fake_compiler  # type: ignore[import-not-found]
    finally:
        sys.modules.pop("fake_compiler", None)
    mm, linear, softmax = fake_compiler.CAPTURED
    assert mm is originals[id(torch), "mm"] and mm is not torch.mm
    assert linear is originals[id(torch.nn.functional), "linear"]
    assert softmax is torch._C.TensorBase.softmax
    assert fake_compiler.__loader__.__class__.__name__ == "SourceFileLoader"
    assert fake_compiler.__spec__.loader is fake_compiler.__loader__
