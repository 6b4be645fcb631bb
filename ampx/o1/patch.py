"""O1 installation: an exactly-undoable patch set, activate/deactivate, user registrations.

The torch namespace is the one process-global thing ampx touches. Every replacement goes
through a `PatchSet`, which remembers whether the attribute was the owner's own or inherited,
so `restore()` puts back the very same objects (or deletes what was inherited). At most one
set of O1 patches is active per process (`activate` replaces the previous one cleanly); the
active set and the user registrations are the patch registry's (`registry.py`). The cast
rules live in `casters.py`, the wrapper closures in `wrappers.py`, what a session does to
torch's compiler in `compiler.py`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

import torch

from . import compiler
from .casters import CastConfig, Caster, CastError, casts_disabled, disable_casts
from .casting import WeightCastCache
from .lists import CastRule, ListEntry, owner_object, resolve
from .registry import PATCHES
from .wrappers import decorator_wrapper, make_native, make_wrapper, native_class

__all__ = [
    "CastConfig",
    "CastError",
    "O1Patches",
    "PatchSet",
    "Registration",
    "activate",
    "active",
    "casts_enabled",
    "clear_cache",
    "deactivate",
    "disable_casts",
    "float_function",
    "forward_ends",
    "forward_starts",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]

logger = logging.getLogger("ampx")

_MISSING = object()
F = TypeVar("F", bound=Callable[..., Any])


def casts_enabled() -> bool:
    """True when O1 patches are active and not disabled in the current context."""
    return PATCHES.active is not None and not casts_disabled()


def _raw_attribute(owner: Any, name: str) -> Any:
    """`owner.name` as stored: the descriptor found on the class's MRO, or getattr's value.

    A class attribute comes back as the first class of the MRO that defines it stores it (so a
    `staticmethod` stays one and an inherited method is found on its base), anything else
    through `getattr` (wrapt's rule for its monkey patches, `wrapt.resolve_path`, which ampx
    no longer imports: wrapt's 15 modules were a fifth of what `initialize` loaded).

    Raises:
        AttributeError: `owner` has no attribute `name`.
    """
    if isinstance(owner, type):
        for cls in owner.__mro__:
            stored = vars(cls)
            if name in stored:
                return stored[name]
    return getattr(owner, name)


class PatchSet:
    """Attribute replacements that can be undone exactly.

    Each `apply` records whether the owner held the attribute itself (then the very same
    object is put back) or inherited it (then the override is deleted). Applying the same
    attribute twice keeps the first original, so wrappers never stack. A replacement is
    recorded only once `setattr` has succeeded.
    """

    def __init__(self) -> None:
        # (id(owner), name) -> (owner, name, own value or _MISSING, raw original)
        self._records: dict[tuple[int, str], tuple[Any, str, Any, Any]] = {}
        self._originals: list[tuple[Any, str, Any]] | None = None  # built by `originals`

    def __len__(self) -> int:
        return len(self._records)

    def originals(self) -> list[tuple[Any, str, Any]]:
        """(owner, name, value) that puts each replaced attribute's original back by `setattr`.

        An inherited original is the raw attribute itself (set on the owner, not deleted).
        Built once and kept until the set changes.
        """
        if self._originals is None:
            self._originals = [(owner, name, raw if own is _MISSING else own)
                               for owner, name, own, raw in self._records.values()]
        return self._originals

    def original(self, owner: Any, name: str) -> Any:
        """The raw attribute as it was before this set first replaced it."""
        record = self._records.get((id(owner), name))
        return _raw_attribute(owner, name) if record is None else record[3]

    def apply(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace `owner.name` with `replacement`, remembering what to put back."""
        key = (id(owner), name)
        record = self._records.get(key)
        if record is None:
            record = (owner, name, vars(owner).get(name, _MISSING), _raw_attribute(owner, name))
        setattr(owner, name, replacement)
        self._records[key] = record
        self._originals = None

    def restore_one(self, owner: Any, name: str) -> None:
        """Put back one replaced attribute (nothing happens if it was not replaced)."""
        record = self._records.pop((id(owner), name), None)
        self._originals = None
        if record is not None:
            _put_back(record)

    def restore(self) -> None:
        """Put every replaced attribute back, newest first."""
        errors = []
        for record in reversed(list(self._records.values())):
            try:
                _put_back(record)
            except Exception as exc:  # keep restoring the rest, then report
                errors.append(f"{_owner_label(record[0])}.{record[1]}: {exc}")
        self._records.clear()
        self._originals = None
        if errors:
            raise RuntimeError("ampx.restore: could not restore " + "; ".join(errors))


def _put_back(record: tuple[Any, str, Any, Any]) -> None:
    owner, name, own, _ = record
    if own is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, own)


