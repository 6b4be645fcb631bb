"""`ampx.integrations.lightning.AmpxPrecision` in Lightning's Trainer and Fabric (CPU).

Each Trainer run is compared bitwise with the same loop written by hand with ampx: same seed,
same batches, same optimizer and per-step scheduler.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampx

pl = pytest.importorskip("lightning.pytorch")
fabric_mod = pytest.importorskip("lightning.fabric")
from ampx.integrations.lightning import AmpxPrecision  # noqa: E402

pytestmark = [
    # Lightning's advice for real runs, about tiny CPU test loaders: not ours to fix
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*log_every_n_steps:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*GPU available but not used:UserWarning"),
    # lightning 2.6's pytree use against torch 2.13's deprecation
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.:FutureWarning"),
]

LEVELS = ["O1", "O2", "O3"]
DTYPES = ["fp16", "bf16"]


def data(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def loader(n: int = 40) -> DataLoader:
    return DataLoader(data(n), batch_size=8, shuffle=False)


class Net(pl.LightningModule):
    def __init__(self, overflow_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Linear(16, 4))
        self.overflow_at = overflow_at
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = loss_of(self.net(x), y, self.global_step == self.overflow_at)  # a submodule
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return configure(self)


def loss_of(out: torch.Tensor, y: torch.Tensor, overflow: bool) -> torch.Tensor:
    loss = nn.functional.cross_entropy(out.float(), y)
    return loss * float("inf") if overflow else loss


def configure(model: nn.Module) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(plugin: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("max_epochs", 1)
    return pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None,
                      enable_progress_bar=False, logger=False, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def by_hand(level: str, dtype: str, overflow_at: int | None = None, n: int = 40
            ) -> tuple[list[torch.Tensor], list[float], Any]:
    """The hand-written loop: its weights (taken before restore, which takes the fp32
    state-dict hook off), losses and scheduler."""
    torch.manual_seed(0)
    model = Net()
    conf = configure(model)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    model, opt = ampx.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    losses = []
    for i, (x, y) in enumerate(loader(n)):
        opt.zero_grad()
        loss = loss_of(model(x), y, i == overflow_at)
        losses.append(loss.item())
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        sched.step()
    want = weights(model)
    ampx.restore()
    return want, losses, sched


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_trainer_matches_the_hand_written_loop(level: str, dtype: str) -> None:
    want, want_losses, _ = by_hand(level, dtype)
    torch.manual_seed(0)
    model = Net()
    run = trainer(AmpxPrecision(opt_level=level, dtype=dtype))
    run.fit(model, loader())
    assert run.global_step == 5
    assert model.losses == want_losses
    assert same(weights(model), want)
    if level != "O1":
        assert model.net[0].weight.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float16)


def test_skipped_steps_count_as_lightning_counts_gradscaler_skips() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    want, _, want_sched = by_hand("O2", "fp16", overflow_at=2)
    torch.manual_seed(0)
    model = Net(overflow_at=2)
    plugin = AmpxPrecision(opt_level="O2", dtype="fp16")
    run = trainer(plugin)
    run.fit(model, loader())
    assert same(weights(model), want)
    state = plugin.amp.optimizers[0]._ampx
    assert state.skipped_steps == 1 and state.steps == 5

    torch.manual_seed(0)
    native = Net(overflow_at=2)
    ref = trainer(MixedPrecision("16-mixed", "cpu"))
    ref.fit(native, loader())
    # Lightning counts a step that GradScaler skipped, and steps the scheduler after it
    assert run.global_step == ref.global_step == 5
    lr = run.optimizers[0].param_groups[0]["lr"]
    assert lr == ref.optimizers[0].param_groups[0]["lr"] == want_sched.get_last_lr()[0]


def test_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net(overflow_at=0)  # a skipped step halves the loss scale: the scaler must resume
    trainer(AmpxPrecision(opt_level="O2", dtype="fp16"), max_epochs=2).fit(model, loader(16))
    want = weights(model)

    torch.manual_seed(0)
    first = Net(overflow_at=0)
    run = trainer(AmpxPrecision(opt_level="O2", dtype="fp16"), max_epochs=1)
    run.fit(first, loader(16))
    run.save_checkpoint(tmp_path / "one.ckpt")
    saved = torch.load(tmp_path / "one.ckpt", weights_only=False)
    assert saved["AmpxPrecision"]["loss_scaler0"]["loss_scale"] == 2.0**15

    torch.manual_seed(123)  # other initial weights: everything comes from the checkpoint
    resumed = Net(overflow_at=0)
    plugin = AmpxPrecision(opt_level="O2", dtype="fp16")
    run = trainer(plugin, max_epochs=2)
    run.fit(resumed, loader(16), ckpt_path=tmp_path / "one.ckpt")
    assert run.global_step == 4
    assert same(weights(resumed), want)
    assert plugin.amp.loss_scale() == 2.0**15


def test_manual_optimization_and_clipping_on_the_masters() -> None:
    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.norms: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            opt = self.optimizers()
            x, y = batch
            opt.zero_grad()
            self.manual_backward(loss_of(self.net(x), y, False))
            self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
            masters = ampx.master_params(opt)  # a LightningOptimizer: unwrapped
            self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in masters])))
            opt.step()

    torch.manual_seed(0)
    model = Manual()
    run = trainer(AmpxPrecision(opt_level="O2", dtype="bf16"))
    run.fit(model, loader())
    assert run.global_step == 5
    assert all(abs(n - 1e-3) < 1e-6 for n in model.norms)
    assert all(p.dtype == torch.float32 for p in ampx.master_params(run.optimizers[0]))


@pytest.mark.parametrize("level", LEVELS)
def test_fabric_matches_the_hand_written_loop(level: str) -> None:
    want, want_losses, _ = by_hand(level, "fp16")
    torch.manual_seed(0)
    model = Net()
    conf = configure(model)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    precision = AmpxPrecision(opt_level=level, dtype="fp16")
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model, opt = fabric.setup(*precision.initialize(model, opt))
    losses = []
    for x, y in fabric.setup_dataloaders(loader(), move_to_device=False):
        opt.zero_grad()
        loss = loss_of(model(x), y, False)
        losses.append(loss.item())
        fabric.backward(loss)
        opt.step()
        sched.step()
    assert losses == want_losses
    assert same(weights(model), want)


def test_fabric_save_and_load_carry_the_loss_scaler(tmp_path: Path) -> None:
    precision = AmpxPrecision(opt_level="O2", dtype="fp16")
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(*precision.initialize(model, opt))
    x, y = next(iter(loader()))
    fabric.backward(loss_of(model(x), y, True))  # an overflow halves the scale
    opt.step()
    assert ampx.step_was_skipped(opt) and precision.amp.loss_scale() == 2.0**15
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "amp": precision})

    other = AmpxPrecision(opt_level="O2", dtype="fp16")
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, plugins=[other])
    model2 = Net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    model2, opt2 = fabric.setup(*other.initialize(model2, opt2))
    fabric.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2, "amp": other})
    assert other.amp.loss_scale() == 2.0**15
    assert same(weights(model2), weights(model))


def test_fabric_without_initialize_says_what_to_do() -> None:
    precision = AmpxPrecision(opt_level="O2", dtype="bf16")
    fabric = fabric_mod.Fabric(accelerator="cpu", devices=1, plugins=[precision])
    model = Net()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"precision.initialize\(model, optimizer\)"):
        model(torch.randn(4, 8))


def test_a_second_fit_with_the_same_plugin_is_refused() -> None:
    plugin = AmpxPrecision(opt_level="O1", dtype="bf16")
    model = Net()
    trainer(plugin).fit(model, loader(8))
    with pytest.raises(RuntimeError, match="earlier fit"):
        trainer(plugin).fit(model, loader(8))


def test_bad_options_fail_when_the_plugin_is_made() -> None:
    with pytest.raises(ValueError, match="optimization level O4"):
        AmpxPrecision(opt_level="O4")


def test_importing_ampx_imports_no_framework() -> None:
    code = ("import sys, ampx, ampx.integrations; ampx.initialize; print(sorted(m for m in "
            "('lightning', 'accelerate', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.strip() == "[]"


DDP_SCRIPT = Path(__file__).with_name("_lightning_ddp.py")


@pytest.mark.slow
def test_ddp_two_cpu_processes_keep_ranks_bitwise_equal(tmp_path: Path) -> None:
    env = dict(os.environ, AMPX_TEST_OUT=str(tmp_path), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(DDP_SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 4
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == 1  # rank 1's overflow skips both
    assert same(ranks[0]["weights"], ranks[1]["weights"])
    assert ranks[0]["dtype"] == "torch.float16"


FABRIC_DDP_SCRIPT = Path(__file__).with_name("_lightning_fabric_ddp.py")
FABRIC_DDP_CASES = ["O1-bf16", "O2-bf16", "O1-fp16", "O2-fp16"]


@pytest.fixture(scope="module")
def fabric_ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    """Both ranks' numbers (results.json) and tensors (rank<R>.pt) from the Fabric DDP worker."""
    from _two_ranks import launch

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path_factory.mktemp("fabric_ddp")
    numbers = launch(str(FABRIC_DDP_SCRIPT), out)
    return numbers, [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("case", FABRIC_DDP_CASES)
def test_fabric_ddp_two_cpu_processes_keep_ranks_bitwise_equal(fabric_ddp: Any, case: str
                                                                ) -> None:
    (num0, num1), (ten0, ten1) = ((r[case] for r in side) for side in fabric_ddp)
    assert num0["losses"][0] != num1["losses"][0]  # each rank its own batches: the all-reduce
    assert num0["steps"] == num1["steps"] == 5     # is what keeps the weights equal
    assert same(ten0["params"], ten1["params"])
    assert same(ten0["masters"], ten1["masters"])
    assert num0["loss_scale"] == num1["loss_scale"]
    level, dtype = case.split("-")
    half = "torch.bfloat16" if dtype == "bf16" else "torch.float16"
    assert num0["param_dtype"] == (half if level == "O2" else "torch.float32")
    if level == "O2":
        assert all(t.dtype == torch.float32 for t in ten0["masters"])
    if dtype == "fp16":  # the inf was in rank 1's all-reduced gradients only, at step 2
        assert num0["skipped"] == num1["skipped"] == [False, False, True, False, False]
        assert num0["local_inf"][2] == [] and num1["local_inf"][2] != []
        assert num0["loss_scale"] == 2.0**15  # halved once, on both ranks
    else:
        assert not any(num0["skipped"]) and not any(num1["skipped"])


@pytest.mark.slow
def test_fabric_ddp_without_the_gradient_all_reduce_the_ranks_diverge(fabric_ddp: Any) -> None:
    """The control: the same run under `no_backward_sync` ends with different weights, so the
    comparison above sees a rank that drifts."""
    (num0, num1), (ten0, ten1) = ((r["O2-bf16-unsynced"] for r in side) for side in fabric_ddp)
    assert num0["steps"] == num1["steps"] == 5
    assert not same(ten0["params"], ten1["params"])
    assert not same(ten0["masters"], ten1["masters"])
