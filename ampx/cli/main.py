"""The `ampx` command line: the argument parser and the dispatch to each subcommand.

One job: turn `ampx run|sweep|info|lists|selftest|build-ext ...` into a call of the module
that does the work (`runner`, `sweep`, `info`, `lists_report`, `selftest`, `_build`) and into
an exit status. Argument errors exit with status 2 and a one-line `ampx: error: ...` message.
Nothing here imports torch at module level, so `ampx --help` is quick.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from .run import StepLimitReached, exit_code

__all__ = ["StepLimitReached", "build_parser", "main"]



class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `ampx: error: ...` (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        hint = f" (see '{self.prog} --help')"
        self.exit(2, f"ampx: error: {message}{hint}\n")


class _UsageError(Exception):
    """A command-line mistake found after parsing (exit status 2)."""


# -- argument types ------------------------------------------------------------------------------

# The choice lists, the "letter O" hint and the parsers are ampx.options.values' (shared with
# `initialize` and compat/options.py); it imports torch, so it is imported only when a value is
# parsed, never for --help.

def _option_message(exc: Exception) -> str:
    text = str(exc).splitlines()[0]
    return text.split(": ", 1)[1] if text.startswith("ampx") and ": " in text else text


def _opt_level(text: str) -> str:
    return _parsed_opt_level(text).value


def _parsed_opt_level(text: str) -> Any:
    """The `OptLevel` of `text` (`ampx run -O`: the one place a forced level is parsed)."""
    from ..options.values import LETTER_O_HINT, OPT_LEVELS, OptionError, parse_opt_level

    try:
        return parse_opt_level(text)
    except OptionError:
        pass
    hint = ""
    if text.upper() in OPT_LEVELS:
        hint = f"; did you mean {text.upper()!r}?"
    elif text.startswith("0"):
        hint = f". {LETTER_O_HINT}"
    raise argparse.ArgumentTypeError(
        f"unknown opt level {text!r}: choose from {', '.join(OPT_LEVELS)}{hint}"
    )


def _dtype(text: str) -> str:
    from ..options.values import short_dtype_name

    return short_dtype_name(_parsed_dtype(text))


def _parsed_dtype(text: str) -> Any:
    """The torch dtype of `text` (`ampx run --dtype`: the one place a forced dtype is parsed)."""
    from ..options.values import DTYPE_CHOICES, OptionError, parse_dtype

    try:
        return parse_dtype(text)
    except OptionError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}: choose from {', '.join(DTYPE_CHOICES)}"
        ) from None


def _loss_scale(text: str) -> Any:
    from ..options.values import OptionError, parse_loss_scale

    try:
        return parse_loss_scale(text)
    except OptionError as exc:
        raise argparse.ArgumentTypeError(_option_message(exc)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _duration(text: str) -> float:
    from .sweep.plan import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    from ..options.values import SWEEP_EXTRA

    return list(dict.fromkeys(SWEEP_EXTRA if item.upper() == SWEEP_EXTRA.upper()
                              else _opt_level(item) for item in items))


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
(with matplotlib) are written to --out; Ctrl-C writes what finished so far.

Built-in examples: on a CPU the sweep first times the example's matmul shapes in fp32 and the
half dtypes (and says when they are emulated), then picks a model size and step count that fit
the time budget (--budget, default 4m) and says why. The examples train on real data (the
stdlib's source bytes; scikit-learn's digits) and evaluate on a held-out split; the verdict
recommends a level only when its held-out metric stays within 1% of O0's without drifting.

examples:
  ampx sweep
  ampx sweep --budget 2m
  ampx sweep --example convnet --levels O0,O2 --steps 30
  ampx sweep train.py --levels O0,O1,O2 --dtypes fp16,bf16 --steps 200 -- --data ./data
  ampx sweep train.py --metric val_acc --higher-is-better
"""