class O1Patches:
    """One installation of the O1 patches: the lists plus the user registrations.

    Attributes:
        live: True while installed; every wrapper of this installation reads it and passes
            straight through once it is False.
        native: Whether the wrappers are the extension's C callables (each around its
            Python closure) rather than the closures themselves.
    """

    def __init__(self, config: CastConfig, native: bool | None = None) -> None:
        self.config = config
        # The C wrappers when the extension has them (not for verbose sessions, whose cast
        # log is the closures'); `native=False` forces the closures.
        available = native_class() is not None and not config.verbose
        if native and not available:
            raise RuntimeError("ampx: the native O1 wrappers need the built extension "
                               f"({_ext_reason()}) and a non-verbose session")
        self.native = available if native is None else bool(native)
        self.caster = Caster(config)
        self.patches = PatchSet()
        self.live = False
        self._listed: dict[tuple[int, str], ListEntry] = {}

    @property
    def cache(self) -> WeightCastCache:
        """The weight-cast cache of this installation."""
        return self.caster.cache

    def _patch(self, owner: Any, name: str, policy: CastRule, label: str) -> None:
        raw = self.patches.original(owner, name)
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        original = raw.__func__ if kind else raw
        wrapper = make_wrapper(original, policy, label, self.caster, self)
        if self.native:
            wrapper = make_native(wrapper, original, policy, self.caster, self) or wrapper
        self.patches.apply(owner, name, kind(wrapper) if kind else wrapper)

    def install(self, entries: list[ListEntry]) -> None:
        """Apply every list entry, then every user registration; all or nothing.

        A registration of a name that a list already patched replaces that patch (it
        wraps the original, never the list's wrapper).
        """
        self.live = True
        try:
            self.patches.apply(torch.Tensor, "data", _data_property(self))
            for entry in entries:
                owner = owner_object(entry.owner)
                self._listed[(id(owner), entry.name)] = entry
                self._patch(owner, entry.name, entry.policy, f"{entry.owner}.{entry.name}")
            for owner, name, policy in list(PATCHES.user.values()):
                self._patch(owner, name, policy, f"{_owner_label(owner)}.{name}")
        except BaseException:
            self.uninstall()
            raise

    def register(self, owner: Any, name: str, policy: CastRule) -> None:
        """Patch one more function now (a registration made after initialize)."""
        self._patch(owner, name, policy, f"{_owner_label(owner)}.{name}")

    def unregister(self, owner: Any, name: str) -> None:
        """Undo a registration: back to the list's wrapper, or to the original."""
        entry = self._listed.get((id(owner), name))
        if entry is not None:
            self._patch(owner, name, entry.policy, f"{entry.owner}.{name}")
        else:
            self.patches.restore_one(owner, name)

    def uninstall(self) -> None:
        """Turn every wrapper into a pass-through, restore the attributes, drop the cache."""
        self.live = False
        self.caster.cache.clear()
        self.patches.restore()


