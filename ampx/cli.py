"""The `ampx` command line: `run`, `sweep`, `info`, `lists` and `build-ext`.

`ampx run` executes a training script as `__main__` (like `python script.py`), with
`from apex import amp` resolving to ampx when no real apex is installed and with command-line
overrides of what the script passes to `amp.initialize`. `ampx sweep` runs a script (by
default a built-in example) at each opt level and dtype in fresh processes and compares them.
Argument errors exit with status 2 and a one-line `ampx: error: ...` message.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import runpy
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

__all__ = ["StepLimitReached", "build_parser", "main"]

logger = logging.getLogger("ampx")

_LEVELS = ("O0", "O1", "O2", "O3")
_DTYPES = {"fp16": "fp16", "float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16"}
_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16"}


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `ampx: error: ...` (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        hint = f" (see '{self.prog} --help')"
        self.exit(2, f"ampx: error: {message}{hint}\n")


class _UsageError(Exception):
    """A command-line mistake found after parsing (exit status 2)."""


class StepLimitReached(SystemExit):
    """Raised inside `optimizer.step()` by `ampx run --max-steps` to end the script (code 0)."""


# -- argument types ------------------------------------------------------------------------------

def _opt_level(text: str) -> str:
    if text in _LEVELS:
        return text
    hint = ""
    if text.upper() in _LEVELS:
        hint = f"; did you mean {text.upper()!r}?"
    elif text.startswith("0"):
        hint = "; the prefix O is the letter O, not the number zero"
    raise argparse.ArgumentTypeError(
        f"unknown opt level {text!r}: choose from {', '.join(_LEVELS)}{hint}"
    )


def _dtype(text: str) -> str:
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}: choose from fp16, bf16"
        ) from None


def _loss_scale(text: str) -> Any:
    if text == "dynamic":
        return "dynamic"
    return _positive_float(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _level_list(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list of opt levels")
    return list(dict.fromkeys(_opt_level(item) for item in items))


def _dtype_list(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list of dtypes")
    return list(dict.fromkeys(_dtype(item) for item in items))


# -- the parser ----------------------------------------------------------------------------------

_RUN_EPILOG = """\
The script runs as __main__, as `python script.py args...` would run it; options after the
script name belong to the script. Overrides replace what the script passes to amp.initialize
(the replaced values are logged and written to telemetry).

examples:
  ampx run -O O2 --dtype bf16 train.py --epochs 1
  ampx run --opt-level O1 --loss-scale 128 --telemetry-file run.jsonl train.py
  torchrun --nproc-per-node 2 -m ampx run -O O2 train.py
"""

_SWEEP_EPILOG = """\
Each configuration runs in a fresh process (`ampx run -O L --dtype D ...`). Without a script
the built-in transformer example runs (--example picks another). Arguments for the script go
after `--`. The table goes to stdout, progress to stderr; sweep.json, sweep.csv and sweep.png
(with matplotlib) are written to --out.

examples:
  ampx sweep
  ampx sweep --example convnet --levels O0,O2 --steps 30
  ampx sweep train.py --levels O0,O1,O2 --dtypes fp16,bf16 --steps 200 -- --data ./data
"""

_INFO_EPILOG = """\
examples:
  ampx info
  ampx info --json
"""

_LISTS_EPILOG = """\
At O1 ampx patches torch functions and Tensor methods; this shows what each one does. At
O0, O2 and O3 nothing is patched (the model is cast instead), and the command says so.

examples:
  ampx lists --level O1 --dtype bf16
  ampx lists --policy fp32
  ampx lists --json
"""

_BUILD_EPILOG = """\
Compiles ampx's native kernels (csrc/) against the installed torch into a cache; later imports
load them. Without them ampx uses its pure-torch kernels.

example:
  ampx build-ext --verbose
