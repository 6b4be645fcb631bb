"""The `ampx` command line: argument errors, run (in-process, subprocess, torchrun), info,
lists and build-ext."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ampx
from ampx import frontend
from ampx.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("AMPX_TELEMETRY", None)
    return env


def _ampx(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ampx", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- argument errors: exit 2, one line -----------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["run", "-O", "O4", "x.py"], "unknown opt level 'O4'"),
    (["run", "-O", "01", "x.py"], "letter O, not the number zero"),
    (["run", "--dtype", "fp8", "x.py"], "unknown dtype 'fp8'"),
    (["run", "--loss-scale", "-3", "x.py"], "must be a positive finite number"),
    (["run", "-O", "O2", "missing_script.py"], "script not found: missing_script.py"),
    (["run", "-O", "O1", "--keep-batchnorm-fp32", "x.py"], "keep_batchnorm_fp32 should be None"),
    (["run", "--min-loss-scale", "8", "--max-loss-scale", "4", "x.py"], "min_loss_scale"),
    (["run"], "required: SCRIPT"),
    (["sweep", "--levels", "O1,O5"], "unknown opt level 'O5'"),
    (["sweep", "--dtypes", "fp32"], "unknown dtype 'fp32'"),
    (["sweep", "no_such_script.py"], "script not found"),
    (["sweep", "--budget", "2 m"], "'2 m' is not a duration: write it like 90s, 2m or 5m"),
    (["lists", "--level", "O9"], "unknown opt level 'O9'"),
    (["lists", "--policy", "sometimes"], "unknown policy 'sometimes'"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_argument_errors_exit_2_with_one_line(argv: list[str], fragment: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ampx: error: ")
    assert err.count("\n") == 1
    assert fragment in err


@pytest.mark.parametrize("command", ["run", "sweep", "selftest", "info", "lists", "build-ext"])
def test_every_subcommand_help_has_an_example(command: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "example" in out
    assert f"ampx {command}" in out


HELP_PROBE = textwrap.dedent("""
    import sys

    from ampx.cli import main as cli

    for argv in (["--help"], ["run", "--help"], ["sweep", "--help"], ["selftest", "--help"],
                 ["--version"]):
        assert cli.main(argv) == 0
    print("TORCH", sorted(name for name in sys.modules if name.split(".")[0] == "torch")[:3])
""")


def test_help_imports_no_torch(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    # the package, the parser, the dispatch and every --help import no torch (fast help)
    assert proc.stdout.splitlines()[-1] == "TORCH []"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ampx", "--help"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ampx")
    assert " torch" not in proc.stderr  # -X importtime lists every module imported


def test_python_dash_m_ampx_docs_help_is_help(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ampx._docs", "--help"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m ampx._docs")
    assert "cast-lists" in proc.stdout and "# O1 cast lists" not in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "ampx._docs", "nothing"], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: python -m ampx._docs")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ampx {ampx.__version__}"


# -- ampx run, in-process ------------------------------------------------------------------------

PROBE_SCRIPT = textwrap.dedent("""
    import sys
    import ampx.frontend
    print("argv", sys.argv)
    print("file", __file__)
    print("path0", sys.path[0])
    print("name", __name__)
    print("forced", sorted(ampx.frontend.forced_options().jsonable().items()))
    code = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if code == 99:
        raise ValueError("boom from the script")
    sys.exit(code)
