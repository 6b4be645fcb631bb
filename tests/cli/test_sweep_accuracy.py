"""`ampx sweep` judges accuracy on held-out data: evaluations, the drift test, the verdict,
time to quality, `ampx.log_metric` / `--metric` / `--metric-regex`, the examples' real data."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampx import telemetry
from ampx.cli import main as cli
from ampx.cli import sweep
from ampx.cli.sweep import SweepConfig, accuracy
from ampx.cli.sweep import report as sweep_report
from ampx.cli.sweep import stats as sweep_stats
from ampx.cli.sweep.stats import Row
from ampx.cli.sweep.verdict import verdict

ROOT = Path(__file__).resolve().parents[2]
EVAL_STEPS = [5, 10, 15, 20, 25, 30, 35, 40]


def _row(label: str, level: str, dtype: str | None, heldout: list[float], *,
         step_time: float, seconds: list[float] | None = None) -> Row:
    records = [{"event": "step", "step": i + 1, "optimizer": 0, "step_time_s": step_time,
                "loss": 2.0, "loss_scale": 1.0, "skipped": False, "peak_mem_bytes": 2**20,
                "time": 1000.0 + (i + 1) * step_time} for i in range(40)]
    row = sweep_stats.summarize(Row(label=label, opt_level=level, dtype=dtype, status="ok"),
                                {"event": "init"}, records)
    times = seconds or [1000.0 + s * step_time for s in EVAL_STEPS]
    metrics = {"heldout_loss": [{"step": s, "value": v, "time": t}
                                for s, v, t in zip(EVAL_STEPS, heldout, times)]}
    accuracy.attach(row, metrics, records, accuracy.Metric())
    return row


def _judged(*rows: Row) -> list[Row]:
    out = list(rows)
    sweep_stats.compare(out)
    accuracy.judge(out, accuracy.Metric())
    return out


BASE = [4.0, 3.5, 3.2, 3.0, 2.9, 2.8, 2.75, 2.7]


def test_a_growing_gap_drifts_and_is_not_recommended_even_when_fastest() -> None:
    # O3: +0.1% at the first evaluation, +0.8% at the last: within 1%, but growing
    drift = [v * (1 + 0.001 * (i + 1)) for i, v in enumerate(BASE)]
    same = [v * (1 + (0.0004 if i % 2 else -0.0004)) for i, v in enumerate(BASE)]  # noise
    worse = [v * 1.03 for v in BASE]
    rows = _judged(_row("O0", "O0", None, BASE, step_time=0.2),
                   _row("O2 bf16", "O2", "bf16", same, step_time=0.1),
                   _row("O3 bf16", "O3", "bf16", drift, step_time=0.05),
                   _row("O1 bf16", "O1", "bf16", worse, step_time=0.08))
    base, o2, o3, o1 = rows
    assert [r.accuracy_verdict for r in rows] == ["same", "same", "drifting", "worse"]
    assert o3.heldout_gap == pytest.approx(0.008)
    assert o3.gap_trend is not None and o3.gap_trend > accuracy.DRIFT
    assert o2.gap_trend is not None and abs(o2.gap_trend) < accuracy.DRIFT
    assert o1.heldout_gap == pytest.approx(0.03)
    said = verdict(rows)
    assert said.startswith("verdict: use O2 bf16 here: the fastest (2.00x O0, IQR 2.00-2.00) "
                           "of the rows whose held-out loss is within 1% of O0's and not "
                           "drifting")
    assert "8 evaluations to step 40 (40 steps)" in said and "0.25% over the run" in said
    assert "O3 bf16 drifting (held-out loss +0.80% vs O0, the gap growing" in said
    assert "O1 bf16 worse (held-out loss +3.00% vs O0; tolerance 1%)" in said
    table = sweep_report.format_table(rows)
    assert table.splitlines()[0].split()[-7:] == ["held-out", "vs", "O0", "trend", "accuracy",
                                                  "to", "O0", "s"][-7:]
    o3_line = next(line for line in table.splitlines() if line.startswith("O3 bf16 "))
    assert "+0.80%" in o3_line and "drifting" in o3_line
    assert "O3 bf16: accuracy drifting: held-out loss +0.80% vs O0" in table


def test_noise_around_o0_is_not_drift_and_being_better_is_not_worse() -> None:
    wobble = [v * (1 + d) for v, d in zip(BASE, [0.003, -0.002, 0.004, -0.003, 0.002, -0.004,
                                                  0.003, -0.002])]
    better = [v * 0.97 for v in BASE]
    rows = _judged(_row("O0", "O0", None, BASE, step_time=0.2),
                   _row("O2 bf16", "O2", "bf16", wobble, step_time=0.1),
                   _row("O1 bf16", "O1", "bf16", better, step_time=0.1))
    assert [r.accuracy_verdict for r in rows] == ["same", "same", "same"]


def test_too_few_evaluations_are_too_short_and_the_verdict_says_so() -> None:
    base = _row("O0", "O0", None, BASE, step_time=0.2)
    short = _row("O2 bf16", "O2", "bf16", BASE, step_time=0.1)
    short.series["heldout"] = short.series["heldout"][:3]  # stopped after 3 evaluations
    rows = _judged(base, short)
    assert short.accuracy_verdict == "too-short"
    said = verdict(rows)
    assert said.startswith("verdict: use O0 (fp32) here: the run was too short to judge the "
                           "half-precision levels' held-out loss, so none is recommended.")
    assert "too short to judge O2 bf16" in said
    worse = _row("O3 bf16", "O3", "bf16", [v * 1.05 for v in BASE], step_time=0.1)
    said = verdict(_judged(base, short, worse))
    assert said.startswith("verdict: use O0 (fp32) here: no half-precision level kept O0's "
                           "held-out loss.")


def test_time_to_quality_is_the_time_to_reach_o0s_final_value() -> None:
    fast_seconds = [1000.0 + s * 0.1 for s in EVAL_STEPS]
    quick = [v * 0.99 for v in BASE]
    quick[5] = 2.69  # step 30: the first evaluation at or below O0's final 2.7
    rows = _judged(_row("O0", "O0", None, BASE, step_time=0.2),
                   _row("O2 bf16", "O2", "bf16", quick, step_time=0.1, seconds=fast_seconds),
                   _row("O3 bf16", "O3", "bf16", [v * 1.005 for v in BASE], step_time=0.1))
    base, o2, o3 = rows
    assert base.time_to_quality_s == pytest.approx(40 * 0.2)  # from the first step's start
    assert o2.time_to_quality_s == pytest.approx(30 * 0.1)
    assert o3.time_to_quality_s is None  # never reached O0's final value


def test_log_metric_costs_nothing_outside_a_sweep_and_writes_a_record_inside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = ("import sys, ampx; ampx.log_metric('val_acc', 0.5, step=3); "
            "print('torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != telemetry.ENV_VAR}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60, check=True)
    assert proc.stdout.strip() == "False"  # no torch import, no file
    import ampx

    path = tmp_path / "t.jsonl"
    monkeypatch.setenv(telemetry.ENV_VAR, str(path))
    try:
        ampx.log_metric("val_acc", 0.75, step=10)
        ampx.log_metric("val_acc", 0.8, step=20)
        with pytest.raises(TypeError, match="ampx.log_metric: 'val_acc' must be a number"):
            ampx.log_metric("val_acc", "high")
    finally:
        monkeypatch.delenv(telemetry.ENV_VAR)
        telemetry.sink()  # closes the writer
    metrics, data = telemetry.read_metrics(path)
    assert [(r["step"], r["value"]) for r in metrics["val_acc"]] == [(10, 0.75), (20, 0.8)]
    assert data is None


def test_metric_regex_reads_an_unedited_scripts_output(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("epoch 1 val acc 0.50\nnoise\nepoch 2 val acc 0.75\n")
    row = Row(label="O0", opt_level="O0", dtype=None, status="ok", log=str(log))
    accuracy.attach(row, {}, [], accuracy.Metric("val_acc", True,
                                                 r"epoch (?P<step>\d+) val acc ([0-9.]+)"))
    assert row.series["heldout"] == [[1, 0.5], [2, 0.75]] and row.heldout == {"val_acc": 0.75}


LAST_STEP_ON_STOP = textwrap.dedent("""
    # Writes 3 of its 4 step records, then the 4th only when it is stopped (SIGINT): a run
    # whose last step lands between the sweep's last look at its telemetry and its deadline.
    import json, os, signal, sys, time
    f = open(os.environ["AMPX_TELEMETRY"], "a")
    def record(i):
        f.write(json.dumps({"event": "step", "step": i, "optimizer": 0, "step_time_s": 0.1,
                            "loss": 1.0, "loss_scale": 1.0, "skipped": False,
                            "peak_mem_bytes": 2**20}) + "\\n")
        f.flush()
    def last(*_):
        record(4)
        sys.exit(0)
    signal.signal(signal.SIGINT, last)
    f.write(json.dumps({"event": "init", "opt_level": "autocast"}) + "\\n")
    for i in (1, 2, 3):
        record(i)
    while True:
        time.sleep(0.05)
