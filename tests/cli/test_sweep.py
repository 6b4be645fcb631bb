"""`ampx sweep`: metrics, table and files, orchestration with a fake script, and real runs."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ampx import telemetry
from ampx.cli import main as cli
from ampx.cli import sweep
from ampx.cli.sweep import SweepConfig
from ampx.cli.sweep import command as sweep_command
from ampx.cli.sweep import plan as sweep_plan
from ampx.cli.sweep import plot as sweep_plot
from ampx.cli.sweep import probe as sweep_probe
from ampx.cli.sweep import report as sweep_report
from ampx.cli.sweep import rounds as sweep_rounds
from ampx.cli.sweep import run as sweep_run
from ampx.cli.sweep import stats as sweep_stats
from ampx.cli.sweep.stats import Row

ROOT = Path(__file__).resolve().parents[2]


def _steps(losses: list[float], *, step_time: float = 0.1, scale: float = 1.0,
           mem: int = 100 * 2**20, skipped: tuple[int, ...] = ()) -> list[dict]:
    return [{"event": "step", "step": i + 1, "optimizer": 0, "step_time_s": step_time,
             "loss": loss, "loss_scale": scale, "skipped": i in skipped, "peak_mem_bytes": mem}
            for i, loss in enumerate(losses)]


def _row(label: str, level: str, dtype: str | None, steps: list[dict]) -> Row:
    row = Row(label=label, opt_level=level, dtype=dtype, status="ok")
    return sweep_stats.summarize(row, {"event": "init"}, steps)


def test_build_configs_runs_o0_once_first() -> None:
    configs = sweep.build_configs(["O1", "O0", "O3"], ["fp16", "bf16"], autocast=True)
    assert [c.label for c in configs] == ["O0", "O1 fp16", "O1 bf16", "O3 fp16", "O3 bf16",
                                          "autocast fp16", "autocast bf16"]
    assert configs[-1].autocast and configs[-1].slug == "autocast-bf16"
    assert [c.label for c in sweep.build_configs(["O2"], ["bf16"], autocast=False)] == ["O2 bf16"]


def test_summarize_and_compare_against_o0() -> None:
    base = _row("O0", "O0", None, _steps([4.0] * 9 + [2.0], step_time=0.2, mem=200 * 2**20))
    fast = _row("O2 bf16", "O2", "bf16",
                _steps([4.0] * 9 + [2.2], step_time=0.1, scale=128.0, skipped=(0, 1)))
    nan = _row("O3 bf16", "O3", "bf16", _steps([4.0] * 9 + [math.nan]))
    huge = _row("O1 bf16", "O1", "bf16", _steps([4.0] * 9 + [25.0]))
    crashed = Row(label="O3 fp16", opt_level="O3", dtype="fp16", status="error",
                  error="exit 1: RuntimeError: boom")
    rows = [base, fast, nan, huge, crashed]
    sweep_stats.compare(rows)

    assert base.speedup == 1.0 and base.loss_delta == 0.0
    assert fast.speedup == pytest.approx(2.0)
    assert fast.mem_ratio == pytest.approx(0.5)
    assert fast.final_loss == pytest.approx(2.2)  # mean of the last 10% (one step here)
    assert fast.loss_delta == pytest.approx(0.1)
    assert (fast.skipped, fast.final_scale, fast.status) == (2, 128.0, "ok")
    assert nan.status == "diverged" and "nan" in (nan.error or "")
    assert huge.status == "diverged"  # > 10x O0's final loss
    assert crashed.speedup is None

    table = sweep_report.format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["config", "status", "speed-up"]
    assert lines[3].split()[:3] == ["O2", "bf16", "ok"]
    assert "2.00x" in lines[3] and "+10.00%" in lines[3] and "0.50x" in lines[3]
    assert "O3 fp16: error: exit 1: RuntimeError: boom" in table
    assert "O3 bf16: diverged: final loss nan" in table


def test_table_notes_noisy_timings() -> None:
    steady = _row("O0", "O0", None, _steps([1.0] * 12, step_time=0.5))
    records = _steps([1.0] * 12)
    for i, record in enumerate(records):
        record["step_time_s"] = 0.1 if i % 2 else 0.9
    noisy = _row("O2 bf16", "O2", "bf16", records)
    rows = [steady, noisy]
    sweep_stats.compare(rows)
    assert steady.step_time_spread == pytest.approx(1.0)
    assert noisy.step_time_spread is not None and noisy.step_time_spread > 5
    table = sweep_report.format_table(rows)
    assert "O2 bf16: note: step times varied" in table and "O0: note" not in table
    assert "--repeat" in table


def test_compare_without_o0_only_flags_non_finite() -> None:
    rows = [_row("O2 bf16", "O2", "bf16", _steps([1.0, 50.0])),
            _row("O3 bf16", "O3", "bf16", _steps([1.0, math.inf]))]
    sweep_stats.compare(rows)
    assert [r.status for r in rows] == ["ok", "diverged"]
    assert rows[0].speedup is None


def test_read_telemetry_skips_torn_lines_and_keeps_the_last_session(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    records = [{"event": "init", "opt_level": "O1"}, *_steps([9.0]),
               {"event": "init", "opt_level": "O2"}, *_steps([1.0, 2.0])]
    records.append({**records[-1], "optimizer": 1})
    path.write_text("\n".join(json.dumps(r) for r in records) + '\n{"event": "st')
    init, steps = telemetry.read_telemetry(path)
    assert init == {"event": "init", "opt_level": "O2"}
    assert [s["loss"] for s in steps] == [1.0, 2.0]
    assert telemetry.read_telemetry(tmp_path / "missing.jsonl") == (None, [])


def test_command_for_example_and_user_script(tmp_path: Path) -> None:
    spec = sweep.SweepSpec(script=tmp_path / "ex.py", script_args=["--x"], configs=[],
                           out=tmp_path, steps=5, example="transformer",
                           run_options=["--quiet"])
    cmd = sweep.command_for(spec, SweepConfig("O2", "bf16"), tmp_path / "t.jsonl")
    assert cmd[1:4] == ["-m", "ampx", "run"]
    assert cmd[cmd.index("--opt-level") + 1] == "O2" and cmd[cmd.index("--dtype") + 1] == "bf16"
    assert cmd[-4:] == [str(tmp_path / "ex.py"), "--x", "--steps", "5"]
    auto = sweep.command_for(spec, SweepConfig(None, "bf16"), tmp_path / "t.jsonl")
    assert "--opt-level" not in auto and auto[-3:] == ["--autocast", "--dtype", "bf16"]
    spec.example = None
    user = sweep.command_for(spec, SweepConfig("O0", None), tmp_path / "t.jsonl")
    assert user[-2:] == [str(tmp_path / "ex.py"), "--x"] and "--dtype" not in user
    assert user[user.index("--max-steps") + 1] == "5"


FAKE_SCRIPT = textwrap.dedent("""
    # Stands in for `ampx run`: writes telemetry the way ampx would, per configuration.
    import json, os, sys
    level, dtype = sys.argv[1], sys.argv[2]
    if level == "O3":
        print("Traceback (most recent call last):", file=sys.stderr)
        print("RuntimeError: O3 exploded", file=sys.stderr)
        sys.exit(1)
    with open(os.environ["AMPX_TELEMETRY"], "a") as f:
        f.write(json.dumps({"event": "init", "opt_level": level, "dtype": dtype}) + "\\n")
        for i in range(5):
            loss = float("nan") if level == "O2" and i == 4 else 5.0 - i
            f.write(json.dumps({"event": "step", "step": i + 1, "optimizer": 0,
                                "step_time_s": 0.2 if level == "O0" else 0.1, "loss": loss,
                                "loss_scale": 65536.0, "skipped": False,
                                "peak_mem_bytes": 2**20}) + "\\n")