""")


def test_run_sets_up_main_like_python(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    argv_before, path0_before = list(sys.argv), sys.path[0]
    assert cli.main(["run", "-q", "-O", "O3", "--dtype", "bf16", str(script), "0",
                     "-O", "script-option"]) == 0
    out = capsys.readouterr().out
    assert f"argv ['{script}', '0', '-O', 'script-option']" in out
    assert f"file {script}" in out
    assert f"path0 {tmp_path}" in out
    assert "name __main__" in out
    assert "forced [('dtype', 'bfloat16'), ('opt_level', 'O3')]" in out
    # everything is put back
    assert sys.argv == argv_before and sys.path[0] == path0_before
    assert not frontend.forced_options()


def test_run_passes_exit_codes_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    assert cli.main(["run", str(script), "3"]) == 3
    assert cli.main(["run", str(script), "99"]) == 1
    err = capsys.readouterr().err
    assert "ValueError: boom from the script" in err
    assert "cli.py" not in err  # the traceback starts in the script
    assert str(script) in err


def test_run_disable_and_loss_scale_overrides(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    assert cli.main(["run", "-q", "--disable", "--loss-scale", "128", "--max-loss-scale", "1024",
                     "--no-master-weights", str(script)]) == 0
    out = capsys.readouterr().out
    assert ("forced [('enabled', False), ('loss_scale', 128.0), ('master_weights', False), "
            "('max_loss_scale', 1024.0)]") in out


def test_run_module_like_python_dash_m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(PROBE_SCRIPT)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "-m", "mypkg.train", "5"]) == 5
    out = capsys.readouterr().out
    assert f"file {package / 'train.py'}" in out and "name __main__" in out
    assert f"path0 {tmp_path}" in out


LEGACY_SCRIPT = textwrap.dedent("""
    import argparse
    import sys

    import torch
    import apex
    from apex import amp

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    for step in range(args.steps):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        print("step", step, flush=True)
    scaler = apex.amp._amp_state.loss_scalers[0]
    print("scale", scaler.loss_scale(), scaler._unskipped)
    scaler._loss_scale = 512.0
    state = amp.state_dict()
    print("state", sorted(state), state["loss_scaler0"]["loss_scale"])
    print("weights", next(model.parameters()).dtype)
