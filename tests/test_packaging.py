"""Packaging metadata, the README's install path, and the test command CI runs.

The wheel itself (built, installed in a fresh environment, native build, O2 loop) is
tests/test_wheel.py; here are the cheap checks, plus the README test command run end to end
(with a stand-in test suite) on a machine whose compiler is missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ampx
from ampx import _version

ROOT = Path(__file__).resolve().parents[1]
DIST = "torch-ampx"  # the import name, the command and the apex alias stay `ampx`
tomllib = pytest.importorskip("tomllib")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _readme_test_command() -> str:
    """The last line of the README's "Run the tests" code block."""
    section = (ROOT / "README.md").read_text().split("## Run the tests", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()[-1]


def test_one_version_source() -> None:
    project = _pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "ampx._version.__version__"
    assert ampx.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", _version.__version__)


def test_license_is_an_spdx_expression_with_its_file() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "BSD-3-Clause"  # PEP 639 string, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "ampx developers" in text
    # PEP 639: a license expression replaces License :: classifiers (setuptools rejects both)
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    assert "Typing :: Typed" in project["classifiers"]


def test_build_needs_are_the_native_extra() -> None:
    project = _pyproject()
    extras = project["project"]["optional-dependencies"]
    assert extras["native"] == ["ninja"]
    assert any(req.startswith(f"{DIST}[") and "native" in req for req in extras["test"])
    assert project["build-system"]["requires"] == ["setuptools>=77"]
    data = project["tool"]["setuptools"]["package-data"]["ampx"]
    assert {"csrc/*.cpp", "csrc/*.cu", "csrc/*.h"} <= set(data)


def test_the_distribution_is_ours() -> None:
    """`ampx` on PyPI is someone else's package: the distribution is torch-ampx.

    The extras that name the project itself name it by its distribution name too, or pip
    would fetch the other `ampx` to satisfy them.
    """
    project = _pyproject()["project"]
    assert project["name"] == DIST
    assert project["scripts"] == {"ampx": "ampx.cli.main:main"}  # the command keeps its name
    for reqs in project["optional-dependencies"].values():
        for req in reqs:
            assert _requirement_name(req) != "ampx", req


def _requirement_name(token: str) -> str | None:
    """The project a `pip install` argument names, or None for options, paths and URLs."""
    token = token.strip("'\"`,;()")
    match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?([<>=!~].*)?", token)
    return match.group(1).lower() if match and not token.startswith(".") else None


def _pip_install_lines() -> list[tuple[str, str]]:
    """(where, arguments) of every `pip install` in README.md, docs/, setup.py and ampx/."""
    files = [ROOT / "README.md", ROOT / "setup.py", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "ampx").rglob("*.py"))]
    found = []
    for path in files:
        # a hint may wrap after "pip install" in a docstring or a help text
        text = re.sub(r"pip install\s*\n\s*", "pip install ", path.read_text())
        for n, line in enumerate(text.splitlines(), 1):
            for args in re.findall(r"pip install ([^`)\n]*)", line):
                found.append((f"{path.relative_to(ROOT)}:{n}", args))
    return found


def test_every_pip_install_line_names_the_distribution() -> None:
    lines = _pip_install_lines()
    ours = [(where, args) for where, args in lines
            if {_requirement_name(tok) for tok in args.split()} & {"ampx", DIST}]
    bare = [f"{where}: pip install {args}" for where, args in ours
            if "ampx" in {_requirement_name(tok) for tok in args.split()}]
    assert not bare, "installs the unrelated PyPI package `ampx`:\n" + "\n".join(bare)
    # the check sees the lines it is about: README's extras, the docs' and the CLI's hints
    where = {w.split(":")[0] for w, _ in ours}
    assert {"README.md", "docs/hf-trainer.md", "docs/native-kernels.md", "ampx/_build.py",
            "ampx/cli/main.py"} <= where, sorted(where)


def test_readme_picks_torch_before_the_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    first_command = readme.index("```bash")
    assert readme.index("download.pytorch.org/whl/cpu") < first_command
    assert readme.index("CUDA build") < first_command
    tests = readme.split("## Run the tests", 1)[1]
    assert tests.index("C++ compiler") < tests.index("```bash")


def test_ci_runs_exactly_the_readme_test_command() -> None:
    command = _readme_test_command()
    assert command.startswith("ampx build-ext --skip-without-compiler && ")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1] == command
    assert ci_lines.count(command) == 1


PROBE = textwrap.dedent("""
    import os

    import pytest

    from ampx import _ext


    @pytest.mark.kernel_backend
    def test_probe():
        with open(os.environ["PROBE_LOG"], "a") as log:
            log.write(f"{os.environ.get('AMPX_DISABLE_EXT', '-')} {_ext.BACKEND}\\n")
""")


@pytest.mark.slow
def test_readme_test_command_survives_a_missing_compiler(tmp_path: Path) -> None:
    """CXX points at nothing: one SKIPPED line, then both pytest runs, exit status 0.

    The command runs verbatim in bash; `python` and `ampx` are this interpreter and this
    checkout, and the suite it runs is a one-test stand-in that records which kernels it saw.
    """
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, args in (("python", ""), ("ampx", " -m ampx")):
        shim = bindir / name  # a script, not a symlink: a venv's python must stay in its venv
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        shim.chmod(0o755)
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_probe.py").write_text(PROBE)
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    kernel_backend: both backends\n")
    (suite / "test_reference_run_skips_me.py").write_text(
        "def test_native_run_only():\n    pass\n")
    log = tmp_path / "probe.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMPX_", "PYTEST_"))}
    env.update(PATH=os.pathsep.join([str(bindir), env.get("PATH", "")]), PROBE_LOG=str(log),
               CXX=str(tmp_path / "no-such-compiler"), AMPX_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", "-c", _readme_test_command()], cwd=suite, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.startswith("ampx build-ext: SKIPPED, no C++ compiler: CXX=")
    assert str(tmp_path / "no-such-compiler") in proc.stderr.splitlines()[0]
    assert log.read_text().splitlines() == ["- reference", "1 reference"]
    # the second run is only the kernel_backend tests, both on two xdist workers
    runs = [line.split(" in ")[0] for line in proc.stdout.splitlines() if " passed in " in line]
    assert runs == ["2 passed", "1 passed"], proc.stdout
    assert "bringing up nodes..." in proc.stdout, proc.stdout  # xdist ran them
    assert not (tmp_path / "cache").exists()
