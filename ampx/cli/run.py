"""`ampx run`: execute a training script as `__main__` under ampx.

One job: set up the process the way `python script.py` would (argv, `sys.path[0]`, `__main__`),
plus what ampx adds for the run — the apex alias, forced `amp.initialize` options, telemetry,
a step limit, ampx's log handler — and take all of it down again afterwards, whatever the
script did. Child Python processes the script starts (DataLoader spawn workers,
`torch.multiprocessing.spawn`) get the alias and the forced options through a `sitecustomize`
in a temporary directory put first on their PYTHONPATH (see `ampx/cli/_child_site.py`); nothing
outside the run's process tree sees it. The script's exit status becomes the run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import runpy
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

__all__ = ["CHILD_ENV", "RunRequest", "StepLimitReached", "apply_child_config", "run"]

logger = logging.getLogger("ampx")

CHILD_ENV = "AMPX_RUN_CHILD"
"""Environment variable carrying the run's options to child processes (JSON)."""

_CHILD_SITE = Path(__file__).resolve().parent / "_child_site.py"


class StepLimitReached(SystemExit):
    """Raised inside `optimizer.step()` by `ampx run --max-steps` to end the script (code 0)."""


@dataclasses.dataclass
class RunRequest:
    """What to run and how.

    Attributes:
        script: Path of the script, or a module name when `module` is True.
        script_args: The script's own arguments.
        module: Run `script` as `python -m` would.
        forced: Options forced on every `amp.initialize`: `ForcedOptions` parsed by the
            command line (a plain mapping is parsed here; see `frontend.set_forced_options`).
        telemetry_file: Where to write per-step telemetry, or None.
        max_steps: End the script (status 0) after this many optimizer steps, or None.
        apex_alias: Provide `apex.amp` (when no real apex is importable, or always with
            `force_apex_alias`).
        force_apex_alias: Shadow a real apex.
        quiet: Only warnings from ampx.
    """

    script: str
    script_args: list[str]
    module: bool = False
    forced: Any = None  # ForcedOptions (not imported here: it imports torch)
    telemetry_file: Optional[str] = None
    max_steps: Optional[int] = None
    apex_alias: bool = True
    force_apex_alias: bool = False
    quiet: bool = False
    numerics_dir: Optional[str] = None  # --numerics: where the report is written at the end

    def __post_init__(self) -> None:
        from ..options.forced import ForcedOptions

        if not isinstance(self.forced, ForcedOptions):
            self.forced = ForcedOptions.parse(self.forced)


def run(request: RunRequest) -> int:
    """Run the script and return its exit status (1 for an uncaught exception, 130 for ^C).

    Everything the run changed in this process (argv, sys.path[0], environment, forced
    options, the alias, O1 patches, logging, step hooks) is put back before returning.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_ampx_logging(request.quiet))
        stack.enter_context(_telemetry(request.telemetry_file))
        stack.enter_context(_main_like_python(request))
        stack.enter_context(_forced_and_alias(request))
        stack.enter_context(_children(request))
        stack.enter_context(_warn_without_initialize(request))  # exits before the alias goes
        if request.max_steps:
            stack.enter_context(_step_limit(request.max_steps))
        if request.numerics_dir is not None:  # last in: written before the session goes
            stack.enter_context(_numerics_report(request.numerics_dir))
        try:
            _exec_script(request)
        except StepLimitReached:
            return 0
        except SystemExit as exc:
            return exit_code(exc.code)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", file=sys.stderr)
            return 130
        except BaseException as exc:  # the script's crash: report it as python would
            print_script_traceback(exc)
            return 1
        finally:
            sys.stdout.flush()
    return 0


def exit_code(code: Any) -> int:
    """The process exit status for a `SystemExit` code, as python computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exec_script(request: RunRequest) -> None:
    if request.module:
        runpy.run_module(request.script, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request.script, run_name="__main__")