""")


def test_run_max_steps_stops_the_script(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "legacy.py"
    script.write_text(LEGACY_SCRIPT)
    telemetry = tmp_path / "t.jsonl"
    assert cli.main(["run", "-q", "-O", "O0", "--max-steps", "2", "--telemetry-file",
                     str(telemetry), str(script), "--steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "step 1" in out and "step 2" not in out
    assert [r["event"] for r in _records(telemetry)] == ["init", "step", "step"]
    assert "AMPX_TELEMETRY" not in os.environ


# -- ampx run, real processes --------------------------------------------------------------------

@pytest.mark.slow
def test_unmodified_apex_script_runs_at_forced_o2_bf16(tmp_path: Path) -> None:
    script = tmp_path / "legacy.py"
    script.write_text(LEGACY_SCRIPT)
    telemetry = tmp_path / "run.jsonl"
    proc = _ampx("run", "-O", "O2", "--dtype", "bf16", "--telemetry-file", str(telemetry),
                 str(script), "--steps", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "weights torch.bfloat16" in proc.stdout
    assert "state ['loss_scaler0'] 512.0" in proc.stdout
    # the script's own value is logged next to the override that replaced it
    assert "script passed 'O1', using 'O2'" in proc.stderr

    records = _records(telemetry)
    init = records[0]
    assert init["event"] == "init"
    assert (init["opt_level"], init["dtype"]) == ("O2", "bfloat16")
    assert init["requested"]["opt_level"] == "O1"
    assert init["forced"] == {"opt_level": "O2", "dtype": "bfloat16"}
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == 3
    for record in steps:
        assert record["loss"] > 0 and record["step_time_s"] > 0
        assert record["peak_mem_bytes"] > 0 and record["skipped"] is False


@pytest.mark.slow
def test_run_exit_code_and_crash_in_a_process(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    assert _ampx("run", str(script), "7", cwd=tmp_path).returncode == 7
    proc = _ampx("run", str(script), "99", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("ValueError: boom from the script")


DDP_SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from apex import amp

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for _ in range(3):
        loss = ddp(torch.randn(4, 8)).float().pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    print(f"rank {dist.get_rank()} done {next(model.parameters()).dtype}", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_run_under_torchrun_two_cpu_ranks(tmp_path: Path) -> None:
    """`ampx run` under torchrun: two gloo ranks train and exit cleanly.

    This once failed 1 run in 5 on a loaded machine, both ranks done and then SIGABRT
    ("terminate called without an active exception"). A core dump showed gloo's worker
    thread freeing ampx's per-step overflow flag (the last step's all-reduce) while the
    interpreter was finalizing; ampx.distributed now waits for gloo to let go of the flag.
    benchmarks/stress_distributed.sh runs this test in a loop under load.
    """
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    telemetry = tmp_path / "ddp.jsonl"
    env = _env()
    env["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # no dependence on how the host name resolves
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ampx", "run", "-q", "-O", "O2", "--dtype", "bf16", "--telemetry-file",
         str(telemetry), str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 done torch.bfloat16" in proc.stdout
    assert "rank 1 done torch.bfloat16" in proc.stdout
    for path, rank in ((telemetry, 0), (Path(f"{telemetry}.1"), 1)):
        records = _records(path)
        assert records[0]["rank"] == rank and records[0]["opt_level"] == "O2"
        assert sum(r["event"] == "step" for r in records) == 3


# -- ampx info / lists / build-ext ---------------------------------------------------------------

@pytest.mark.kernel_backend  # `ampx info` reports the backend
def test_info_reports_versions_devices_and_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"ampx   {ampx.__version__}" in out
    assert "torch" in out and "python" in out and "kernels:" in out
    assert "cpu" in out and "bf16" in out

    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    cpu = info["devices"][0]
    assert cpu["device"] == "cpu" and {"fp16", "bf16", "flags"} <= set(cpu)
    assert "backend" in info["kernels"]


def test_cpu_support_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampx.cli import info

    assert info.cpu_support({"amx_tile": True, "avx512_bf16": True})["bf16"] == \
        "native (AMX-BF16)"
    assert info.cpu_support({"avx512_bf16": True})["bf16"] == "native (AVX512-BF16)"
    assert info.cpu_support({"avx2": True, "avx512_bf16": False})["bf16"].startswith("emulated")
    assert info.cpu_support({"amx_fp16": True})["fp16"] == "native (AMX-FP16)"
    # the features are torch's own probes, not /proc/cpuinfo
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    features = info.cpu_features()
    assert features["avx512_bf16"] is True and features["amx_tile"] is False


def test_lists_o1_shows_what_each_function_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["lists", "--level", "O1", "--dtype", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    assert rows["torch.nn.functional.linear"] == ["lower", "bfloat16"]
    assert rows["torch.Tensor.__matmul__"][:2] == ["lower", "bfloat16"]
    assert rows["torch.nn.functional.softmax"] == ["fp32", "float32"]

    assert cli.main(["lists", "--json", "--policy", "fp32", "--dtype", "fp16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dtype"] == "float16" and data["patched"]
    assert {entry["policy"] for entry in data["patched"]} == {"fp32"}


@pytest.mark.kernel_backend  # `ampx info` reports the backend
@pytest.mark.parametrize("amx_fp16, expected", [(False, "bfloat16"), (True, "float16")])
def test_lists_defaults_to_the_dtype_info_advises(amx_fp16: bool, expected: str,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from ampx.cli import info

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(info, "cpu_features", lambda: {"avx2": True, "amx_fp16": amx_fp16})
    assert cli.main(["info", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)["devices"][0]["fp16"]
    assert advice.startswith("native") == amx_fp16  # "emulated (slow: prefer bf16 ...)"
    assert cli.main(["lists", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == expected


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_lists_other_levels_patch_nothing(level: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["lists", "--level", level, "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{level}: nothing is patched")
    if level != "O0":
        assert "cast to bfloat16" in out


def test_build_ext_reports_success_and_failure(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from ampx import _build

    built = tmp_path / "ampx_C.so"
    monkeypatch.setattr(_build, "build", lambda verbose=False, progress=None: built)
    assert cli.main(["build-ext"]) == 0
    assert str(built) in capsys.readouterr().out

    def fail(verbose: bool = False, progress: object = None) -> Path:
        raise RuntimeError("no compiler found\nlong log ...")

    monkeypatch.setattr(_build, "build", fail)
    assert cli.main(["build-ext"]) == 1
    err = capsys.readouterr().err
    assert "build failed: no compiler found" in err and "long log" not in err


@pytest.mark.slow
def test_info_and_lists_as_processes(tmp_path: Path) -> None:
    proc = _ampx("info", cwd=tmp_path)
    assert proc.returncode == 0 and "kernels:" in proc.stdout
    proc = _ampx("lists", "--level", "O1", "--dtype", "bf16", cwd=tmp_path)
    assert proc.returncode == 0 and "torch.matmul" in proc.stdout
    proc = _ampx("run", "-O", "O7", "x.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("ampx: error: ") and proc.stderr.count("\n") == 1


def test_ctrl_c_in_any_subcommand_exits_130_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ampx.cli import info

    def interrupted() -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(info, "collect_info", interrupted)
    assert cli.main(["info"]) == 130
    err = capsys.readouterr().err
    assert err == "ampx info: interrupted\n"