def _data_property(session: O1Patches) -> property:
    """`Tensor.data` that tells the weight cache about each alias it hands out.

    A `.data` alias shares storage with its tensor but has a version counter of its own, so
    `param.data.mul_(0.5)` would otherwise leave a stale cast in the cache.
    """
    descriptor: Any = torch._C.TensorBase.data
    get, put = descriptor.__get__, descriptor.__set__
    note = session.caster.cache.note_data_access

    def data_get(self: torch.Tensor) -> torch.Tensor:
        alias = get(self, type(self))
        if session.live:
            note(self, alias)
        return alias

    def data_set(self: torch.Tensor, value: torch.Tensor) -> None:
        put(self, value)
        if session.live:  # `value` (and what it views) now alias `self` too
            note(self, value if isinstance(value, torch.Tensor) else None)

    return property(data_get, data_set, doc=descriptor.__doc__)


def active() -> O1Patches | None:
    """The installed O1 patches, or None."""
    return PATCHES.active


def activate(config: CastConfig, native: bool | None = None) -> O1Patches:
    """Install the O1 patches for `config`, replacing any previous installation cleanly.

    All or nothing: if installing fails, the previous installation (if any) is put back and
    torch's namespaces are as they were before the call. `native` picks the wrappers: the
    extension's C callables (True), the Python closures (False), or the C ones when the
    extension has them (None, the default).
    """
    compiler.prepare()
    try:
        with compiler.changing_patches():  # no compiler import runs its view meanwhile
            return _activate(config, native)
    finally:
        compiler.unwatch()  # when no session is left (the install failed)


def _activate(config: CastConfig, native: bool | None) -> O1Patches:
    previous = PATCHES.active
    _deactivate()
    patches = O1Patches(config, native)
    try:
        patches.install(resolve())
    except BaseException:
        patches.uninstall()  # whatever was applied before the failure
        if previous is not None:
            previous.install(resolve())
            PATCHES.active = previous
            compiler.hold_autograd_cache(True)
        raise
    finally:
        compiler.reset_compiled()
    PATCHES.active = patches
    compiler.hold_autograd_cache(True)
    logger.debug("ampx: installed %d O1 patches (%s)", len(patches.patches), config.dtype)
    return patches


def deactivate() -> None:
    """Remove the O1 patches, if any, restoring torch's original objects."""
    try:
        with compiler.changing_patches():
            _deactivate()
    finally:
        compiler.unwatch()


def _deactivate() -> None:
    if PATCHES.active is not None:
        patches, PATCHES.active = PATCHES.active, None
        try:
            patches.uninstall()
        finally:
            compiler.drop_rules_built_during_session()
            compiler.hold_autograd_cache(False)
            compiler.reset_compiled()


def clear_cache() -> None:
    """Forget the cast weights (called when an iteration ends)."""
    active = PATCHES.active
    if active is not None:
        active.caster.cache.clear()


# The weight-cast cache's lifetime (the two hooks `ampx.model.cast_model` puts on each model
# of an O1 session): one forward of the model, plus its backward. A write the version counter
# cannot see (numpy, dlpack, storage copies, `set_` onto the storage, another process through
# shared memory, a tensor given to `param.data`) is then never served across forwards, as
# autocast's cache lives one region. Module-level functions: a deep copy or a pickle of the
# model keeps them, and they reach whichever session is active when they run.

