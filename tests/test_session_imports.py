"""What a session loads: initialize and training import only the modules they use.

Every module `initialize` imports is resident memory each run pays (benchmarks/bench_memory.py
counts it against torch.autocast, which imports nothing); the overflow tools a session did not
ask for stay unloaded, and so do the reference kernels while the extension serves the CPU.
Checked in fresh processes (this one imported everything long ago).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Loaded only by the features that use them.
ON_DEMAND = ("wrapt", "ampx.overflow.numerics", "ampx.overflow.numerics_report",
             "ampx.overflow.flags", "ampx.overflow.forward", "ampx.scaling.compensated")


def _loaded_after(body: str) -> set[str]:
    script = textwrap.dedent("""
        import sys
        import torch
        from torch import nn
        import ampx
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """) + textwrap.dedent(body) + textwrap.dedent("""
        from ampx import _ext
        print(_ext.BACKEND, *sorted(m for m in sys.modules if m.split(".")[0] in ("ampx", "wrapt")))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "AMPX_TELEMETRY": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    return set(run.stdout.split())


@pytest.mark.parametrize("level,dtype", [("O1", "bf16"), ("O1", "fp16"), ("O2", "bf16")])
def test_training_loads_no_tool_it_did_not_ask_for(level: str, dtype: str) -> None:
    loaded = _loaded_after(f"""
        amp = ampx.Amp("{level}", dtype="{dtype}", verbosity=0)
        model, opt = amp.initialize(model, opt)
        for _ in range(3):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    """)
    assert "ampx.session" in loaded and "ampx.overflow.watch" in loaded  # the check sees them
    assert not loaded & set(ON_DEMAND), sorted(loaded & set(ON_DEMAND))
    # the extension's kernels ran the pass: the reference kernels were never imported
    assert ("ampx._reference" in loaded) == ("native" not in loaded)


def test_the_tools_load_when_asked_for() -> None:
    # a skipped step reads the flags; the detector and the numerics monitor load with their
    # options
    loaded = _loaded_after("""
        amp = ampx.Amp("O1", dtype="fp16", verbosity=0, detect_overflow="forward",
                       numerics="report")
        model, opt = amp.initialize(model, opt)
        loss = model(torch.randn(4, 8)).float().pow(2).mean() * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        assert ampx.step_was_skipped(opt)
        amp.numerics_report()
    """)
    assert {"ampx.overflow.flags", "ampx.overflow.forward", "ampx.overflow.numerics",
            "ampx.overflow.numerics_report"} <= loaded
    assert "wrapt" not in loaded