@contextlib.contextmanager
def _numerics_report(directory: str) -> Iterator[None]:
    """At the end of the run (however it ends): print and write the numerics report."""
    try:
        yield
    finally:
        from ..registry import SESSIONS

        session = SESSIONS.default
        watch = getattr(session, "overflow_watch", None)
        if watch is None or watch.numerics is None:
            print("ampx run --numerics: no numerics to report (the script initialized no "
                  "model with loss scaling or inf checks here)", file=sys.stderr)
        else:
            try:
                report = watch.numerics.report()
                print(report.table(), file=sys.stderr)
                paths = report.write(directory)
            except Exception as exc:  # the script's own outcome stands
                print(f"ampx run --numerics: could not write the report: {exc}",
                      file=sys.stderr)
            else:
                print(f"ampx run --numerics: wrote {', '.join(str(p) for p in paths)}",
                      file=sys.stderr)


# -- logging ------------------------------------------------------------------------------------

class _LogHandler(logging.StreamHandler):
    """stderr handler of `ampx run` (a class of its own so it can be found and removed)."""


class PrefixFormatter(logging.Formatter):
    """`ampx: message`, unless the message already names ampx ("ampx run: ...")."""

    def format(self, record: logging.LogRecord) -> str:
        """Format the record with one `ampx` prefix."""
        text = super().format(record)
        return text if text.startswith("ampx") else f"ampx: {text}"


@contextlib.contextmanager
def _ampx_logging(quiet: bool) -> Iterator[None]:
    """ampx's records go to stderr once: through this handler, not also through the root's.

    Propagation is off while the handler is attached, so a script that calls
    `logging.basicConfig` does not print every ampx line a second time.
    """
    handler = _LogHandler(sys.stderr)
    handler.setFormatter(PrefixFormatter("%(message)s"))
    previous = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]


# -- process set-up -----------------------------------------------------------------------------

