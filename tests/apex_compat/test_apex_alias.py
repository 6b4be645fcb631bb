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

ROOT = Path(__file__).resolve().parents[2]

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
    with pytest.raises(ModuleNotFoundError, match="Megatron-Core"):
        importlib.import_module("apex.transformer")
    with pytest.raises(ModuleNotFoundError, match="torch or torchao"):
        importlib.import_module("apex.contrib.optimizers")
    with pytest.raises(ModuleNotFoundError, match="torchrun"):
        importlib.import_module("apex.parallel.multiproc")
    with pytest.raises(ImportError, match=r"torch\.optim\.Adagrad"):
        from apex.optimizers import FusedAdagrad  # noqa: F401
    with pytest.raises(ImportError, match="weight_norm"):
        from apex.fp16_utils import Fused_Weight_Norm  # noqa: F401
    with pytest.raises(ImportError, match="InstanceNorm3d"):
        from apex.normalization import InstanceNorm3dNVFuser  # noqa: F401


def test_companions_resolve_to_ampx_implementations(alias: None) -> None:
    import apex.fp16_utils.loss_scaler as loss_scaler
    import apex.parallel.LARC
    from apex.fp16_utils import FP16_Optimizer
    from apex.normalization import FusedLayerNorm
    from apex.normalization.fused_layer_norm import MixedFusedLayerNorm
    from apex.optimizers import FusedAdam
    from apex.optimizers.fused_lamb import FusedLAMB
    from apex.parallel import DistributedDataParallel, convert_syncbn_model
    from apex.parallel.LARC import LARC

    from ampx.compat.apex import fp16_utils, larc, normalization, optimizers, parallel

    assert FusedAdam is optimizers.FusedAdam and FusedLAMB is optimizers.FusedLAMB
    assert FusedLayerNorm is normalization.FusedLayerNorm
    assert MixedFusedLayerNorm is normalization.MixedFusedLayerNorm
    assert FP16_Optimizer is fp16_utils.FP16_Optimizer
    assert loss_scaler.DynamicLossScaler is fp16_utils.DynamicLossScaler
    assert DistributedDataParallel is parallel.DistributedDataParallel
    assert convert_syncbn_model is parallel.convert_syncbn_model
    assert LARC is larc.LARC is apex.parallel.LARC.LARC
    # The ampx modules keep their own names and attributes.
    assert parallel.__name__ == "ampx.compat.apex.parallel" and parallel.LARC is LARC
    assert sys.modules["apex.parallel"].__name__ == "apex.parallel"
    apex_alias.uninstall()
    _drop_apex_modules()
    apex_alias.install()
    import apex as bare  # apex's __init__ imported its companions: attribute access works

    assert bare.optimizers.FusedAdam is FusedAdam and bare.fp16_utils.FP16_Optimizer is \
        FP16_Optimizer
    with pytest.raises(AttributeError):
        bare.contrib  # noqa: B018


def test_apex_imagenet_example_import_block(alias: None) -> None:
    """examples/imagenet/main_amp.py's try block, verbatim (it raises ImportError otherwise)."""
    namespace: dict = {}
    exec(textwrap.dedent("""
        from apex.parallel import DistributedDataParallel as DDP
        from apex.fp16_utils import *
        from apex import amp, optimizers
        from apex.multi_tensor_apply import multi_tensor_applier
    """), namespace)
    assert namespace["amp"] is ampx.amp and namespace["to_python_float"](torch.tensor(1.5)) == 1.5
    assert namespace["optimizers"].FusedAdam.__module__ == "ampx.compat.apex.optimizers"
    applier = namespace["multi_tensor_applier"]
    assert applier.available is False  # as in an apex built without its CUDA extension
    with pytest.raises(RuntimeError, match="torch._foreach_"):
        applier(None, torch.zeros(1, dtype=torch.int), [[torch.zeros(2)]])


def test_uninstall_removes_companions(alias: None) -> None:
    import apex.optimizers.fused_adam  # noqa: F401
    import apex.parallel  # noqa: F401

    apex_alias.uninstall()
    apex_alias.uninstall()  # idempotent
    assert not [n for n in sys.modules if n == "apex" or n.startswith("apex.")]
    assert "ampx.compat.apex.optimizers" in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("apex.optimizers")
    assert apex_alias.install() is True  # and back
    from apex.optimizers import FusedSGD

    assert FusedSGD.__module__ == "ampx.compat.apex.optimizers"


def test_install_imports_nothing() -> None:
    """install()/uninstall() add no module (a sitecustomize may call them in every child)."""
    code = ("import sys; from ampx.compat import apex_alias; before = set(sys.modules); "
            "apex_alias.install(); apex_alias.install(); apex_alias.uninstall(); "
            "apex_alias.install(); print(sorted(set(sys.modules) - before))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


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