"""


def _subparser(subs: Any, name: str, help_text: str, epilog: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subs.add_parser(
        name, help=help_text, description=help_text, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The `ampx` argument parser with its five subcommands."""
    from . import __version__
    from .examples import EXAMPLES

    parser = _Parser(
        prog="ampx",
        description="apex.amp's mixed-precision API for current PyTorch: run legacy apex "
                    "scripts, and compare opt levels and dtypes without editing code.",
        epilog="examples:\n  ampx sweep\n  ampx run -O O2 --dtype bf16 train.py\n  ampx info",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ampx {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subs.required = True

    run = _subparser(subs, "run", "Run a training script with ampx (and the apex alias).",
                     _RUN_EPILOG)
    over = run.add_argument_group("overrides of the script's amp.initialize arguments")
    over.add_argument("-O", "--opt-level", type=_opt_level, metavar="LEVEL",
                      help="O0, O1, O2 or O3 (the letter O)")
    over.add_argument("--dtype", type=_dtype, metavar="{fp16,bf16}", help="half dtype")
    over.add_argument("--loss-scale", type=_loss_scale, metavar="{dynamic,N}",
                      help="'dynamic' or a static scale")
    over.add_argument("--keep-batchnorm-fp32", action=argparse.BooleanOptionalAction,
                      default=None, help="keep batchnorm in float32 (O2/O3)")
    over.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=None,
                      help="keep float32 master weights (O2/O3)")
    over.add_argument("--min-loss-scale", type=_positive_float, metavar="F",
                      help="floor of the dynamic loss scale")
    over.add_argument("--max-loss-scale", type=_positive_float, metavar="F",
                      help="ceiling of the dynamic loss scale")
    over.add_argument("--disable", action="store_true",
                      help="enabled=False: amp becomes a pass-through (plain fp32)")
    extra = run.add_argument_group("run options")
    extra.add_argument("--telemetry-file", metavar="PATH",
                       help="write per-step JSON lines here (sets AMPX_TELEMETRY; ranks > 0 "
                            "append .RANK)")
    extra.add_argument("--explain-overflows", action="store_true",
                       help="name the first module whose activations became inf/NaN on "
                            "skipped steps (forces detect_overflow='forward')")
    extra.add_argument("--max-steps", type=_positive_int, metavar="N",
                       help="end the script (exit 0) after N optimizer steps")
    extra.add_argument("--force-apex-alias", action="store_true",
                       help="provide `apex.amp` even when a real apex is installed")
    extra.add_argument("--no-apex-alias", action="store_true",
                       help="do not provide `apex.amp` at all")
    extra.add_argument("-m", dest="module", action="store_true",
                       help="SCRIPT is a module name, run as `python -m` would")
    extra.add_argument("-q", "--quiet", action="store_true",
                       help="only warnings from ampx (no option table)")
    run.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                     help="arguments for the script")

    sweep = _subparser(subs, "sweep", "Compare opt levels and dtypes on a script.",
                       _SWEEP_EPILOG)
    sweep.add_argument("script", nargs="?", metavar="SCRIPT",
                       help="training script (default: a built-in example)")
    sweep.add_argument("--example", choices=sorted(EXAMPLES),
                       help="built-in example to run when no script is given "
                            "(default: transformer)")
    sweep.add_argument("--levels", type=_level_list, default=list(_LEVELS),
                       metavar="L,L", help="opt levels (default: O0,O1,O2,O3)")
    sweep.add_argument("--dtypes", type=_dtype_list, metavar="D,D",
                       help="half dtypes (default: bf16 on CPU; fp16,bf16 on a GPU with bf16)")
    sweep.add_argument("--steps", type=_positive_int, metavar="N",
                       help="optimizer steps per configuration (default: the example's; a "
                            "script's own length)")
    sweep.add_argument("--out", type=Path, default=Path("sweep-out"), metavar="DIR",
                       help="output directory (default: ./sweep-out)")
    sweep.add_argument("--timeout", type=_positive_float, default=900.0, metavar="S",
                       help="seconds allowed per configuration (default: 900)")
    sweep.add_argument("--repeat", type=_positive_int, default=1, metavar="K",
                       help="run the configurations K times round-robin and keep each one's "
                            "fastest run (steadier timings on a busy machine)")
    sweep.add_argument("--no-autocast", action="store_true",
                       help="skip the torch.autocast comparison row (built-in examples only)")
    sweep.add_argument("--no-plot", action="store_true", help="do not write sweep.png")
    sweep.add_argument("--force-apex-alias", action="store_true",
                       help="pass --force-apex-alias to every run")

    info = _subparser(subs, "info", "Versions, devices and their fp16/bf16 support, kernels.",
                      _INFO_EPILOG)
    info.add_argument("--json", action="store_true", help="print JSON")

    lists = _subparser(subs, "lists", "What each patched function does at an opt level.",
                       _LISTS_EPILOG)
    lists.add_argument("--level", type=_opt_level, default="O1", metavar="LEVEL",
                       help="opt level (default: O1)")
    lists.add_argument("--dtype", type=_dtype, default="fp16", metavar="{fp16,bf16}",
                       help="half dtype (default: fp16)")
    lists.add_argument("--policy", metavar="POLICY",
                       help="only this policy (lower, fp32, promote, ...)")
    lists.add_argument("--json", action="store_true", help="print JSON")

    build = _subparser(subs, "build-ext", "Compile ampx's native kernels.", _BUILD_EPILOG)
    build.add_argument("-v", "--verbose", action="store_true", help="show the compiler output")
    return parser