""")


def test_run_sweep_with_a_fake_script_keeps_going_after_failures(tmp_path: Path) -> None:
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE_SCRIPT)
    spec = sweep.SweepSpec(script=fake, script_args=[], out=tmp_path / "out",
                           configs=sweep.build_configs(["O0", "O1", "O2", "O3"], ["bf16"],
                                                       autocast=False))

    def launcher(config: SweepConfig, telemetry: Path) -> list[str]:
        return [sys.executable, str(fake), config.opt_level or "-", config.dtype or "-"]

    progress: list[str] = []
    rows = sweep.run_sweep(spec, progress=progress.append, launcher=launcher)
    assert [(r.label, r.status) for r in rows] == [
        ("O0", "ok"), ("O1 bf16", "ok"), ("O2 bf16", "diverged"), ("O3 bf16", "error")]
    assert rows[1].speedup == pytest.approx(2.0)
    assert rows[3].error == "exit 1: RuntimeError: O3 exploded"
    assert len(progress) == 8 and progress[-1].startswith("[4/4] O3 bf16: error")
    assert Path(rows[3].log or "").read_text().strip().endswith("O3 exploded")

    out = tmp_path / "out"
    data = json.loads(sweep_report.write_json(rows, out / "sweep.json", {"steps": 5}).read_text())
    assert data["meta"] == {"steps": 5}
    assert data["rows"][2]["series"]["loss"][-1] == "nan"
    with open(sweep_report.write_csv(rows, out / "sweep.csv"), newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["status"] for r in table] == ["ok", "ok", "diverged", "error"]
    png = sweep_plot.write_png(rows, out / "sweep.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_repeat_keeps_the_fastest_run_and_any_failure(tmp_path: Path) -> None:
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE_SCRIPT)
    spec = sweep.SweepSpec(script=fake, script_args=[], out=tmp_path / "out", repeat=2,
                           configs=sweep.build_configs(["O0", "O3"], ["bf16"], autocast=False))
    progress: list[str] = []
    rows = sweep.run_sweep(spec, progress=progress.append, launcher=lambda config, _: [
        sys.executable, str(fake), config.opt_level or "-", config.dtype or "-"])
    assert [(r.label, r.status) for r in rows] == [("O0", "ok"), ("O3 bf16", "error")]
    # every other round runs in reverse order, so a drift in machine speed hits both alike
    started = [line.split(":")[0] for line in progress if line.endswith(": running")]
    assert started == ["[1/4] O0", "[2/4] O3 bf16", "[3/4] O3 bf16", "[4/4] O0"]
    assert progress[-1].startswith("[4/4] O0: ok")
    assert (tmp_path / "out" / "runs" / "O0.2.jsonl").exists()


def test_write_png_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert sweep_plot.write_png([], tmp_path / "sweep.png") is None


CRASHING_SCRIPT = textwrap.dedent("""
    import torch
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    if amp._amp_state.opt_properties.opt_level == "O3":
        raise RuntimeError("this script cannot run at O3")
    for _ in range(100):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
