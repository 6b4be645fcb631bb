"""The docs' runnable blocks run verbatim, and docs/index.md links every page.

A fenced ```python or ```bash block right after a line `<!-- runnable -->` (in README.md or
docs/*.md) is run as written: Python with this interpreter, bash with this interpreter's
`bin` first on PATH, each in a fresh temporary directory (so relative paths and files it writes
stay there), with ampx importable from this checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- runnable -->"
_BLOCK = re.compile(re.escape(MARK) + r"\n```(python|bash)\n(.*?)\n```", re.S)


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(id, language, code) of every marked block."""
    out = []
    for page in PAGES:
        text = page.read_text()
        blocks = _BLOCK.findall(text)
        assert len(blocks) == text.count(MARK), f"{page.name}: a {MARK} not before a fence"
        for i, (lang, code) in enumerate(blocks):
            out.append((f"{page.relative_to(ROOT)}#{i}", lang, code))
    return out


BLOCKS = runnable_blocks()


def test_the_framework_pages_and_the_index_have_runnable_blocks() -> None:
    pages = {block_id.split("#")[0] for block_id, _, _ in BLOCKS}
    assert {"docs/index.md", "docs/lightning.md", "docs/accelerate.md"} <= pages


@pytest.mark.slow
@pytest.mark.parametrize(("lang", "code"), [b[1:] for b in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_runnable_block_runs_verbatim(lang: str, code: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail",
                                                                 "-c", code]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_index_links_every_page() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    missing = sorted(p for p in pages if f"]({p})" not in index)
    assert not missing, f"docs/index.md does not link {missing}"


def test_readme_links_the_framework_pages() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in ("lightning.md", "accelerate.md", "hf-trainer.md", "compile.md",
                 "reliability.md", "debugging-overflows.md"):
        assert f"](docs/{page})" in readme, page


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_cli_md_quotes_what_ampx_lists_prints(level: str, capsys: pytest.CaptureFixture[str]
                                              ) -> None:
    from ampx.cli import main as cli

    assert cli.main(["lists", "--level", level, "--dtype", "bf16"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"$ ampx lists --level {level} --dtype bf16\n{first}\n" in (
        ROOT / "docs" / "cli.md").read_text()


def test_cli_md_quotes_the_opt_level_error(capsys: pytest.CaptureFixture[str]) -> None:
    from ampx.cli import main as cli

    assert cli.main(["run", "-O", "02", "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"$ ampx run -O 02 train.py\n{err}" in (ROOT / "docs" / "cli.md").read_text()
