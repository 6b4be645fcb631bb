"""`ampx run` warns at exit when the script never called `initialize` (nothing was forced)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ampx.cli import main as cli

PLAIN = textwrap.dedent("""
    import torch
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
""")

WITH_INIT = textwrap.dedent("""
    import torch
    from apex import amp
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    {body}
""")

STEP = """
    optimizer.zero_grad()
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    import ampx
    ampx.restore()  # the default session is gone at exit: the step still counts
"""


def run(tmp_path: Path, text: str, *args: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(text)
    assert cli.main(["run", *args, str(script)]) == 0


@pytest.mark.parametrize("forced", [["-O", "O1"], []], ids=["forced", "plain"])
def test_a_script_that_never_initializes_is_warned_about(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], forced: list[str]) -> None:
    run(tmp_path, PLAIN, *forced)
    err = capsys.readouterr().err
    assert "never called amp.initialize" in err and "3 optimizer step(s)" in err
    assert ("forced options (opt_level='O1') were not applied" in err) == bool(forced)


@pytest.mark.parametrize("body", ["", STEP], ids=["init-only", "init-and-step"])
def test_no_warning_when_the_script_initializes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str) -> None:
    run(tmp_path, WITH_INIT.format(body=textwrap.dedent(body)), "-O", "O1")
    assert "never called amp.initialize" not in capsys.readouterr().err


def test_no_warning_for_a_script_that_does_nothing_and_forces_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tmp_path, "print('hello')\n")
    assert "never called amp.initialize" not in capsys.readouterr().err