_SELFTEST_EPILOG = """\
Checks this installation on every device present (CPU, and each CUDA device): the native
kernels against the pure-torch reference on random lists (all dtypes, inf/NaN placed at the
first, a middle and the last element), a 20-step O1 and O2 training run per half dtype with
one forced overflow, and O1/O2 step times against torch.autocast. Exits 1 on any mismatch.
Run it first on a new GPU machine.

examples:
  ampx selftest
  ampx selftest --json
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
Compiles ampx's native kernels (ampx/csrc) against the installed torch into a cache; later
imports load them. Needs a C++ compiler ($CXX, default c++) and ninja (pip install
'torch-ampx[native]'). Without them ampx uses its pure-torch kernels. CUDA kernels are added when
torch has CUDA and nvcc is found (no GPU needed).

examples:
  ampx build-ext --verbose
  ampx build-ext --skip-without-compiler    # exit 0 with a note where no compiler exists
  ampx build-ext --require-cuda             # exit 1 unless the CUDA kernels are built
"""


def _subparser(subs: Any, name: str, help_text: str, epilog: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subs.add_parser(
        name, help=help_text, description=help_text, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def _add_run(subs: Any) -> None:
    run = _subparser(subs, "run", "Run a training script with ampx (and the apex alias).",
                     _RUN_EPILOG)
    over = run.add_argument_group("overrides of the script's amp.initialize arguments")
    over.add_argument("-O", "--opt-level", type=_parsed_opt_level, metavar="LEVEL",
                      help="O0, O1, O2 or O3 (the letter O)")
    over.add_argument("--dtype", type=_parsed_dtype, metavar="{fp16,bf16}", help="half dtype")
    over.add_argument("--loss-scale", type=_loss_scale, metavar="{dynamic,N}",
                      help="'dynamic' or a static scale")
    over.add_argument("--keep-batchnorm-fp32", action=argparse.BooleanOptionalAction,
                      default=None, help="keep batchnorm in float32 (O2/O3)")
    over.add_argument("--master-weights", action=argparse.BooleanOptionalAction, default=None,
                      help="keep float32 master weights (O2/O3)")
    over.add_argument("--compensation", choices=("kahan",),
                      help="O3: keep each half weight's lost update bits in a half "
                           "compensation (docs/opt-levels.md)")
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
    extra.add_argument("--numerics", nargs="?", const="ampx-numerics", metavar="DIR",
                       help="watch every module's overflow, underflow and precision and write "
                            "the ranked report (table, JSON, CSV, heat map) to DIR at the end "
                            "(default ampx-numerics/; forces numerics='report')")
    extra.add_argument("--numerics-every", type=_positive_int, metavar="N",
                       help="with --numerics: watch one step in N (default 100)")
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


def _add_sweep(subs: Any) -> None:
    from ..examples import EXAMPLES

    sweep = _subparser(subs, "sweep", "Compare opt levels and dtypes on a script.",
                       _SWEEP_EPILOG)
    sweep.add_argument("script", nargs="?", metavar="SCRIPT",
                       help="training script (default: a built-in example)")
    sweep.add_argument("--example", choices=sorted(EXAMPLES),
                       help="built-in example to run when no script is given "
                            "(default: transformer)")
    sweep.add_argument("--levels", type=_level_list, metavar="L,L",
                       help="opt levels (default: all four and O3 with compensated half "
                            "weights, O0,O1,O2,O3,O3+kahan)")
    sweep.add_argument("--dtypes", type=_dtype_list, metavar="D,D",
                       help="half dtypes (default: bf16 on CPU; fp16,bf16 on a GPU with bf16)")
    sweep.add_argument("--steps", type=_positive_int, metavar="N",
                       help="optimizer steps per configuration (default: the example's; a "
                            "script's own length)")
    sweep.add_argument("--out", type=Path, default=Path("sweep-out"), metavar="DIR",
                       help="output directory (default: ./sweep-out)")
    sweep.add_argument("--budget", type=_duration, metavar="TIME",
                       help="time for the whole sweep, e.g. 90s, 2m, 5m: the built-in examples "
                            "get a model size and step count that fit it, and each run a share "
                            "of it as its limit (default for the examples: 4m)")
    sweep.add_argument("--timeout", type=_positive_float, default=None, metavar="S",
                       help="seconds allowed per configuration (default: the budget's share; "
                            "900 for a script without --budget)")
    sweep.add_argument("--repeat", type=_positive_int, default=1, metavar="K",
                       help="run the configurations K times, alternating their order, and "
                            "keep each one's fastest run (steadier timings on a busy machine)")
    sweep.add_argument("--no-autocast", action="store_true",
                       help="skip the torch.autocast comparison row (built-in examples only)")
    sweep.add_argument("--no-plot", action="store_true", help="do not write sweep.png")
    sweep.add_argument("--numerics", action="store_true",
                       help="run each O1-O3 configuration with the numerics report (ampx run "
                            "--numerics) and list the modules it finds at risk under the table")
    sweep.add_argument("--force-apex-alias", action="store_true",
                       help="pass --force-apex-alias to every run")
    sweep.add_argument("--metric", metavar="NAME",
                       help="judge accuracy by this evaluation metric, which the script reports "
                            "with ampx.log_metric(NAME, value, step=...) (default for the "
                            "built-in examples: heldout_loss)")
    sweep.add_argument("--higher-is-better", action="store_true",
                       help="the --metric is an accuracy (higher is better), not a loss")
    sweep.add_argument("--metric-regex", metavar="REGEX",
                       help="read the metric from the script's output instead (an unedited "
                            "script): the group 'value' (or the first group) is the number, "
                            "an optional group 'step' its step, e.g. "
                            "'val acc (?P<value>[0-9.]+)'")


def build_parser() -> argparse.ArgumentParser:
    """The `ampx` argument parser with its six subcommands."""
    from .. import __version__

    parser = _Parser(
        prog="ampx",
        description="apex.amp's mixed-precision API for current PyTorch: run legacy apex "
                    "scripts, and compare opt levels and dtypes without editing code.",
        epilog="examples:\n  ampx selftest\n  ampx sweep\n  ampx run -O O2 --dtype bf16 "
               "train.py\n  ampx info",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ampx {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subs.required = True
    _add_run(subs)
    _add_sweep(subs)
    selftest = _subparser(subs, "selftest", "Check kernels, training and speed on every "
                          "device (run it first on a new machine).", _SELFTEST_EPILOG)
    selftest.add_argument("--json", action="store_true", help="print JSON")

    info = _subparser(subs, "info", "Versions, devices and their fp16/bf16 support, kernels.",
                      _INFO_EPILOG)
    info.add_argument("--json", action="store_true", help="print JSON")

    lists = _subparser(subs, "lists", "What each patched function does at an opt level.",
                       _LISTS_EPILOG)
    lists.add_argument("--level", type=_opt_level, default="O1", metavar="LEVEL",
                       help="opt level (default: O1)")
    lists.add_argument("--dtype", type=_dtype, metavar="{fp16,bf16}",
                       help="half dtype (default: the one `ampx info` advises here: bf16 on a "
                            "CPU that emulates fp16, else fp16)")
    lists.add_argument("--policy", metavar="POLICY",
                       help="only this policy (lower, fp32, promote, ...)")
    lists.add_argument("--json", action="store_true", help="print JSON")

    build = _subparser(subs, "build-ext", "Compile ampx's native kernels.", _BUILD_EPILOG)
    build.add_argument("-v", "--verbose", action="store_true", help="show the compiler output")
    build.add_argument("--skip-without-compiler", action="store_true",
                       help="exit 0 with a note instead of failing when no C++ compiler exists")
    build.add_argument("--require-cuda", action="store_true", help="fail without CUDA kernels")
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
        return exit_code(exc.code)
    if args.command == "sweep":
        args.script_args = script_args_after_dashes or []
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": _cmd_run, "sweep": _cmd_sweep, "info": _cmd_info, "lists": _cmd_lists,
        "selftest": _cmd_selftest,
        "build-ext": _cmd_build_ext,
    }
    try:
        return handlers[args.command](args)
    except _UsageError as exc:
        print(f"ampx: error: {exc} (see 'ampx {args.command} --help')", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a script or a sweep's runs: no traceback
        print(f"ampx {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ampx lists | head`: the reader left; stay quiet as python does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


# -- the subcommands -----------------------------------------------------------------------------

def _forced_from_args(args: argparse.Namespace) -> Any:
    """The `ForcedOptions` of `ampx run`'s flags: parsed and checked here, once, for the run."""
    from ..options.forced import ForcedOptions
    from ..options.values import OptionError

    forced: dict[str, Any] = {key: getattr(args, key) for key in (
        "opt_level", "loss_scale", "keep_batchnorm_fp32", "master_weights", "min_loss_scale",
        "max_loss_scale", "compensation") if getattr(args, key) is not None}
    forced.update({"enabled": False} if args.disable else {})
    forced.update({"dtype": args.dtype} if args.dtype is not None else {})
    forced.update({"detect_overflow": "forward"} if args.explain_overflows else {})
    forced.update({"numerics": "report"} if args.numerics else {})
    if args.numerics_every is not None:
        if not args.numerics:
            raise _UsageError("--numerics-every needs --numerics")
        forced["numerics_every"] = args.numerics_every
    try:
        return ForcedOptions.parse(forced)
    except (OptionError, TypeError) as exc:
        raise _UsageError(str(exc).splitlines()[0]) from None


def _cmd_run(args: argparse.Namespace) -> int:
    from . import run as runner

    if args.force_apex_alias and args.no_apex_alias:
        raise _UsageError("--force-apex-alias and --no-apex-alias exclude each other")
    forced = _forced_from_args(args)
    if not args.module and not os.path.isfile(args.script):
        raise _UsageError(f"script not found: {args.script}")
    return runner.run(runner.RunRequest(
        script=args.script, script_args=list(args.script_args), module=args.module,
        forced=forced, telemetry_file=args.telemetry_file, max_steps=args.max_steps,
        apex_alias=not args.no_apex_alias, force_apex_alias=args.force_apex_alias,
        quiet=args.quiet, numerics_dir=args.numerics,
    ))


def _cmd_sweep(args: argparse.Namespace) -> int:
    from . import sweep

    if args.script is not None and args.example is not None:
        raise _UsageError("give a script or --example, not both")
    if args.script is not None and not Path(args.script).is_file():
        raise _UsageError(f"script not found: {args.script}")
    return sweep.main(args)


def _cmd_info(args: argparse.Namespace) -> int:
    from . import info

    collected = info.collect_info()
    print(json.dumps(collected, indent=1, default=str) if args.json
          else info.format_info(collected))
    return 0


def _cmd_lists(args: argparse.Namespace) -> int:
    from . import info
    from . import lists as lists_report

    dtype = args.dtype or info.preferred_dtype()
    try:
        print(lists_report.report(args.level, dtype, args.policy, as_json=args.json))
    except lists_report.UnknownPolicy as exc:
        raise _UsageError(str(exc)) from None
    return 0


def _cmd_selftest(args: argparse.Namespace) -> int:
    from . import selftest

    return selftest.main(as_json=args.json)


# -- ampx build-ext ------------------------------------------------------------------------------

def _cmd_build_ext(args: argparse.Namespace) -> int:
    from .. import _build, _build_cuda

    missing = _build.missing_compiler()
    if missing is not None and args.skip_without_compiler:
        print(f"ampx build-ext: SKIPPED, {missing}; the native kernels are not built and ampx "
              "uses its pure-torch kernels", file=sys.stderr)
        return 0
    try:
        extra: dict[str, Any] = {"require_cuda": True} if args.require_cuda else {}
        path = _build.build(verbose=args.verbose, **extra,  # test_cli stubs build() without it
                            progress=lambda line: print(line, file=sys.stderr, flush=True))
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"ampx: build failed: {first}", file=sys.stderr)
        if not args.verbose:
            print("ampx: rerun with --verbose for the compiler output; ampx keeps using its "
                  "pure-torch kernels", file=sys.stderr)
        return 1
    print(f"built ampx._C: {path}{_build_cuda.cpu_only_note(path)}")
    return 0