""")


def test_a_run_whose_last_step_arrives_at_the_deadline_is_not_a_timeout(tmp_path: Path) -> None:
    """Issue 38 item 7: the autocast row had done its steps and still ended as `timeout`."""
    fake = tmp_path / "late.py"
    fake.write_text(LAST_STEP_ON_STOP)
    spec = sweep.SweepSpec(script=fake, script_args=[], out=tmp_path / "out", steps=4,
                           configs=[SweepConfig(None, "bf16")], timeout_s=3.0)
    row = sweep.run_sweep(spec, launcher=lambda config, _: [sys.executable, str(fake)])[0]
    assert (row.status, row.steps, row.error) == ("ok", 4, None)


USER_SCRIPT = textwrap.dedent("""
    import torch
    import ampx
    from apex import amp

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = (x[:, 0] + x[:, 1] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    for step in range(1, 13):
        loss = torch.nn.functional.cross_entropy(model(x[:192]).float(), y[:192])
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % 2 == 0:
            with torch.no_grad():
                acc = (model(x[192:]).argmax(1) == y[192:]).float().mean().item()
            ampx.log_metric("val_acc", acc, step=step)
            print(f"step {step} val acc {acc:.4f}")
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["log_metric", "regex"])
def test_sweep_judges_a_user_script_by_its_own_metric(
        how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT if how == "log_metric" else
                      USER_SCRIPT.replace('ampx.log_metric("val_acc", acc, step=step)', "pass"))
    out = tmp_path / "out"
    extra = (["--metric", "val_acc"] if how == "log_metric" else
             ["--metric", "val_acc", "--metric-regex", r"step (?P<step>\d+) val acc ([0-9.]+)"])
    assert cli.main(["sweep", str(script), "--levels", "O0,O2", "--out", str(out),
                     "--higher-is-better", *extra]) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "sweep.json").read_text())
    assert data["meta"]["metric"]["name"] == "val_acc"
    assert data["meta"]["metric"]["higher_is_better"] is True
    for row in data["rows"]:
        assert row["status"] == "ok" and set(row["heldout"]) == {"val_acc"}
        assert [s for s, _ in row["series"]["heldout"]] == [2, 4, 6, 8, 10, 12]
        assert row["accuracy_verdict"] in ("same", "drifting", "worse")
        assert "time_to_quality_s" in row
    base = data["rows"][0]
    if how == "log_metric":  # the records carry times; a regex on the output does not
        assert base["time_to_quality_s"] is not None
    assert "Accuracy: val_acc, 6 evaluations to step 12" in printed
    with open(out / "sweep.csv", newline="") as handle:
        lines = list(csv.DictReader(handle))
    assert lines[0]["heldout_final"] and lines[0]["accuracy_verdict"] == "same"
    assert (out / "sweep.png").stat().st_size > 0