""")


@pytest.mark.slow
def test_cli_sweep_user_script_with_a_crashing_configuration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(CRASHING_SCRIPT)
    out = tmp_path / "out"
    assert cli.main(["sweep", str(script), "--levels", "O0,O3", "--steps", "4", "--out",
                     str(out), "--no-plot"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split()[:2] == ["config", "status"]
    status = {" ".join(line.split()[:2]): line.split()[2] for line in lines[2:4]}
    assert status == {"O0 ok": "1.00x", "O3 bf16": "error"}
    assert "O3 bf16: error: exit 1: RuntimeError: this script cannot run at O3" in captured.out
    assert "[2/2] O3 bf16: error" in captured.err
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [r["steps"] for r in rows] == [4, 0]  # --max-steps stopped the 100-step loop
    assert (out / "sweep.csv").exists() and not (out / "sweep.png").exists()


@pytest.mark.slow
def test_sweep_builtin_example_as_a_process(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ampx", "sweep", "--example", "transformer", "--levels", "O0,O2",
         "--steps", "3", "--out", str(out), "--", "--d-model", "64", "--layers", "1",
         "--seq-len", "16", "--batch-size", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    labels = [line.split()[0:2] for line in proc.stdout.splitlines()[2:5]]
    assert labels == [["O0", "ok"], ["O2", "bf16"], ["autocast", "bf16"]]
    # no row failed ("error" alone would match the verdict's "standard errors")
    assert ": error:" not in proc.stdout and "diverged" not in proc.stdout
    for name in ("sweep.json", "sweep.csv", "sweep.png"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "sweep.json").read_text())
    rows = data["rows"]
    assert [r["steps"] for r in rows] == [3, 3, 3]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok"]
    assert rows[1]["init"]["dtype"] == "bfloat16" and rows[2]["init"]["opt_level"] == "autocast"
    # real text, held out by file, evaluated after every step (3 steps: too short to judge)
    assert data["meta"]["data"]["name"] == "stdlib" and data["meta"]["data"]["synthetic"] is False
    for row in rows:
        assert set(row["heldout"]) == {"loss"} and [s for s, _ in row["series"]["heldout"]] == [
            1, 2, 3]
        assert row["accuracy_verdict"] == "too-short" and "time_to_quality_s" in row
    assert "too short to judge O2 bf16, autocast bf16" in proc.stdout


# -- trust: load, spread, marking --------------------------------------------------------------

def test_speedup_range_comes_from_the_quartiles() -> None:
    base = _row("O0", "O0", None, _steps([1.0] * 9, step_time=0.2))
    fast = _row("O2 bf16", "O2", "bf16", _steps([1.0] * 9, step_time=0.1))
    base.step_time_q1, base.step_time_q3 = 0.18, 0.22
    fast.step_time_q1, fast.step_time_q3 = 0.09, 0.12
    sweep_stats.compare([base, fast])
    assert fast.speedup == pytest.approx(2.0)
    assert fast.speedup_low == pytest.approx(0.18 / 0.12)
    assert fast.speedup_high == pytest.approx(0.22 / 0.09)
    line = sweep_report.format_table([base, fast]).splitlines()[3]
    assert "2.00x" in line and "1.50-2.44" in line and "steady" in line


def test_rows_run_while_other_processes_load_the_machine_are_unreliable() -> None:
    base = _row("O0", "O0", None, _steps([1.0] * 9, step_time=0.2))
    fast = _row("O2 bf16", "O2", "bf16", _steps([1.0] * 9, step_time=0.1))
    base.other_cpus, base.load_avg = 64.0, 70.0  # far above any machine's 10%
    fast.other_cpus = 0.0
    rows = [base, fast]
    sweep_stats.compare(rows)
    assert base.unreliable is not None and "other processes used 64.0" in base.unreliable
    # O2's own run was quiet, but its speed-up divides by O0's disturbed time
    assert fast.unreliable is not None and fast.unreliable.startswith("O0's run was disturbed")
    table = sweep_report.format_table(rows)
    assert table.splitlines()[2].split()[4] == "UNRELIABLE"
    assert "O0: note: other processes used 64.0" in table and "--repeat" in table
    base.other_cpus = 0.0
    sweep_stats.compare(rows)
    assert base.unreliable is None and fast.unreliable is None
    assert "UNRELIABLE" not in sweep_report.format_table(rows)


def test_load_meter_subtracts_its_own_and_the_runs_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 104.0])
    busy = iter([1000.0, 1010.0])  # the machine was busy 10 CPU-seconds
    ours = iter([50.0, 54.0])  # 4 of them were this process and the run
    monkeypatch.setattr(sweep_stats.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(sweep_stats, "_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(sweep_stats.LoadMeter, "_our_cpu", staticmethod(lambda: next(ours)))
    meter = sweep_stats.LoadMeter()
    row = Row(label="O0", opt_level="O0", dtype=None)
    meter.finish(row)
    assert row.other_cpus == pytest.approx(6.0 / 4.0)  # others: 6 CPU-seconds in 4 s
    assert row.load_avg is not None


def test_load_meter_reads_this_machine() -> None:
    meter = sweep_stats.LoadMeter()
    row = Row(label="O0", opt_level="O0", dtype=None)
    sum(i * i for i in range(200_000))  # this process's own work is not "other load"
    meter.finish(row)
    assert row.other_cpus is not None and row.other_cpus >= 0.0


def test_progress_draws_a_bar_on_a_tty_and_lines_otherwise() -> None:
    import io

    config = SweepConfig("O1", "bf16")
    tty = io.StringIO()
    bar = sweep_report.Progress(tty, tty=True)
    bar.steps(config, 10, 40, 0.25)
    bar.line("[1/2] O1 bf16: ok")
    assert tty.getvalue().startswith("\r  O1 bf16: [#######.......................] 10/40 steps, "
                                     "250 ms/step")
    assert tty.getvalue().endswith("\n[1/2] O1 bf16: ok\n")
    log = io.StringIO()
    lines = sweep_report.Progress(log, tty=False, interval_s=0.0)
    lines.steps(config, 3, None, None)
    lines.steps(config, 4, None, 0.5)
    assert log.getvalue() == "  O1 bf16: 3 steps\n  O1 bf16: 4 steps, 500 ms/step\n"


SLOW_FAKE = textwrap.dedent("""
    # Writes one step record every 0.3 s; the O1 run never ends on its own.
    import json, os, sys, time
    level = sys.argv[1]
    with open(os.environ["AMPX_TELEMETRY"], "a") as f:
        f.write(json.dumps({"event": "init", "opt_level": level}) + "\\n")
        for i in range(10_000 if level == "O1" else 4):
            f.write(json.dumps({"event": "step", "step": i + 1, "optimizer": 0,
                                "step_time_s": 0.3, "loss": 1.0, "loss_scale": 1.0,
                                "skipped": False, "peak_mem_bytes": 2**20}) + "\\n")
            f.flush()
            time.sleep(0.3)
