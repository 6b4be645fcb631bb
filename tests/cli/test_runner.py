"""`ampx run`'s process set-up: log lines, tracebacks, and what child processes inherit."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampx.cli import main as cli
from ampx.cli import run as runner

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("AMPX_TELEMETRY", None)
    env.update(extra)
    return env


def _ampx(*args: str, cwd: Path, env: dict[str, str] | None = None,
          timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ampx", *args], cwd=cwd, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


INIT_SCRIPT = textwrap.dedent("""
    import logging
    import sys
    import torch
    from apex import amp

    if "--basic-config" in sys.argv:
        logging.basicConfig(level=logging.INFO, format="ROOT %(name)s %(message)s")
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1")
    logging.getLogger("ampx").info("ampx run: a line that names ampx itself")
    if "--crash" in sys.argv:
        def inner():
            raise RuntimeError("the script crashed")
        inner()
""")


def test_prefix_formatter_adds_one_ampx_prefix() -> None:
    formatter = runner.PrefixFormatter("%(message)s")

    def fmt(message: str) -> str:
        return formatter.format(logging.LogRecord("ampx", logging.INFO, "", 0, message, (), None))

    assert fmt("Selected optimization level O1") == "ampx: Selected optimization level O1"
    assert fmt("ampx run: forcing opt_level='O2'") == "ampx run: forcing opt_level='O2'"
    assert fmt("ampx.initialize: removing patches") == "ampx.initialize: removing patches"


def test_log_lines_are_prefixed_once_and_propagation_is_restored(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "init.py"
    script.write_text(INIT_SCRIPT)
    logger = logging.getLogger("ampx")
    before = (logger.level, logger.propagate, list(logger.handlers))
    assert cli.main(["run", "-O", "O2", "--dtype", "bf16", str(script)]) == 0
    err = capsys.readouterr().err
    assert "ampx: ampx" not in err
    assert "ampx: Selected optimization level O2" in err
    assert "\nampx run: a line that names ampx itself" in err
    assert "ampx run: forcing opt_level='O2'" in err
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


@pytest.mark.slow
def test_script_calling_basic_config_prints_each_ampx_line_once(tmp_path: Path) -> None:
    script = tmp_path / "init.py"
    script.write_text(INIT_SCRIPT)
    proc = _ampx("run", str(script), "--basic-config", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("Selected optimization level O1") == 1, proc.stderr
    assert proc.stderr.count("a line that names ampx itself") == 1
    assert "ROOT ampx" not in proc.stderr  # ampx's handler, not also the script's root handler


def _traceback_files(err: str) -> list[str]:
    body = err.split("Traceback (most recent call last):", 1)[1]
    return [line.split('"')[1] for line in body.splitlines() if line.startswith('  File "')]


@pytest.mark.kernel_backend  # the script trains a step in this process
def test_crash_traceback_starts_in_the_script_in_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "init.py"
    script.write_text(INIT_SCRIPT)
    assert cli.main(["run", "-q", str(script), "--crash"]) == 1
    err = capsys.readouterr().err
    files = _traceback_files(err)
    assert files == [str(script), str(script)], err  # <module>, then inner()
    assert "<frozen runpy>" not in err and "RuntimeError: the script crashed" in err


@pytest.mark.slow
def test_crash_traceback_starts_in_the_script_in_a_process(tmp_path: Path) -> None:
    script = tmp_path / "init.py"
    script.write_text(INIT_SCRIPT)
    for args in (["run", "-q", str(script), "--crash"],
                 ["run", "-q", "-m", "init", "--crash"]):
        proc = _ampx(*args, cwd=tmp_path)
        assert proc.returncode == 1
        assert "<frozen runpy>" not in proc.stderr and "runpy.py" not in proc.stderr
        assert _traceback_files(proc.stderr)[0] == str(script), proc.stderr


SPAWN_SCRIPT = textwrap.dedent("""
    import json
    import sys

    import torch
    import torch.multiprocessing as mp
    from torch.utils.data import DataLoader, Dataset


    def report():
        import apex
        import ampx.frontend
        return {"amp": apex.amp.__name__, "forced": ampx.frontend.forced_options().jsonable()}


    class Probe(Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            return json.dumps(report())


    def child(rank, path):
        with open(path, "w") as handle:
            json.dump(report(), handle)


    if __name__ == "__main__":
        loader = DataLoader(Probe(), num_workers=1, multiprocessing_context="spawn",
                            batch_size=None)
        print("worker", next(iter(loader)), flush=True)
        mp.spawn(child, args=(sys.argv[1],), nprocs=1)
        print("spawned", open(sys.argv[1]).read(), flush=True)
""")


@pytest.mark.slow
def test_spawned_workers_and_mp_spawn_children_get_alias_and_overrides(tmp_path: Path) -> None:
    script = tmp_path / "spawner.py"
    script.write_text(SPAWN_SCRIPT)
    out = tmp_path / "child.json"
    proc = _ampx("run", "-q", "-O", "O2", "--dtype", "bf16", str(script), str(out),
                 cwd=tmp_path, env=_env(OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    expected = {"amp": "ampx.amp", "forced": {"opt_level": "O2", "dtype": "bfloat16"}}
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert json.loads(lines["worker"]) == expected
    assert json.loads(lines["spawned"]) == expected


CHILD_SCRIPT = textwrap.dedent("""
    import os
    import subprocess
    import sys

    code = ("import sys, sitecustomize; print(getattr(sitecustomize, 'MARK', None), "
            "'torch' in sys.modules); import apex; print(apex.amp.__name__)")
    print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout, end="")
    print("env", os.environ.get("AMPX_RUN_CHILD") is not None)
    print("site", os.environ["PYTHONPATH"].split(os.pathsep)[0])
