"""Two gloo CPU ranks for the distributed tests: launching the worker scripts and ending them.

A test module that is also a worker script (run as ``python test_x.py RANK STORE OUT``) calls
`launch(__file__, out)` from its module fixture and `finish(...)` at the end of its worker.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

WORLD = 2
REPO = pathlib.Path(__file__).resolve().parents[1]
TESTS = pathlib.Path(__file__).resolve().parent  # workers in tests/<area>/ import this module


def launch(script: str, out: pathlib.Path, timeout: float = 240) -> Any:
    """Run `script` as WORLD ranks; returns what rank 0 wrote (fails the test otherwise)."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS),
                                           os.environ.get("PYTHONPATH", "")]))
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [subprocess.Popen([sys.executable, script, str(rank), str(out / "store"), str(out)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(WORLD)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail("distributed workers timed out:\n" + "\n".join(logs))
    if any(proc.returncode for proc in procs):
        pytest.fail("distributed workers failed:\n" + "\n----\n".join(logs))
    return json.loads((out / "results.json").read_text())


def finish(rank: int, results: Any, out_dir: str) -> None:
    """Gather every rank's `results` into rank 0's results.json, then end the worker.

    Gloo work still referenced when the interpreter tears down aborts the process
    ("terminate called without an active exception", about one CI run in twenty): the DDP
    reducers are freed while the group lives, both ranks meet, and the teardown is skipped.
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        pathlib.Path(out_dir, "results.json").write_text(json.dumps(gathered))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