def forward_starts(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook: the forward starts with no cast weights (casts made since the last
    forward or `scale_loss` may be stale)."""
    active = PATCHES.active
    if active is not None and not torch.compiler.is_compiling():
        active.caster.cache.clear()


def forward_ends(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook (also on an exception): a forward without autograd (no_grad, inference)
    has no backward to share its casts with, so they go now; a training forward's stay for
    its backward until `scale_loss` (or the next forward)."""
    active = PATCHES.active
    if active is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        active.caster.cache.clear()


def _ext_reason() -> str:
    from .. import _ext

    return _ext.IMPORT_ERROR or "its CastWrapper is missing"


def _owner_label(owner: Any) -> str:
    return getattr(owner, "__name__", type(owner).__name__)


# -- user registrations -----------------------------------------------------------------------

class Registration:
    """What `register_*_function` returns: `remove()` undoes that registration.

    Removing restores the function at once when O1 is active (to the cast list's wrapper if
    the name is also listed, else to the original) and keeps later sessions from patching
    it. It does nothing when the registration was already removed or replaced by a newer
    registration of the same name.
    """

    __slots__ = ("_record",)

    def __init__(self, record: tuple[Any, str, CastRule]) -> None:
        self._record = record

    def __repr__(self) -> str:
        owner, name, policy = self._record
        return f"<ampx.Registration {_owner_label(owner)}.{name}: {policy.value}>"

    def remove(self) -> None:
        """Undo the registration (idempotent)."""
        owner, name, _ = self._record
        key = (id(owner), name)
        if PATCHES.user.get(key) is not self._record:
            return
        with compiler.changing_patches():
            if PATCHES.active is not None:
                PATCHES.active.unregister(owner, name)
        del PATCHES.user[key]


def _register(api: str, module: Any, name: str, policy: CastRule) -> Registration:
    if not isinstance(name, str):
        raise TypeError(f"ampx.{api}: name must be a str, got {type(name).__name__}")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")  # apex's message
    label = f"{_owner_label(module)}.{name}"
    raw = _raw_attribute(module, name)
    if not callable(raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw):
        raise TypeError(f"ampx.{api}: {label} is not a function (got {type(raw).__name__})")
    probe = PatchSet()  # can the attribute be replaced at all? (int.__add__ cannot)
    try:
        probe.apply(module, name, raw)
    except (TypeError, AttributeError) as exc:
        raise TypeError(
            f"ampx.{api}: cannot patch {label}: {exc}. Built-in and extension types can't "
            "be patched; register a function of a module or a method of a Python class."
        ) from None
    finally:
        probe.restore()
    record = (module, name, policy)
    with compiler.changing_patches():
        if PATCHES.active is not None:
            PATCHES.active.register(module, name, policy)
    PATCHES.user[(id(module), name)] = record
    return Registration(record)


def register_half_function(module: Any, name: str) -> Registration:
    """Run `module.name` in the session's half dtype under O1.

    Works before or after `initialize` (apex required before), survives re-initialize, and
    replaces a built-in list entry of the same name (no double wrapping).

    Args:
        module: The object holding the function (a module or a Python class).
        name: The attribute name.

    Returns:
        A `Registration`; its `remove()` undoes the registration.

    Raises:
        ValueError: If `module` has no attribute `name`.
        TypeError: If the attribute is not a function or cannot be replaced (a method of a
            built-in type such as `int`).
    """
    return _register("register_half_function", module, name, CastRule.LOWER)


def register_float_function(module: Any, name: str) -> Registration:
    """Run `module.name` in float32 under O1 (see `register_half_function`)."""
    return _register("register_float_function", module, name, CastRule.FP32)


def register_promote_function(module: Any, name: str) -> Registration:
    """Cast mixed inputs of `module.name` to the widest type under O1."""
    return _register("register_promote_function", module, name, CastRule.PROMOTE)


def _current_caster() -> Caster | None:
    return None if PATCHES.active is None else PATCHES.active.caster


def _decorator(policy: CastRule) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        # above @staticmethod/@classmethod: wrap the function inside and rebuild the
        # descriptor (apex wrapped the descriptor object itself: a TypeError when called).
        # A plain closure, not a wrapt proxy: dynamo traces through it (and its cast), where
        # it takes a proxy for the function it reports and traces the original, uncast.
        if isinstance(fn, (staticmethod, classmethod)):
            return type(fn)(decorate(fn.__func__))
        return decorator_wrapper(fn, policy, _current_caster)  # type: ignore[return-value]

    return decorate


half_function = _decorator(CastRule.LOWER)
half_function.__doc__ = "Decorator: run the function in half precision while O1 is active."
float_function = _decorator(CastRule.FP32)
float_function.__doc__ = "Decorator: run the function in float32 while O1 is active."
promote_function = _decorator(CastRule.PROMOTE)
promote_function.__doc__ = "Decorator: promote mixed inputs to the widest type while O1 is active."