""")


def _slow_launcher(fake: Path) -> sweep.Launcher:
    return lambda config, _: [sys.executable, str(fake), config.opt_level or "-"]


STEP_BY_STEP_FAKE = textwrap.dedent("""
    # Writes step i + 1 once the sweep has reported step i (the test's on_steps writes the
    # count it saw to sys.argv[1]): progress is seen step by step whatever the machine's load.
    import json, os, sys, time
    ack = sys.argv[1]
    with open(os.environ["AMPX_TELEMETRY"], "a") as f:
        f.write(json.dumps({"event": "init", "opt_level": "O0"}) + "\\n")
        for i in range(4):
            f.write(json.dumps({"event": "step", "step": i + 1, "optimizer": 0,
                                "step_time_s": 0.3, "loss": 1.0, "loss_scale": 1.0,
                                "skipped": False, "peak_mem_bytes": 2**20}) + "\\n")
            f.flush()
            deadline = time.monotonic() + 120
            while i < 3 and time.monotonic() < deadline and not (
                    os.path.exists(ack) and open(ack).read() == str(i + 1)):
                time.sleep(0.02)
""")


def test_step_progress_is_reported_while_a_run_goes(tmp_path: Path) -> None:
    fake = tmp_path / "steps.py"
    fake.write_text(STEP_BY_STEP_FAKE)
    ack = tmp_path / "ack"
    spec = sweep.SweepSpec(script=fake, script_args=[], out=tmp_path / "out", steps=4,
                           configs=[SweepConfig("O0", None)], timeout_s=300)
    seen: list[tuple[int, int | None]] = []

    def on_steps(config: SweepConfig, done: int, total: int | None, step_s: float | None) -> None:
        seen.append((done, total))
        ack.write_text(str(done))

    rows = sweep.run_sweep(spec, launcher=lambda config, _: [sys.executable, str(fake), str(ack)],
                           on_steps=on_steps)
    assert rows[0].status == "ok" and rows[0].steps == 4
    assert seen[:3] == [(1, 4), (2, 4), (3, 4)]  # one report per step, the expected total


def test_ctrl_c_stops_the_run_and_keeps_what_finished(tmp_path: Path) -> None:
    """Ctrl-C (a real SIGINT to this process) as soon as the endless O1 run has reported a
    step: the run is stopped, O0's row is kept and O2 is listed as not run. Event-driven: no
    timer, no progress text to match; the run's limit only bounds a failure."""
    import signal

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    fake = tmp_path / "slow.py"
    fake.write_text(SLOW_FAKE)
    spec = sweep.SweepSpec(script=fake, script_args=[], out=tmp_path / "out", timeout_s=300,
                           configs=sweep.build_configs(["O0", "O1", "O2"], ["bf16"],
                                                       autocast=False))

    def on_steps(config: SweepConfig, done: int, total: int | None, step_s: float | None) -> None:
        if config.label == "O1 bf16":  # press Ctrl-C once the endless O1 run has stepped
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(sweep.SweepInterrupted) as caught:
        sweep.run_sweep(spec, launcher=_slow_launcher(fake), on_steps=on_steps)
    rows = caught.value.rows
    assert [(r.label, r.status) for r in rows] == [
        ("O0", "ok"), ("O1 bf16", "interrupted"), ("O2 bf16", "not run")]
    assert rows[1].steps >= 1 and rows[1].returncode is None  # stopped, not waited for
    # the stopped run's loss after a few steps is not a result; the unstarted row is listed
    assert rows[1].final_loss is None and rows[1].step_time_s is None
    assert "steps done" in (rows[1].error or "")
    table = sweep_report.format_table(rows)
    assert "O2 bf16: not run: not started: the sweep was interrupted first" in table
    assert table.splitlines()[4].split()[:4] == ["O2", "bf16", "not", "run"]