# -- entry point ---------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name (default: `sys.argv[1:]`).

    Returns:
        The exit status: the script's for `run`, 2 for argument errors.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    script_args_after_dashes: Optional[list[str]] = None
    if args_list[:1] == ["sweep"] and "--" in args_list:
        cut = args_list.index("--")
        args_list, script_args_after_dashes = args_list[:cut], args_list[cut + 1:]
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version and argument errors
        return _exit_code(exc.code)
    if args.command == "sweep":
        args.script_args = script_args_after_dashes or []
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": _cmd_run, "sweep": _cmd_sweep, "info": _cmd_info, "lists": _cmd_lists,
        "build-ext": _cmd_build_ext,
    }
    try:
        return handlers[args.command](args)
    except _UsageError as exc:
        print(f"ampx: error: {exc} (see 'ampx {args.command} --help')", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ampx lists | head`: the reader left; stay quiet as python does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# -- ampx run ------------------------------------------------------------------------------------

def _forced_from_args(args: argparse.Namespace) -> dict[str, Any]:
    forced: dict[str, Any] = {}
    if args.disable:
        forced["enabled"] = False
    if args.opt_level is not None:
        forced["opt_level"] = args.opt_level
    if args.dtype is not None:
        forced["dtype"] = _DTYPE_NAMES[args.dtype]
    if args.explain_overflows:
        forced["detect_overflow"] = "forward"
    for key in ("loss_scale", "keep_batchnorm_fp32", "master_weights", "min_loss_scale",
                "max_loss_scale"):
        value = getattr(args, key)
        if value is not None:
            forced[key] = value
    return forced


def _validate_forced(forced: dict[str, Any]) -> None:
    """Check the overrides against each other now, rather than inside the script."""
    from .opt_levels import OptionError, resolve_properties

    checked = {k: v for k, v in forced.items() if k != "enabled"}
    if "opt_level" not in checked:
        # Level-specific overrides can only be checked against the script's level.
        for key in ("keep_batchnorm_fp32", "master_weights"):
            checked.pop(key, None)
        checked["opt_level"] = "O0"
    try:
        resolve_properties(**checked)
    except (OptionError, TypeError) as exc:
        raise _UsageError(str(exc).splitlines()[0]) from None


class _LogHandler(logging.StreamHandler):
    """stderr handler of `ampx run` (a class of its own so it can be found and removed)."""


def _configure_logging(quiet: bool) -> Callable[[], None]:
    handler = _LogHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ampx: %(message)s"))
    previous_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)

    def undo() -> None:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)

    return undo


def _install_step_limit(limit: int) -> Any:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    counts: dict[int, int] = {}

    def stop_after_limit(optimizer: Any, args: Any, kwargs: Any) -> None:
        done = counts.get(id(optimizer), 0)
        if done >= limit:
            logger.info("ampx run: stopping the script after %d optimizer steps (--max-steps)",
                        limit)
            raise StepLimitReached(0)
        counts[id(optimizer)] = done + 1

    return register_optimizer_step_pre_hook(stop_after_limit)


def _print_script_traceback(exc: BaseException) -> None:
    """Print a traceback that starts in the script (ampx's and runpy's frames left out)."""
    internal = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or "")}
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in internal:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _cmd_run(args: argparse.Namespace) -> int:
    if args.force_apex_alias and args.no_apex_alias:
        raise _UsageError("--force-apex-alias and --no-apex-alias exclude each other")
    forced = _forced_from_args(args)
    _validate_forced(forced)
    script = args.script
    if not args.module and not os.path.isfile(script):
        raise _UsageError(f"script not found: {script}")

    from .compat import apex_alias
    from .frontend import forced_options, set_forced_options

    saved_env = os.environ.get("AMPX_TELEMETRY")
    if args.telemetry_file:
        os.environ["AMPX_TELEMETRY"] = os.path.abspath(args.telemetry_file)
    saved_argv, saved_path0 = list(sys.argv), sys.path[0] if sys.path else None
    saved_forced = forced_options()
    undo_logging = _configure_logging(args.quiet)
    aliased = False
    hook = _install_step_limit(args.max_steps) if args.max_steps else None
    try:
        sys.argv = [script, *args.script_args]  # runpy replaces argv[0] with the file name
        # python puts the script's directory first on sys.path (the cwd for -m)
        path0 = os.getcwd() if args.module else os.path.dirname(os.path.abspath(script))
        if sys.path:
            sys.path[0] = path0
        else:
            sys.path.insert(0, path0)
        if not args.no_apex_alias:
            aliased = apex_alias.install(force=args.force_apex_alias)
        set_forced_options(forced)
        if forced:
            logger.info("ampx run: forcing %s", ", ".join(f"{k}={v!r}"
                                                          for k, v in forced.items()))
        try:
            if args.module:
                runpy.run_module(script, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
        except StepLimitReached:
            return 0
        except SystemExit as exc:
            return _exit_code(exc.code)
        except KeyboardInterrupt:
            print("KeyboardInterrupt", file=sys.stderr)
            return 130
        except BaseException as exc:  # the script's crash: report it as python would
            _print_script_traceback(exc)
            return 1
        return 0
    finally:
        sys.stdout.flush()
        if hook is not None:
            hook.remove()
        set_forced_options(saved_forced)
        if aliased:
            apex_alias.uninstall()
        _restore_patches()
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        if args.telemetry_file:
            if saved_env is None:
                os.environ.pop("AMPX_TELEMETRY", None)
            else:
                os.environ["AMPX_TELEMETRY"] = saved_env
            from . import telemetry

            telemetry.sink()  # notices the change and closes the run's telemetry file
        undo_logging()


def _restore_patches() -> None:
    """Undo the script's O1 patching (matters when `main` runs in-process, e.g. in tests)."""
    try:
        from . import frontend

        frontend.restore()
    except Exception:  # never let cleanup hide the script's exit status
        logger.debug("ampx run: restore() after the script failed", exc_info=True)


# -- ampx sweep ----------------------------------------------------------------------------------

def _default_dtypes() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return ["fp16", "bf16"] if torch.cuda.is_bf16_supported() else ["fp16"]
    return ["bf16"]


def _cmd_sweep(args: argparse.Namespace) -> int:
    from . import sweep
    from .examples import EXAMPLES

    if args.script is not None and args.example is not None:
        raise _UsageError("give a script or --example, not both")
    example = None
    if args.script is None:
        example = EXAMPLES[args.example or "transformer"]
        script = example.path
    else:
        script = Path(args.script)
        if not script.is_file():
            raise _UsageError(f"script not found: {args.script}")
    dtypes = args.dtypes or _default_dtypes()
    steps = args.steps if args.steps is not None else (
        example.default_steps if example else None)
    autocast = example is not None and not args.no_autocast
    run_options = ["--quiet"]
    if args.force_apex_alias or example is not None:
        run_options.append("--force-apex-alias")  # the examples must run on ampx, not apex
    spec = sweep.SweepSpec(
        script=script.resolve(), script_args=list(args.script_args),
        configs=sweep.build_configs(args.levels, dtypes, autocast=autocast),
        out=args.out, steps=steps, timeout_s=args.timeout, repeat=args.repeat,
        example=example.name if example else None, run_options=run_options,
    )

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    import torch

    if "fp16" in dtypes and not torch.cuda.is_available():
        progress("ampx sweep: note: fp16 matmuls are emulated on most CPUs and can be very "
                 "slow; bf16 is the CPU's half dtype")
    if example is None and not args.no_autocast:
        progress("ampx sweep: note: the autocast row is only produced for the built-in "
                 "examples")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1):
        progress(f"ampx sweep: note: load average {load:.1f} on {os.cpu_count()} CPUs; other "
                 "processes will make the timings noisy")
    what = f"example '{example.name}'" if example else str(script)
    rounds = f" x {args.repeat} rounds" if args.repeat > 1 else ""
    progress(f"ampx sweep: {what}, {len(spec.configs)} configurations{rounds}, "
             f"{steps if steps is not None else 'all'} steps each, output in {args.out}/")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = sweep.run_sweep(spec, progress=progress)
    print(sweep.format_table(rows))
    written = [
        sweep.write_json(rows, args.out / "sweep.json", sweep.sweep_meta(spec)),
        sweep.write_csv(rows, args.out / "sweep.csv"),
    ]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.no_plot:
        png = sweep.write_png(rows, args.out / "sweep.png",
                              title=f"ampx sweep: {script.name} ({device})")
        if png is None:
            progress("ampx sweep: matplotlib is not installed (pip install 'ampx[plot]'); "
                     "no sweep.png")
        else:
            written.append(png)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if any(row.ok for row in rows) else 1


# -- ampx info -----------------------------------------------------------------------------------

_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_fp16")


def _cpu_flags() -> tuple[str, set[str]]:
    name = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name in ("", platform.machine(), "x86_64"):
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name, flags


def _cpu_support(flags: set[str]) -> dict[str, str]:
    if "amx_bf16" in flags:
        bf16 = "native (AMX-BF16)"
    elif "avx512_bf16" in flags:
        bf16 = "native (AVX512-BF16)"
    elif "bf16" in flags:  # aarch64
        bf16 = "native (BF16)"
    else:
        bf16 = "emulated (slow)"
    if "amx_fp16" in flags:
        fp16 = "native (AMX-FP16)"
    elif "avx512_fp16" in flags:
        fp16 = "native (AVX512-FP16)"
    elif "fphp" in flags:  # aarch64
        fp16 = "native (FP16)"
    else:
        fp16 = "emulated (slow: prefer bf16 on this CPU)"
    return {"fp16": fp16, "bf16": bf16}


def collect_info() -> dict[str, Any]:
    """Everything `ampx info` reports, as a JSON-able dict."""
    import torch

    from . import __version__

    name, flags = _cpu_flags()
    devices: list[dict[str, Any]] = [{
        "device": "cpu", "name": name, "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": sorted(flags & set(_CPU_FLAGS)), **_cpu_support(flags),
    }]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            bf16 = props.major >= 8 or bool(getattr(torch.version, "hip", None))
            devices.append({
                "device": f"cuda:{index}", "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "fp16": "native", "bf16": "native" if bf16 else "emulated (slow)",
            })
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append({"device": "mps", "name": "Apple GPU", "fp16": "native",
                        "bf16": "native (macOS 14+)"})
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        for index in range(xpu.device_count()):
            devices.append({"device": f"xpu:{index}", "name": xpu.get_device_name(index),
                            "fp16": "native", "bf16": "native"})
    return {
        "ampx": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "devices": devices,
        "kernels": _kernel_info(),
    }


def _kernel_info() -> dict[str, Any]:
    try:
        from . import _ext

        described = _ext.describe()
        return dict(described)
    except Exception as exc:  # report, never fail `info`
        return {"backend": "unavailable", "error": f"{type(exc).__name__}: {exc}"}


def _cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    print(f"ampx   {info['ampx']}")
    torch_line = info["torch"]
    if info["torch_cuda"]:
        torch_line += f" (CUDA {info['torch_cuda']})"
    elif info["torch_hip"]:
        torch_line += f" (HIP {info['torch_hip']})"
    print(f"torch  {torch_line}")
    print(f"python {info['python']} on {info['platform']}")
    print()
    rows = [["device", "name", "fp16", "bf16"]]
    for dev in info["devices"]:
        rows.append([dev["device"], str(dev["name"]), dev["fp16"], dev["bf16"]])
    print(_format_columns(rows))
    cpu = info["devices"][0]
    print(f"cpu: {cpu['threads']} threads, torch kernels {cpu['capability']}, flags: "
          f"{', '.join(cpu['flags']) or 'none of ' + ', '.join(_CPU_FLAGS)}")
    print()
    print("kernels:")
    for key, value in info["kernels"].items():
        print(f"  {key}: {value}")
    return 0


def _format_columns(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- ampx lists ----------------------------------------------------------------------------------

def _policy_effect(policy: str, dtype_name: str) -> str:
    return {
        "lower": dtype_name,
        "fp32": "float32",
        "promote": "widest input type",
        "sequence_promote": "widest type in the sequence",
        "banned": "error on half inputs (float32 with allow_banned=True)",
        "inplace_match_self": "other inputs cast to self's type",
        "inplace_fp32_error": "error if self is half",
        "rnn": f"{dtype_name} (inputs, states and weights)",
        "rnn_check": "accepts inputs whose dtype differs from the weights",
    }.get(policy, policy)


def _cmd_lists(args: argparse.Namespace) -> int:
    from . import lists
    from .opt_levels import resolve_properties

    dtype_name = _DTYPE_NAMES[args.dtype]
    props = resolve_properties(args.level, dtype=dtype_name)
    policies = [p.value for p in lists.Policy]
    if args.policy is not None and args.policy not in policies:
        raise _UsageError(f"unknown policy {args.policy!r}: choose from {', '.join(policies)}")
    if not props.patch_torch_functions:
        if props.cast_model_type is None or props.cast_model_type == _torch_float32():
            summary = (f"{args.level}: nothing is patched and nothing is cast; every function "
                       "runs in float32.")
        else:
            cast = str(props.cast_model_type).replace("torch.", "")
            bn = "kept in float32" if props.keep_batchnorm_fp32 else f"in {cast} too"
            masters = "with" if props.master_weights else "without"
            summary = (f"{args.level}: nothing is patched; the model is cast to {cast} "
                       f"(batchnorm {bn}), {masters} float32 master weights, loss scale "
                       f"{props.loss_scale}. Functions run in the dtype of their inputs. "
                       "(`ampx lists --level O1` shows O1's function table.)")
        if args.json:
            print(json.dumps({"level": args.level, "dtype": dtype_name, "patched": [],
                              "properties": props.as_dict(), "summary": summary}, indent=1))
        else:
            print(summary)
        return 0
    order = {name: i for i, name in enumerate(policies)}
    entries = sorted(lists.resolve(), key=lambda e: (order[e.policy.value], e.owner, e.name))
    if args.policy is not None:
        entries = [e for e in entries if e.policy.value == args.policy]
    if args.json:
        print(json.dumps({
            "level": args.level, "dtype": dtype_name,
            "patched": [{"function": f"{e.owner}.{e.name}", "owner": e.owner, "name": e.name,
                         "policy": e.policy.value,
                         "runs_in": _policy_effect(e.policy.value, dtype_name)}
                        for e in entries],
        }, indent=1))
        return 0
    print(f"{args.level} with {dtype_name}: {len(entries)} patched functions and methods")
    rows = [["function", "policy", "runs in"]]
    rows += [[f"{e.owner}.{e.name}", e.policy.value, _policy_effect(e.policy.value, dtype_name)]
             for e in entries]
    print(_format_columns(rows))
    return 0


def _torch_float32() -> Any:
    import torch

    return torch.float32


# -- ampx build-ext ------------------------------------------------------------------------------

def _cmd_build_ext(args: argparse.Namespace) -> int:
    from . import _build

    try:
        path = _build.build(verbose=args.verbose)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"ampx: build failed: {first}", file=sys.stderr)
        if not args.verbose:
            print("ampx: rerun with --verbose for the compiler output; ampx keeps using its "
                  "pure-torch kernels", file=sys.stderr)
        return 1
    print(f"built ampx._C: {path}")
    return 0