@contextlib.contextmanager
def _env(updates: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Set (or, for None, remove) environment variables; put them back afterwards."""
    saved = {key: os.environ.get(key) for key in updates}
    try:
        for key, value in updates.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _telemetry(path: Optional[str]) -> Iterator[None]:
    if not path:
        yield
        return
    try:
        with _env({"AMPX_TELEMETRY": os.path.abspath(path)}):
            yield
    finally:
        from .. import telemetry

        telemetry.sink()  # notices the change and closes the run's telemetry file


@contextlib.contextmanager
def _main_like_python(request: RunRequest) -> Iterator[None]:
    """argv and sys.path[0] as `python script.py args` (or `python -m mod args`) sets them."""
    saved_argv, saved_path0 = list(sys.argv), sys.path[0] if sys.path else None
    sys.argv = [request.script, *request.script_args]  # runpy puts the file name in argv[0]
    path0 = os.getcwd() if request.module else os.path.dirname(os.path.abspath(request.script))
    if sys.path:
        sys.path[0] = path0
    else:
        sys.path.insert(0, path0)
    try:
        yield
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0


@contextlib.contextmanager
def _forced_and_alias(request: RunRequest) -> Iterator[None]:
    from ..compat import apex_alias
    from ..frontend import forced_options, set_forced_options

    saved = forced_options()
    aliased = False
    try:
        if request.apex_alias:
            aliased = apex_alias.install(force=request.force_apex_alias)
        set_forced_options(request.forced)
        if request.forced:
            logger.info("ampx run: forcing %s", request.forced.describe())
        yield
    finally:
        set_forced_options(saved)
        if aliased:
            apex_alias.uninstall()
        _restore_patches()


def _restore_patches() -> None:
    """Undo the script's O1 patching (matters when the run is in-process, e.g. in tests)."""
    try:
        from .. import frontend

        frontend.restore()
    except Exception:  # never let cleanup hide the script's exit status
        logger.debug("ampx run: restore() after the script failed", exc_info=True)


@contextlib.contextmanager
def _warn_without_initialize(request: RunRequest) -> Iterator[None]:
    """Warn at exit when the script never initialized ampx here (so nothing was forced).

    Counted through a global optimizer step hook (plain steps, steps of initialized
    optimizers) plus the default session: a script that stepped only plain optimizers, or
    that was given forced options, and never called `initialize` trained without ampx.
    """
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .. import frontend
    from ..scaling.protocol import amp_state_of

    steps = {"plain": 0, "ampx": 0}
    before = frontend.default_session()

    def count(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps["ampx" if amp_state_of(optimizer) is not None else "plain"] += 1

    hook = register_optimizer_step_pre_hook(count)
    try:
        yield
    finally:
        hook.remove()
        initialized = steps["ampx"] > 0 or frontend.default_session() is not before \
            or _o1_active()  # amp.init(): O1's casts, in the forced dtype
        if not initialized and (steps["plain"] or request.forced):
            forced = request.forced.describe()
            logger.warning(
                "ampx run: the script never called amp.initialize in this process%s; its %d "
                "optimizer step(s) ran without ampx, in the precision the script chose. Call "
                "`model, optimizer = amp.initialize(model, optimizer)` after building them.",
                f", so the forced options ({forced}) were not applied" if forced else "",
                steps["plain"])


def _o1_active() -> bool:
    from ..o1 import patch

    return patch.active() is not None


def _warn_on_a_plain_step(forced: Any) -> None:
    """In a child process given forced options: warn at its first optimizer step when that
    optimizer is not ampx's and nothing was initialized (the parent's exit check does not see
    children: `mp.spawn` ranks, launchers' workers). The hook goes at that first step."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .. import frontend
    from ..scaling.protocol import amp_state_of

    def check(optimizer: Any, args: Any, kwargs: Any) -> None:
        handle.remove()
        if amp_state_of(optimizer) is None and frontend.default_session() is None \
                and not _o1_active():
            logger.warning(
                "ampx run: process %d steps an optimizer that amp.initialize did not prepare, "
                "so the forced options (%s) are not applied in it: it trains in the precision "
                "the script chose. Call `model, optimizer = amp.initialize(model, optimizer)` "
                "in this process too.", os.getpid(), forced.describe())

    handle = register_optimizer_step_pre_hook(check)


@contextlib.contextmanager
def _step_limit(limit: int) -> Iterator[None]:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    counts: dict[int, int] = {}

    def stop_after_limit(optimizer: Any, args: Any, kwargs: Any) -> None:
        done = counts.get(id(optimizer), 0)
        if done >= limit:
            logger.info("ampx run: stopping the script after %d optimizer steps (--max-steps)",
                        limit)
            raise StepLimitReached(0)
        counts[id(optimizer)] = done + 1

    hook = register_optimizer_step_pre_hook(stop_after_limit)
    try:
        yield
    finally:
        hook.remove()


# -- child processes ----------------------------------------------------------------------------

def child_config(request: RunRequest) -> dict[str, Any]:
    """What a child process applies (the JSON in `AMPX_RUN_CHILD`)."""
    return {"alias": request.apex_alias, "force_alias": request.force_apex_alias,
            "forced": request.forced.to_json(),
            "ampx_root": str(Path(__file__).resolve().parents[2])}


@contextlib.contextmanager
def _children(request: RunRequest) -> Iterator[None]:
    """A sitecustomize on the children's PYTHONPATH that applies `child_config` in each."""
    site_dir = tempfile.mkdtemp(prefix="ampx-run-")
    try:
        shutil.copyfile(_CHILD_SITE, os.path.join(site_dir, "sitecustomize.py"))
        paths = [site_dir, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
        with _env({"PYTHONPATH": os.pathsep.join(paths),
                   CHILD_ENV: json.dumps(child_config(request))}):
            yield
    finally:
        shutil.rmtree(site_dir, ignore_errors=True)


def apply_child_config(config: Mapping[str, Any]) -> None:
    """In a child process of `ampx run`: install the alias and the forced options.

    Called by the child's sitecustomize when the child first imports `apex` or `ampx`.
    """
    from ..compat import apex_alias
    from ..frontend import set_forced_options
    from ..options.forced import ForcedOptions

    if config.get("alias"):
        apex_alias.install(force=bool(config.get("force_alias")))
    forced = ForcedOptions.from_json(config["forced"]) if config.get("forced") else None
    set_forced_options(forced)
    if forced:
        _warn_on_a_plain_step(forced)


# -- tracebacks ---------------------------------------------------------------------------------

def _is_internal(filename: str) -> bool:
    internal = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or ""),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "main.py")}
    return filename.startswith("<frozen ") or os.path.abspath(filename) in internal


def print_script_traceback(exc: BaseException) -> None:
    """Print a traceback that starts in the script (ampx's and runpy's frames left out)."""
    tb: Optional[TracebackType] = exc.__traceback__
    while tb is not None and _is_internal(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