""")


def test_children_chain_an_existing_sitecustomize_and_the_parent_is_left_clean(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    own = tmp_path / "own_site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("MARK = 'chained'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(own), str(ROOT)]))
    before = dict(os.environ)
    script = tmp_path / "child.py"
    script.write_text(CHILD_SCRIPT)
    assert cli.main(["run", "-q", str(script)]) == 0
    out = capsys.readouterr().out.splitlines()
    # the user's sitecustomize still ran; nothing was imported before `import apex`
    assert out[:3] == ["chained False", "ampx.amp", "env True"]
    site = Path(out[3].split(" ", 1)[1])
    assert site.name.startswith("ampx-run-") and not site.exists()  # removed after the run
    assert dict(os.environ) == before  # PYTHONPATH and AMPX_RUN_CHILD are put back


def test_child_config_carries_alias_and_forced_options() -> None:
    request = runner.RunRequest(script="x.py", script_args=[], forced={"opt_level": "O3"},
                                force_apex_alias=True)
    config = runner.child_config(request)
    assert config["alias"] is True and config["force_alias"] is True
    assert json.loads(config["forced"]) == {"opt_level": "O3"}
    assert Path(config["ampx_root"], "ampx", "cli", "run.py").is_file()
    json.dumps(config)  # it travels as JSON


SKIP_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from apex import amp

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1",
                                      verbosity=int(sys.argv[1]))
    model.weight.register_hook(lambda g: g * float("inf"))
    loss = model(torch.randn(3, 4)).float().sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
""")


@pytest.mark.kernel_backend
@pytest.mark.parametrize("verbosity", [0, 1])
def test_verbosity_0_silences_the_skipped_step_line_under_ampx_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], verbosity: int) -> None:
    """apex printed "Gradient overflow ... Skipping step" only with verbosity > 0; `ampx run`
    shows ampx's INFO lines, so the line must follow the script's verbosity."""
    script = tmp_path / "skip.py"
    script.write_text(SKIP_SCRIPT)
    assert cli.main(["run", str(script), str(verbosity)]) == 0
    err = capsys.readouterr().err
    assert ("Skipping step" in err) == bool(verbosity), err


INIT_OLD_SCRIPT = textwrap.dedent("""
    import torch
    from apex import amp

    handle = amp.init()
    print("dtype", torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype, flush=True)
    model = torch.nn.Linear(2, 2)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
""")


@pytest.mark.kernel_backend
@pytest.mark.parametrize("forced,dtype", [(["--dtype", "bf16"], "torch.bfloat16"),
                                          (["-O", "O2", "--dtype", "bf16"], "torch.bfloat16"),
                                          (["-O", "O0"], "torch.float32"),
                                          (["--disable"], "torch.float32"),
                                          ([], "torch.float16")])
def test_amp_init_follows_the_forced_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           forced: list[str], dtype: str) -> None:
    """apex's older entry `amp.init()` casts in the dtype `ampx run` forces (none at -O O0 or
    --disable), names the forced options it cannot apply, and its O1 casts count as ampx
    being used: no "never called amp.initialize" warning."""
    script = tmp_path / "old.py"
    script.write_text(INIT_OLD_SCRIPT)
    assert cli.main(["run", *forced, str(script)]) == 0
    out, err = capsys.readouterr()
    assert f"dtype {dtype}\n" in out
    assert ("never called amp.initialize" in err) == (dtype == "torch.float32"), err
    assert ("amp.init() installs O1's casts only; the forced opt_level='O2' need "
            "amp.initialize" in err) == ("O2" in forced), err


CHILD_TRAINS_SCRIPT = textwrap.dedent("""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent('''
    import sys, torch
    from apex import amp
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if sys.argv[1] == "init":
        model, opt = amp.initialize(model, opt, verbosity=0)
    for _ in range(2):
        model(torch.ones(1, 2)).float().sum().backward()
        opt.step()
    ''')
    for how in ("plain", "init"):
        child = subprocess.run([sys.executable, "-c", code, how],
                               capture_output=True, text=True, timeout=300)
        print(how, child.returncode, child.stderr.count("are not applied in it"), flush=True)
""")


@pytest.mark.slow
def test_a_child_process_that_skips_initialize_is_warned(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The parent's exit check ("the forced options were not applied") cannot see a child
    process; the child warns itself, once, at its first step of an optimizer ampx did not
    prepare (and a child that initialized is not warned)."""
    script = tmp_path / "parent.py"
    script.write_text(CHILD_TRAINS_SCRIPT)
    assert cli.main(["run", "-q", "--dtype", "bf16", str(script)]) == 0
    assert capsys.readouterr().out.splitlines() == ["plain 0 1", "init 0 0"]
