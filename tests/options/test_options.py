"""argparse integration: ampx.options.flags.add_args and Amp.from_args."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

import ampx
from ampx.options import flags as options
from ampx.options.flags import add_args, amp_kwargs_from_args, optimizer_kwargs_from_args

AMPX_FLAGS = ("--opt-level", "--amp-dtype", "--loss-scale", "--init-scale", "--scale-window",
              "--scale-tolerance", "--hysteresis", "--min-loss-scale", "--threshold-loss-scale",
              "--keep-batchnorm-fp32", "--master-weights")


def fairseq_parser() -> argparse.ArgumentParser:
    """A parser carrying fairseq's precision flags as fairseq defines them (CommonConfig)."""
    parser = argparse.ArgumentParser(prog="fairseq-train")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--memory-efficient-fp16", action="store_true")
    parser.add_argument("--memory-efficient-bf16", action="store_true")
    parser.add_argument("--fp16-no-flatten-grads", action="store_true")
    parser.add_argument("--fp16-init-scale", type=int, default=2**7)
    parser.add_argument("--fp16-scale-window", type=int, default=None)
    parser.add_argument("--fp16-scale-tolerance", type=float, default=0.0)
    parser.add_argument("--on-cpu-convert-precision", action="store_true")
    parser.add_argument("--min-loss-scale", type=float, default=1e-4)
    parser.add_argument("--threshold-loss-scale", type=float)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--amp-batch-retries", type=int, default=2)
    parser.add_argument("--amp-init-scale", type=int, default=2**7)
    parser.add_argument("--amp-scale-window", type=int, default=None)
    return parser


def test_flags_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    group = add_args(parser)
    assert group.title == options.GROUP_TITLE
    assert tuple(option for option, _, _ in options.AMPX_OPTIONS) == AMPX_FLAGS
    for flag in AMPX_FLAGS:
        action = parser._option_string_actions[flag]
        assert action.help, flag
    args = parser.parse_args([])
    assert args.opt_level is None and args.amp_dtype == "fp16" and args.loss_scale is None
    assert args.init_scale == 2.0**16 and args.scale_window == 2000
    assert args.scale_tolerance == 0.0 and args.hysteresis == 1
    assert args.min_loss_scale == 1e-4 and args.threshold_loss_scale is None
    assert args.keep_batchnorm_fp32 is None and args.master_weights is None
    assert "ampx mixed precision" in parser.format_help()


def test_no_opt_level_means_a_disabled_session() -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    amp = ampx.Amp.from_args(parser.parse_args([]))
    assert not amp.enabled


def test_from_args_maps_every_flag() -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args([
        "--opt-level", "O2", "--amp-dtype", "bf16", "--loss-scale", "dynamic",
        "--init-scale", "1024", "--scale-window", "50", "--hysteresis", "3",
        "--min-loss-scale", "0.5", "--keep-batchnorm-fp32", "False", "--master-weights", "True",
        "--scale-tolerance", "0.25",
    ])
    props = ampx.Amp.from_args(args).properties
    assert props.opt_level.value == "O2" and props.dtype == torch.bfloat16
    assert props.loss_scale == "dynamic" and props.init_scale == 1024.0
    assert props.growth_interval == 50 and props.hysteresis == 3
    assert props.min_loss_scale == 0.5
    assert props.keep_batchnorm_fp32 is False and props.master_weights is True
    assert optimizer_kwargs_from_args(args) == {"tolerance": 0.25, "min_loss_scale": 0.5}


def test_static_loss_scale_and_overrides() -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--opt-level", "O1", "--loss-scale", "128"])
    amp = ampx.Amp.from_args(args, verbosity=0, init_scale=4.0)
    assert amp.properties.loss_scale == 128.0
    assert amp.properties.verbosity == 0 and amp.properties.init_scale == 4.0


@pytest.mark.parametrize("argv", [["--loss-scale", "big"], ["--loss-scale", "-1"],
                                  ["--opt-level", "01"], ["--master-weights", "maybe"]])
