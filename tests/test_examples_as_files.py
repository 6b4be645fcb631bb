"""The examples run the way the docs show them: as files, under `ampx run`, from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fairseq_style_train_runs_as_a_file_under_ampx_run(tmp_path: Path) -> None:
    script = ROOT / "examples" / "fairseq_style" / "train.py"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "ampx", "run", str(script), "--opt-level", "O2",
         "--amp-dtype", "bf16", "--max-update", "2", "--save-dir", str(tmp_path / "ckpt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").exists()