def test_the_stdlib_split_is_by_file_and_digits_hold_out_a_fifth() -> None:
    from ampx.examples import data

    text = data.stdlib_bytes(32, 2, 4, 2, seed=1)
    described = text.describe()
    assert described["synthetic"] is False and described["name"] == "stdlib"
    assert described["heldout_files"] >= 1 and described["heldout_bytes"] > 0
    assert text.train[0][0].shape == (2, 32) and int(text.train[0][0].max()) < 256
    again = data.stdlib_bytes(32, 2, 4, 2, seed=1)
    assert all((a[0] == b[0]).all() for a, b in zip(text.heldout, again.heldout))
    pytest.importorskip("sklearn")
    digits = data.digits(64, seed=1, image_size=16)
    assert digits.info["heldout_images"] == 359 and digits.info["train_images"] == 1438
    assert digits.heldout[0][0].shape == (359, 1, 16, 16)
    held = {tuple(x.flatten().tolist()) for x in digits.heldout[0][0][:50]}
    trained = {tuple(x.flatten().tolist()) for b in digits.train for x in b[0]}
    assert not held & trained


def test_the_convnet_sweep_says_what_to_install_without_sklearn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from ampx.examples import data

    monkeypatch.setattr(data, "digits_available", lambda: False)
    assert cli.main(["sweep", "--example", "convnet", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "scikit-learn is not installed: pip install scikit-learn" in err
    assert "--data synthetic" in err and not (tmp_path / "sweep.json").exists()


def test_a_row_variant_is_one_line_of_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ampx.cli.sweep import run as sweep_run

    monkeypatch.setitem(sweep_run.LEVEL_ROWS, "O3", (("", ()), ("kahan", ("--x-kahan",))))
    configs = sweep.build_configs(["O0", "O3"], ["bf16"], autocast=False)
    assert [c.label for c in configs] == ["O0", "O3 bf16", "O3 bf16 kahan"]
    spec = sweep.SweepSpec(script=tmp_path / "t.py", script_args=[], configs=configs,
                           out=tmp_path)
    cmd = sweep.command_for(spec, configs[2], tmp_path / "t.jsonl")
    assert cmd[cmd.index("--dtype") + 1:cmd.index("--dtype") + 3] == ["bf16", "--x-kahan"]
    assert configs[2].slug == "O3-bf16-kahan" and "--x-kahan" not in sweep.command_for(
        spec, configs[1], tmp_path / "t.jsonl")


def test_the_plan_counts_a_busy_machines_start_up_and_step_overhead() -> None:
    """At load 12 on 2 CPUs a run's start-up, evaluations and exit took ~29 s and a small
    transformer's step ~0.4 s; a plan of 15 s and 0.03 s left the last row (autocast) without
    time: it stopped at step 33 of 40."""
    from ampx.cli.sweep import plan as sweep_plan
    from ampx.cli.sweep import probe as sweep_probe

    assert sweep_plan.startup_s(1.0) == sweep_plan.STARTUP_S
    assert sweep_plan.startup_s(6.5) == pytest.approx(2.5 * sweep_plan.STARTUP_S)
    tiny = sweep_probe.Probe(capability="AVX512", native={"bf16": True},
                             forward_s={"fp32": 0.001, "bf16": 0.001})
    assert sweep_plan.estimate_step_s(tiny, "bf16", busy=6.5) > 0.25