def test_bad_values_are_argparse_errors(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_parser_with_fairseq_flags() -> None:
    parser = fairseq_parser()
    add_args(parser)  # must not raise argparse.ArgumentError for --min/--threshold-loss-scale
    add_args(parser)  # and a second call is harmless
    # fairseq's own flags keep working, ampx's are there
    args = parser.parse_args([
        "--opt-level", "O2", "--min-loss-scale", "0.5", "--threshold-loss-scale", "2",
        "--fp16-init-scale", "16", "--amp-batch-retries", "3", "--init-scale", "256",
        "--scale-window", "10",
    ])
    assert args.fp16_init_scale == 16 and args.amp_batch_retries == 3
    assert args.init_scale == 256.0 and args.scale_window == 10
    kwargs = amp_kwargs_from_args(args)
    assert kwargs["min_loss_scale"] == 2.0  # the floor: max(min, threshold)
    assert optimizer_kwargs_from_args(args)["min_loss_scale"] == 0.5
    assert ampx.Amp.from_args(args).properties.min_loss_scale == 2.0
    # the reused options are fairseq's single definitions, with fairseq's defaults
    defaults = parser.parse_args([])
    assert defaults.min_loss_scale == 1e-4 and defaults.threshold_loss_scale is None
    titles = [g.title for g in parser._action_groups]
    assert titles.count(options.GROUP_TITLE) == 1


@pytest.mark.parametrize("flag", ["--fp16", "--bf16", "--memory-efficient-fp16", "--amp"])
def test_fairseq_precision_flags_clash_with_an_opt_level(flag: str) -> None:
    parser = fairseq_parser()
    add_args(parser)
    with pytest.raises(ValueError, match="fairseq's " + flag):
        ampx.Amp.from_args(parser.parse_args([flag, "--opt-level", "O1"]))
    # without an ampx level, fairseq's flags are fairseq's business
    assert not ampx.Amp.from_args(parser.parse_args([flag])).enabled


def test_apex_script_flags_are_reused() -> None:
    """An apex-era script's own --opt-level/--loss-scale/--keep-batchnorm-fp32 (strings)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", type=str)
    parser.add_argument("--keep-batchnorm-fp32", type=str, default=None)
    parser.add_argument("--loss-scale", type=str, default=None)
    add_args(parser)
    args = parser.parse_args(["--opt-level", "O2", "--keep-batchnorm-fp32", "True",
                              "--loss-scale", "128.0"])
    props = ampx.Amp.from_args(args).properties
    assert props.keep_batchnorm_fp32 is True and props.loss_scale == 128.0


def test_reused_option_with_another_dest() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", dest="amp_level", default="O3")
    add_args(parser)
    args = parser.parse_args([])
    assert args.ampx_option_dests == {"opt_level": "amp_level"}
    assert ampx.Amp.from_args(args).properties.opt_level.value == "O3"


def test_any_namespace_like_object() -> None:
    cfg = SimpleNamespace(opt_level="O1", amp_dtype="bf16")  # e.g. a config section
    kwargs = amp_kwargs_from_args(cfg)
    assert kwargs["opt_level"] == "O1" and kwargs["dtype"] == "bf16"
    assert kwargs["min_loss_scale"] == 1e-4 and kwargs["growth_interval"] == 2000
    assert optimizer_kwargs_from_args(cfg) == {"tolerance": 0.0, "min_loss_scale": 1e-4}


@pytest.mark.parametrize("argv,message", [
    (["--loss-scale", "big"], "loss_scale='big' is neither 'dynamic' nor a number"),
    (["--loss-scale", "inf"], "must be a positive finite number"),
    (["--keep-batchnorm-fp32", "maybe"], "keep_batchnorm_fp32='maybe' is not valid"),
    (["--opt-level", "00"], "invalid choice: '00'"),
    (["--amp-dtype", "fp8"], "invalid choice: 'fp8'"),
])
def test_flags_use_initializes_parsers(argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert message in capsys.readouterr().err
    # the choices are initialize's own lists
    actions = parser._option_string_actions
    assert actions["--opt-level"].choices == ampx.options.values.OPT_LEVELS
    assert actions["--amp-dtype"].choices == ampx.options.values.DTYPE_CHOICES