def test_cli_ctrl_c_writes_partial_results_and_exits_130(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    done = _row("O0", "O0", None, _steps([1.0] * 4))
    stopped = Row(label="O1 bf16", opt_level="O1", dtype="bf16", status="interrupted",
                  error="stopped by Ctrl-C")

    def interrupted(*args: object, **kwargs: object) -> list[Row]:
        raise sweep.SweepInterrupted([done, stopped])

    monkeypatch.setattr(sweep_rounds, "run_sweep", interrupted)
    monkeypatch.setattr(sweep_command, "probe", lambda kernels, dtypes: _fake_probe(1.0))
    out = tmp_path / "out"
    assert cli.main(["sweep", str(script), "--levels", "O0,O1", "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "interrupted" in captured.err
    assert "O1 bf16: interrupted: stopped by Ctrl-C" in captured.out
    data = json.loads((out / "sweep.json").read_text())
    assert data["meta"]["interrupted"] is True
    assert [r["status"] for r in data["rows"]] == ["ok", "interrupted"]
    assert (out / "sweep.csv").exists() and (out / "sweep.png").exists()


# -- the figure -----------------------------------------------------------------------------

def _titles(fig: object) -> list[str]:
    return [ax.get_title() for ax in fig.axes]  # type: ignore[attr-defined]


def test_figure_panels_styles_and_marks() -> None:
    base = _row("O0", "O0", None, _steps([3.0, 2.0, 1.0], step_time=0.2))
    o1 = _row("O1 bf16", "O1", "bf16", _steps([3.0, 2.0, 1.1], step_time=0.1))
    o2 = _row("O2 bf16", "O2", "bf16", _steps([3.0, 2.1, 1.0], step_time=0.1))
    rows = [base, o1, o2]
    sweep_stats.compare(rows)
    fig = sweep_plot.build_figure(rows, "t")
    titles = _titles(fig)
    assert not any("loss scale" in t for t in titles)  # bf16 at a static 1.0: no panel
    assert any("process peak RSS" in t for t in titles)
    loss_ax = fig.axes[titles.index("loss")]
    styles = {(line.get_linestyle(), line.get_marker()) for line in loss_ax.get_lines()}
    assert len(styles) == 3  # every configuration looks different, not only by colour
    assert "UNRELIABLE" not in fig._suptitle.get_text()

    o1.other_cpus = 64.0
    scaled = _row("O1 fp16", "O1", "fp16", _steps([3.0, 2.0, 1.0], scale=65536.0))
    rows = [base, o1, o2, scaled]
    sweep_stats.compare(rows)
    fig = sweep_plot.build_figure(rows, "t", device="cuda")
    assert "loss scale" in _titles(fig)
    assert any("CUDA max allocated" in t for t in _titles(fig))
    assert "TIMINGS UNRELIABLE for O1 bf16" in fig._suptitle.get_text()


def test_figure_of_an_all_failed_sweep_lists_the_failures(tmp_path: Path) -> None:
    rows = [Row(label="O0", opt_level="O0", dtype=None, status="error", error="exit 1: boom"),
            Row(label="O2 bf16", opt_level="O2", dtype="bf16", status="timeout")]
    fig = sweep_plot.build_figure(rows, "t")
    assert len(fig.axes) == 1
    text = fig.axes[0].texts[0].get_text()
    assert "No configuration finished" in text and "O0: error: exit 1: boom" in text
    png = sweep_plot.write_png(rows, tmp_path / "sweep.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


ENDLESS_SCRIPT = textwrap.dedent("""
    # Writes a step record every 0.2 s until it is stopped.
    import json, os, time
    with open(os.environ["AMPX_TELEMETRY"], "a") as f:
        f.write(json.dumps({"event": "init", "opt_level": "O0"}) + "\\n")
        step = 0
        while True:
            step += 1
            f.write(json.dumps({"event": "step", "step": step, "optimizer": 0,
                                "step_time_s": 0.2, "loss": 1.0, "loss_scale": 1.0,
                                "skipped": False, "peak_mem_bytes": 2**20}) + "\\n")
            f.flush()
            time.sleep(0.2)
""")


@pytest.mark.slow
def test_sigint_to_a_sweep_process_writes_partial_results(tmp_path: Path) -> None:
    import signal

    script = tmp_path / "endless.py"
    script.write_text(ENDLESS_SCRIPT)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampx", "sweep", str(script), "--levels", "O0,O1", "--out",
         str(out), "--no-plot"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    telemetry_file = out / "runs" / "O0.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
            telemetry_file.exists() and telemetry_file.read_text().count('"event": "step"') >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "O0: interrupted: stopped by Ctrl-C" in stdout
    data = json.loads((out / "sweep.json").read_text())
    assert data["meta"]["interrupted"] is True
    assert data["rows"][0]["status"] == "interrupted" and data["rows"][0]["steps"] >= 3
    assert (out / "sweep.csv").exists()


def test_skip_culprits_come_from_the_overflow_reports() -> None:
    records = _steps([1.0] * 6, skipped=(1, 2, 3, 4))
    records[1]["overflow"] = {"modules": [["fc2", 3], ["fc1", 1]]}
    records[2]["overflow"] = {"modules": [["fc2", 1]]}
    records[3]["overflow"] = {"modules": [["fc1", 2]], "forward_module": "attn"}
    records[5]["overflow"] = {"modules": [["ignored", 1]]}  # not a skipped step
    row = _row("O1 fp16", "O1", "fp16", records)
    assert row.skip_culprits == [["fc2", 2], ["attn", 1]]
    assert "O1 fp16: skipped steps overflowed first in fc2 (2), attn (1)" in \
        sweep_report.format_table([row])


def _fake_probe(slowdown: float, *, native: bool = True,
                kernels: tuple = ()) -> sweep_probe.Probe:
    """A probe that found fp32 at 100 GFLOP/s and bf16 `slowdown` times slower."""
    fp32 = sum(k.flops * k.count for k in kernels) * 1e-11 or 0.01
    return sweep_probe.Probe(
        capability="AVX2" if not native else "AVX512", native={"bf16": native},
        seconds={"fp32": {"1024x512x2048": fp32}, "bf16": {"1024x512x2048": fp32 * slowdown}},
        forward_s={"fp32": fp32, "bf16": fp32 * slowdown}, elapsed_s=0.2)


# -- budget, timeouts, rows without a result --------------------------------------------------

class _EventClock:
    """The sweep's clock (its budget, each run's limit): it stands at 0 until `when()` holds,
    then at `then`. A run times out on an event the test picks, not on the machine's speed."""

    def __init__(self, when: object, then: float) -> None:
        self.when, self.then = when, then

    def monotonic(self) -> float:
        return self.then if self.when() else 0.0  # type: ignore[operator]

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def _steps_in(path: Path, at_least: int) -> bool:
    return path.exists() and path.read_text().count('"event": "step"') >= at_least


def _use_clock(monkeypatch: pytest.MonkeyPatch, clock: _EventClock) -> None:
    for module in (sweep_run, sweep_rounds, sweep_plan):
        monkeypatch.setattr(module, "time", clock)


def test_a_timed_out_row_shows_no_loss_and_the_spent_budget_leaves_rows_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "slow.py"
    fake.write_text(SLOW_FAKE)  # O0 and O2 write 4 steps, O1 never ends
    spec = sweep.SweepSpec(script=fake, script_args=[], out=tmp_path / "out",
                           configs=sweep.build_configs(["O0", "O1", "O2"], ["bf16"],
                                                       autocast=False),
                           timeout_s=None, budget_s=sweep_plan.WRITE_S + 14.0)
    # 14 s of budget: O0 ends on its own; O1's limit (10.5 s) passes once it has stepped,
    # with 1 s left, too little to start O2
    _use_clock(monkeypatch, _EventClock(
        lambda: _steps_in(spec.out / "runs" / "O1-bf16.jsonl", 1), then=13.0))
    progress: list[str] = []
    rows = sweep.run_sweep(spec, progress=progress.append, launcher=_slow_launcher(fake))
    assert [(r.label, r.status) for r in rows] == [
        ("O0", "ok"), ("O1 bf16", "timeout"), ("O2 bf16", "not run")]
    stopped = rows[1]
    assert stopped.steps >= 1 and stopped.final_loss is None and stopped.final_scale is None
    assert stopped.step_time_s is None and stopped.speedup is None and stopped.skipped is None
    assert "steps done" in (stopped.error or "") and "no result" in (stopped.error or "")
    assert rows[2].error == "not started: the 24 s budget was spent"
    assert any(line.endswith("O2 bf16: not run (budget spent)") for line in progress)
    table = sweep_report.format_table(rows)
    cells = sweep_report.table_rows(rows)
    assert cells[2][1] == "timeout" and set(cells[2][2:]) == {"-"}  # no loss, no speed
    assert cells[3][1] == "not run" and set(cells[3][2:]) == {"-"}
    assert "O2 bf16: not run: not started" in table
    out = tmp_path / "out"
    data = json.loads(sweep_report.write_json(rows, out / "sweep.json", {}).read_text())
    assert [r["final_loss"] for r in data["rows"]][1:] == [None, None]
    with open(sweep_report.write_csv(rows, out / "sweep.csv"), newline="") as handle:
        lines = list(csv.DictReader(handle))
    assert [(r["status"], r["final_loss"]) for r in lines][1:] == [("timeout", ""),
                                                                   ("not run", "")]
    fig = sweep_plot.build_figure(rows, "t")
    loss_ax = fig.axes[_titles(fig).index("loss")]
    assert [line.get_label() for line in loss_ax.get_lines()] == ["O0"]  # no partial curve
    labels = [t.get_text() for t in fig.axes[_titles(fig).index(
        next(t for t in _titles(fig) if t.startswith("speed-up")))].get_xticklabels()]
    assert labels == ["O0", "O1 bf16\n(timeout)", "O2 bf16\n(not run)"]


def _sweep_args(**overrides: object) -> argparse.Namespace:
    values: dict[str, object] = dict(
        script=None, example="convnet", dtypes=["bf16"], force_apex_alias=False, script_args=[],
        levels=["O0", "O1"], no_autocast=False, out=Path("out"), steps=None, timeout=None,
        budget=None, repeat=1)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("slowdown", [40.0, 0.5])
def test_the_sweep_says_when_bf16_matmuls_are_emulated_and_plans_for_it(
        slowdown: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a faked probe: emulated bf16 shrinks the example and says so; native keeps it."""
    monkeypatch.setattr(sweep_command, "probe", lambda kernels, dtypes: _fake_probe(
        slowdown, native=slowdown < 2, kernels=tuple(kernels)))
    monkeypatch.setattr(sweep_plan, "contention", lambda: (1.0, 0.2))  # an idle machine
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    budget = 120.0 if slowdown > 2 else sweep_plan.DEFAULT_BUDGET_S
    args = _sweep_args(example="transformer", budget=budget)
    spec = sweep.spec_from_args(args)
    said: list[str] = []
    chosen, found = sweep_command.prepare(spec, args, said.append)
    notes = [line for line in said if "bf16 matmuls are emulated" in line]
    plan_line = next(line for line in said if "plan:" in line)
    assert chosen is not None and found is not None
    if slowdown > 2:
        assert len(notes) == 1 and "40x slower than fp32" in notes[0] and "AVX2" in notes[0]
        assert "no AVX512-BF16/AMX" in notes[0] and "slower than O0, not faster" in notes[0]
        # every size probes as 40x here, so the plan shrinks the model to fit 2 minutes
        assert chosen.size is not None and chosen.size.args and spec.script_args
        assert "the default (d_model 512, 4 layers, 40 steps) would take about" in plan_line
    else:
        assert notes == [] and spec.script_args == [] and spec.steps == 40
    assert chosen.estimate_s is not None and chosen.estimate_s <= budget
    assert set(spec.estimates) == {"O0", "O1 bf16", "autocast bf16"}


def test_the_probe_times_real_shapes_and_scales_slow_ones_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ampx.examples.sizes import Kernel

    found = sweep_probe.probe([Kernel("mm", 64, (32, 48), 2), Kernel("conv", 2, (3, 4, 8, 2))],
                              ["bf16"])
    assert set(found.seconds) == {"fp32", "bf16"} and found.scaled == []
    assert all(math.isfinite(v) and v > 0 for v in found.forward_s.values())
    assert found.capability and isinstance(found.native["bf16"], bool)
    # a product whose time grows with its rows (1 ms a row) is timed on fewer and scaled up
    monkeypatch.setattr(sweep_probe, "_runner",
                        lambda kernel, rows, dtype: lambda: time.sleep(rows * 1e-3))
    seconds, scaled = sweep_probe._time(Kernel("mm", 4096, (512, 512)), None)
    assert scaled and seconds == pytest.approx(4.096, rel=0.5)


def test_durations_and_bad_budgets() -> None:
    parse = sweep_plan.parse_duration
    assert [parse(t) for t in ("90", "90s", "2m", "1m30s", "1.5m", "1h")] == [
        90, 90, 120, 90, 90, 3600]
    for bad in ("", "x", "2 m", "-1m", "0s", "m"):
        with pytest.raises(ValueError):
            parse(bad)
    assert sweep_plan.format_duration(200) == "3 min 20 s"
    proc = subprocess.run([sys.executable, "-m", "ampx", "sweep", "--budget", "soon"],
                          capture_output=True, text=True, timeout=60, check=False,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "ampx: error: argument --budget: 'soon' is not a duration: write it like 90s, 2m or "
        "5m (see 'ampx sweep --help')")


def test_each_run_gets_its_share_of_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweep_plan.time, "monotonic", lambda: 1000.0)
    limit = sweep_plan.run_limit
    assert limit(None, None, [1.0]) is None and limit(None, 50.0, [1.0]) == 50.0
    assert limit(1100.0, None, [10.0, 30.0]) == pytest.approx(1.5 * 25.0)
    assert limit(1100.0, None, [None, 30.0]) == pytest.approx(75.0)  # equal shares
    assert limit(1100.0, None, [90.0, 10.0]) == pytest.approx(100.0)  # never past the deadline
    assert limit(1100.0, 20.0, [10.0, 30.0]) == 20.0


def test_the_ladders_start_at_the_scripts_defaults() -> None:
    from ampx.examples import EXAMPLES, convnet, transformer_lm
    from ampx.examples.sizes import LADDERS, conv_sizes, transformer_sizes

    assert set(LADDERS) == set(EXAMPLES)
    lm = transformer_lm.parse_args([])
    assert LADDERS["transformer"][0].kernels == transformer_sizes(
        lm.d_model, lm.layers, lm.seq_len, lm.batch_size, lm.vocab)
    cn = convnet.parse_args([])
    assert LADDERS["convnet"][0].kernels == conv_sizes(cn.width, cn.batch_size)
    for ladder in LADDERS.values():
        assert ladder[0].args == ()
        flops = [sum(k.flops * k.count for k in size.kernels) for size in ladder]
        assert flops == sorted(flops, reverse=True)  # each size smaller than the one before
    for size in LADDERS["transformer"][1:]:
        parsed = transformer_lm.parse_args(list(size.args))
        assert size.kernels == transformer_sizes(parsed.d_model, parsed.layers, parsed.seq_len,
                                                 parsed.batch_size, parsed.vocab)


def _verdict_rows(o0_ms: float, half_ms: float) -> list[Row]:
    base = _row("O0", "O0", None, _steps([3.0] * 9 + [2.0], step_time=o0_ms / 1e3,
                                         mem=500 * 2**20))
    o1 = _row("O1 bf16", "O1", "bf16", _steps([3.0] * 9 + [2.0], step_time=half_ms / 1e3,
                                              mem=490 * 2**20))
    o2 = _row("O2 bf16", "O2", "bf16", _steps([3.0] * 9 + [2.01], step_time=half_ms * 0.9 / 1e3,
                                              mem=400 * 2**20))
    o3 = _row("O3 bf16", "O3", "bf16", _steps([3.0] * 9 + [2.1], step_time=half_ms * 0.5 / 1e3,
                                              mem=380 * 2**20))
    late = Row(label="autocast bf16", opt_level="autocast", dtype="bf16", status="timeout",
               error="timed out after 60 s")
    rows = [base, o1, o2, o3, late]
    sweep_stats.compare(rows)
    return rows


def test_the_verdict_names_fp32_where_bf16_is_emulated_and_what_o2_saves() -> None:
    from ampx.cli.sweep.verdict import verdict

    said = verdict(_verdict_rows(100.0, 3800.0), _fake_probe(38.0, native=False))
    assert said.startswith("verdict: use O0 (fp32) here: it is the fastest; the fastest "
                           "half-precision row, O2 bf16, ran at 0.03x O0's speed: bf16 matmuls "
                           "are emulated here (no native bf16 kernels: AVX2 CPU, no "
                           "AVX512-BF16/AMX), 38x slower than fp32 at this model's shapes; "
                           "O2 bf16 saves 20% memory (peak) and keeps the loss.")
    # O3 is faster than O1 and O2 but lost 5% of the loss; the timed-out row is not compared
    assert said.endswith("Not compared: autocast bf16 timeout, O3 bf16 loss +5.0%.")


def test_the_verdict_names_the_fastest_level_that_keeps_the_loss() -> None:
    from ampx.cli.sweep.verdict import verdict

    said = verdict(_verdict_rows(200.0, 100.0), _fake_probe(0.5))
    assert said.startswith("verdict: use O2 bf16 here: the fastest (2.22x O0, IQR 2.22-2.22) "
                           "of the rows whose final loss is within 1% of O0's, -20% memory.")
    rows = _verdict_rows(200.0, 100.0)
    rows[0].status, rows[0].error = "timeout", "timed out"
    assert verdict(rows).startswith("verdict: none: O0 (the fp32 baseline) did not finish")


def test_a_run_stopped_after_its_last_step_is_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "lingers.py"
    fake.write_text(SLOW_FAKE.replace('level = sys.argv[1]', 'level = sys.argv[1]\nimport atexit\n'
                                      'atexit.register(time.sleep, 600)'))
    spec = sweep.SweepSpec(script=fake, script_args=[], out=tmp_path / "out", steps=4,
                           configs=[SweepConfig("O0", None)], timeout_s=4.0)
    # the limit passes once the last step is written, while the script lingers at exit
    _use_clock(monkeypatch, _EventClock(
        lambda: _steps_in(spec.out / "runs" / "O0.jsonl", 4), then=5.0))
    row = sweep.run_sweep(spec, launcher=_slow_launcher(fake))[0]
    assert (row.status, row.steps, row.error) == ("ok", 4, None)
    assert row.final_loss == 1.0 and (row.wall_s or 999) < 300  # not waited out


@pytest.mark.parametrize(("load", "threads"), [(0.1, None), (0.8, None), (1.2, "1"),
                                               (13.0, "1")])
def test_runs_on_a_busy_machine_get_the_free_cpus(
        load: float, threads: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sweep_command.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(sweep_command.os, "cpu_count", lambda: 2)
    spec = sweep.spec_from_args(_sweep_args())
    said: list[str] = []
    sweep_command._threads(spec, said.append)
    assert spec.env.get("OMP_NUM_THREADS") == threads
    assert bool(said) == (threads is not None)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice is kept
    spec = sweep.spec_from_args(_sweep_args())
    sweep_command._threads(spec, said.append)
    assert "OMP_NUM_THREADS" not in spec.env
