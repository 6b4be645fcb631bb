"""The `apex` alias of `ampx run`: resolution, not shadowing a real apex, `_amp_state` view."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ampx
from ampx.compat import apex_alias

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    apex_alias.real_apex_spec() is not None, reason="a real apex is installed here"
)


def _drop_apex_modules() -> None:
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        del sys.modules[name]


@pytest.fixture
def alias() -> Iterator[None]:
    assert apex_alias.install() is True
    try:
        yield
    finally:
        apex_alias.uninstall()
        _drop_apex_modules()
        ampx.restore()


def test_alias_resolves_to_ampx_amp(alias: None) -> None:
    import apex
    import apex.amp
    from apex import amp
    from apex.amp import _amp_state
    from apex.amp._amp_state import _amp_state as state_from_submodule

    assert amp is ampx.amp is apex.amp
    assert _amp_state is ampx.amp._amp_state is state_from_submodule
    assert "state_dict" in amp.__dict__  # how some scripts detect checkpoint support
    assert importlib.util.find_spec("apex") is not None  # `is_apex_available()` checks
    assert apex_alias.is_installed()


def test_uninstall_removes_everything(alias: None) -> None:
    import apex.amp  # noqa: F401

    apex_alias.uninstall()
    assert not apex_alias.is_installed()
    assert "apex" not in sys.modules and "apex.amp" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("apex")
    assert ampx.amp.__name__ == "ampx.amp"  # the real module is left alone


def test_other_apex_packages_name_their_replacement(alias: None) -> None:
    with pytest.raises(ModuleNotFoundError, match="DistributedDataParallel"):
        importlib.import_module("apex.parallel")
    with pytest.raises(ModuleNotFoundError, match="fused=True"):
        from apex.optimizers import FusedAdam  # noqa: F401


def test_install_twice_is_harmless(alias: None) -> None:
    assert apex_alias.install() is True
    assert sys.meta_path.count(apex_alias._FINDER) == 1


@pytest.fixture
def fake_real_apex(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    package = tmp_path / "apex"
    package.mkdir()
    (package / "__init__.py").write_text("REAL_APEX = True\n")
    (package / "amp.py").write_text("REAL_APEX_AMP = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield package
    finally:
        apex_alias.uninstall()
        _drop_apex_modules()


def test_real_apex_is_not_shadowed(fake_real_apex: Path) -> None:
    assert apex_alias.real_apex_spec() is not None
    assert apex_alias.install() is False
    from apex import amp

    assert getattr(amp, "REAL_APEX_AMP", False)


def test_force_shadows_a_real_apex(fake_real_apex: Path) -> None:
    import apex  # the real one, already imported

    assert getattr(apex, "REAL_APEX", False)
    assert apex_alias.install(force=True) is True
    from apex import amp

    assert amp is ampx.amp


def test_amp_state_view_reads_and_writes_live_scalers(alias: None) -> None:
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype="bf16",
                                      loss_scale="dynamic", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.loss_scale() == 2.0**16

    scaler._loss_scale = 1024.0
    scaler._scale_seq_len = 2
    scaler._unskipped = 0
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1024.0
    for _ in range(2):  # two clean steps reach the (written) window: the scale doubles
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert scaler.loss_scale() == 2048.0
    assert scaler._unskipped == 0
    assert amp._amp_state.loss_scalers[0] is scaler


LEGACY_SCRIPT = textwrap.dedent("""
    import sys
    import apex
    from apex import amp
    print("apex-file", getattr(apex, "__file__", None))
    print("ampx-alias", getattr(apex, "__ampx_alias__", False))
""")


def _run(args: list[str], cwd: Path, pythonpath: tuple[str, ...] = ()
         ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *pythonpath])
    return subprocess.run([sys.executable, "-m", "ampx", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_run_does_not_shadow_real_apex_on_sys_path(tmp_path: Path) -> None:
    real = tmp_path / "site"
    (real / "apex").mkdir(parents=True)
    (real / "apex" / "__init__.py").write_text("")
    (real / "apex" / "amp.py").write_text("")
    script = tmp_path / "legacy.py"
    script.write_text(LEGACY_SCRIPT)

    proc = _run(["run", str(script)], tmp_path, (str(real),))
    assert proc.returncode == 0, proc.stderr
    assert f"apex-file {real / 'apex' / '__init__.py'}" in proc.stdout
    assert "ampx-alias False" in proc.stdout

    proc = _run(["run", "--force-apex-alias", str(script)], tmp_path, (str(real),))
    assert proc.returncode == 0, proc.stderr
    assert "ampx-alias True" in proc.stdout

    proc = _run(["run", str(script)], tmp_path)  # no real apex: the alias
    assert proc.returncode == 0, proc.stderr
    assert "ampx-alias True" in proc.stdout
