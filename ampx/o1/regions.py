"""`disable_casts()`: blocks with O1's casts off, in eager code and in compiled code.

Eager wrappers read a ContextVar (per thread and per asyncio task). Code that dynamo traces
reads a per-thread depth, which dynamo tracks and guards. Tensor methods and operators,
which dynamo runs opaquely while compiling, see a region of the compiled code through a
graph op that keeps a per-trace depth, and a region around the compiled call through a
guarded read of the per-thread depth.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
import threading
import weakref
from typing import Any

import torch
import torch._guards

__all__ = ["LOCAL", "StepScope", "call_outside_step", "casts_disabled", "disable_casts",
           "drop_ended_steps", "eager_depth_when_compiling", "end_step", "in_compiled_region",
           "run_region_frames_as_python", "start_step"]

# Eager code reads the ContextVar (per thread and per asyncio task). Compiled code cannot
# trace a ContextVar, so it reads a per-thread depth that dynamo guards (set in __init__ of a
# threading.local subclass: a class-level default would not be guarded).
# Its value is False, True (inside `disable_casts()`) or a `StepScope` (inside an optimizer
# step): wrappers only truth-test it, and a StepScope's truth is "that step is still running".
_CASTS_DISABLED: contextvars.ContextVar[object] = contextvars.ContextVar(
    "ampx_casts_disabled", default=False
)


_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class StepScope:
    """The casts-disabled value of a thread while one of its optimizer steps runs.

    Set by the step pre-hook (`start_step`) and put back by the post-hook (`end_step`). A step
    that raises (in the optimizer, in a user hook, a KeyboardInterrupt) skips torch's
    post-hooks, so the scope knows the frame that ran the hooks (torch's step wrapper) and
    is true only while that frame is on this thread's stack: the first wrapper that reads it
    after such a step finds it false, puts the value of before the step back and casts. Only
    wrappers called while the flag is set pay the walk (a few frames inside a step); outside
    steps the flag is False.
    """

    __slots__ = ("frame", "optimizer_id", "previous", "_below")

    def __init__(self, frame: Any, optimizer_id: int, previous: object) -> None:
        self.frame = frame
        self.optimizer_id = optimizer_id
        self.previous = previous
        # The last frame found running above the step's frame: while it runs, its callers
        # (the step's frame among them) cannot change, so a walk that meets it stops there.
        # An optimizer's update calls hundreds of wrapped ops from one frame: each read is
        # then one or two hops instead of a walk down to torch's step wrapper.
        self._below: Any = None

    def running(self, frame: Any) -> bool:
        """Whether the step's frame is still on this thread's stack, read from `frame`."""
        # `frame` reads the flag (the code that called a wrapper); its caller is cached once
        # the step's frame (or the cached frame) is found below it: while that caller runs,
        # its own callers cannot change. Not a generator's or coroutine's frame (it can
        # resume under another caller), and not when the walk found the step's frame at
        # `frame` itself (its caller is not above the step).
        first = frame.f_back
        below = self._below
        if first is not None and first is below:
            return True
        target = self.frame
        if frame is target or frame is below:
            return True
        frame = first
        while frame is not None:
            if frame is target or frame is below:
                if not first.f_code.co_flags & _RESUMABLE:
                    self._below = first
                return True
            frame = frame.f_back
        return False

    def __bool__(self) -> bool:
        if self.running(sys._getframe(1)):
            return True
        # The step ended without its post-hook: the value of before the step comes back.
        if _CASTS_DISABLED.get() is self:
            _CASTS_DISABLED.set(self.previous)
        return bool(self.previous)


def start_step(frame: Any, optimizer_id: int) -> None:
    """Casts off in this thread (only) until `end_step`, or until `frame` returns or unwinds."""
    _CASTS_DISABLED.set(StepScope(frame, optimizer_id, _CASTS_DISABLED.get()))


def end_step(frame: Any, optimizer_id: int) -> None:
    """Put back the value of before the matching `start_step` (with it go the scopes of inner
    steps that raised, stacked above it)."""
    value = _CASTS_DISABLED.get()
    while isinstance(value, StepScope):
        if value.frame is frame and value.optimizer_id == optimizer_id:
            _CASTS_DISABLED.set(value.previous)
            return
        value = value.previous


def call_outside_step(fn: Any) -> Any:
    """Call `fn()` with this thread's casts-disabled value of before its running steps.

    An optimizer's closure (forward and backward) is the user's code, run from inside the
    optimizer's `step`: its forward is cast as outside the step; only the optimizer's own
    math runs with casts off. The value is set in the ContextVar itself, which both the
    Python wrappers and the native one read, and put back however `fn` ends.
    """
    value = _CASTS_DISABLED.get()
    if not isinstance(value, StepScope):
        return fn()
    while isinstance(value, StepScope):
        value = value.previous
    token = _CASTS_DISABLED.set(value)
    try:
        return fn()
    finally:
        _CASTS_DISABLED.reset(token)


def drop_ended_steps() -> None:
    """Put back the value of before any step of this thread that raised (cheap when none)."""
    value = _CASTS_DISABLED.get()
    if isinstance(value, StepScope):
        bool(value)


class _Local(threading.local):
    def __init__(self) -> None:
        self.depth = 0


LOCAL = _Local()

# Tensor methods and operators are not inlined by dynamo: their wrappers run opaquely while
# compiling (dynamo's fake propagation, then AOT's retrace of its graph), where the traced
# depth above is not visible. So a region in compiled code also puts the op below in dynamo's
# graph, once on entry and once on exit. Both traces run it in graph order, and it keeps a
# depth per fake mode (one per trace), which the opaque wrappers read (`in_compiled_region`).
# The op is composite and decomposes to nothing, so AOT graphs (aot_eager, inductor) do not
# hold it; backend=eager runs dynamo's graph as Python, and there it sets the ContextVar.
_TRACE_DEPTH: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


class _Tokens(threading.local):
    def __init__(self) -> None:
        self.stack: list[contextvars.Token[object]] = []


_RUNTIME = _Tokens()


def _region(delta: int) -> None:
    # Composite: run where the op is called (traced or eager), leaving no op in any graph.
    if torch.compiler.is_compiling():  # a trace of dynamo's graph: keep its depth
        mode = torch._guards.detect_fake_mode()
        if mode is not None:
            _TRACE_DEPTH[mode] = _TRACE_DEPTH.get(mode, 0) + delta
    elif delta > 0:  # dynamo's graph run as Python (backend=eager): the eager region
        _RUNTIME.stack.append(_CASTS_DISABLED.set(True))
    elif _RUNTIME.stack:
        _CASTS_DISABLED.reset(_RUNTIME.stack.pop())


_LIBRARY = torch.library.Library("ampx", "DEF")
_LIBRARY.define("disable_casts_region(int delta) -> ()")
_LIBRARY.impl("disable_casts_region", _region, "CompositeImplicitAutograd")


def in_compiled_region() -> bool:
    """While compiling, in code run opaquely: inside a `disable_casts()` of the compiled code."""
    mode = torch._guards.detect_fake_mode()
    return mode is not None and _TRACE_DEPTH.get(mode, 0) > 0


def eager_depth_when_compiling() -> int:
    """This thread's region depth, read by code run opaquely while compiling.

    A `disable_casts()` entered around a compiled call is read that way by the Tensor-method
    wrappers; while dynamo traces, a guard on the depth makes it recompile the function
    when it is next called at another depth.
    """
    if torch._guards.TracingContext.try_get() is not None:
        from torch._dynamo.guards import GuardBuilder, install_guard
        from torch._dynamo.source import AttrSource, ImportSource

        regions = AttrSource(AttrSource(ImportSource("ampx"), "o1"), "regions")
        local = AttrSource(regions, "LOCAL")
        install_guard(AttrSource(local, "depth").make_guard(GuardBuilder.EQUALS_MATCH))
    return LOCAL.depth


def casts_disabled() -> bool:
    """True inside `disable_casts()` or an optimizer step, in the current thread / task (eager
    code)."""
    return bool(_CASTS_DISABLED.get())


class disable_casts:  # noqa: N801 - used like a function, as torch.no_grad
    """Run a block with O1's casts off (in this thread / task only).

    Nestable and exception-safe; a no-op at O0, O2 and O3 (there are no casts to disable).
    Also inside a function compiled with `torch.compile` (no graph break), where it covers
    functions, Tensor methods and operators alike; see docs/compile.md.

    Example::

        with ampx.disable_casts():
            out = my_custom_kernel(x.float())
    """

    def __init__(self) -> None:
        self._tokens: list[contextvars.Token[object]] = []

    def __enter__(self) -> None:
        if torch.compiler.is_compiling():
            torch.ops.ampx.disable_casts_region(1)
        else:
            self._tokens.append(_CASTS_DISABLED.set(True))
        LOCAL.depth += 1

    def __exit__(self, *exc: object) -> None:
        LOCAL.depth -= 1
        if torch.compiler.is_compiling():
            torch.ops.ampx.disable_casts_region(-1)
        else:
            _CASTS_DISABLED.reset(self._tokens.pop())


def run_region_frames_as_python() -> None:
    """Keep dynamo from compiling `disable_casts`'s own frames on their own (it still inlines
    them into the functions it traces).

    After a graph break inside a region, dynamo runs the rest of the function as Python and
    compiles the frames it calls one at a time. Compiled on its own, `__enter__` would lose
    its effect (dynamo drops writes to a threading.local's attributes); run as Python, it
    enters the eager region, which the frames compiled after it read (a guarded depth).
    """
    from torch._dynamo.eval_frame import skip_code

    for method in (disable_casts.__enter__, disable_casts.__exit__):
        skip_code(method.__code__)
