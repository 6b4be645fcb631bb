"""The numerics report (``numerics="report"``): models built to fail in known places.

Each model has one module that breaks in a known way; the report must rank it first, with the
right issue, at O1 and O2; its advice lines, applied, must remove the problem; the report
must not change training (bitwise), must install nothing when off, and must aim the fp32
fallback at the module where an overflow starts.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import ampx
from ampx.o1 import patch
from ampx.overflow.numerics import NumericsMonitor, _read, _read_stacked, tensor_stats
from ampx.overflow.numerics_stats import decode, measure
from ampx.registry import SESSIONS

D = 16


class LargeLogits(nn.Module):
    """A softmax over logits offset by 500: half's spacing there (fp16 0.25, bf16 4) wrecks it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        with torch.no_grad():
            self.proj.bias.fill_(500.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).softmax(-1) * 4.0


class Zoo(nn.Module):
    """inp -> [case module] -> mid -> norm -> head, plus a side branch; `case` picks the fault.

    - "big": mid is a Linear whose fp16 output exceeds 65504;
    - "logits": mixer is a softmax over large logits (precision, fp16 and bf16);
    - "norm": norm (a LayerNorm) is fed activations near fp16's limit;
    - "under": branch's gradients underflow fp16 at a loss scale of 2^16.
    """

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.inp = nn.Linear(D, D)
        self.mixer: nn.Module = LargeLogits() if case == "logits" else nn.Identity()
        self.mid = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)
        self.branch = nn.Linear(D, D)
        if case == "big":
            with torch.no_grad():
                self.mid.weight.mul_(1e6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mixer(torch.relu(self.inp(x)))
        h = self.mid(h)
        if self.case == "norm":
            h = h * 1e4
        out = self.head(self.norm(h)).float().mean()
        if self.case == "under":
            out = out + self.branch(h).float().mean() * 2.0**-30
        return out


def train(case: str, steps: int = 6, seed: int = 0, **options):
    torch.manual_seed(seed)
    model = Zoo(case)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    options.setdefault("verbosity", 0)
    model, opt = ampx.initialize(model, opt, **options)
    gen = torch.Generator().manual_seed(seed + 1)
    skipped = 0
    for _ in range(steps):
        loss = model(torch.randn(8, D, generator=gen) * 3)
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        skipped += ampx.step_was_skipped(opt)
    return model, opt, skipped


CASES = [("big", "fp16", "mid", "overflow"), ("norm", "fp16", "norm", "near overflow"),
         ("under", "fp16", "branch", "underflow"), ("logits", "fp16", "mixer", "precision"),
         ("logits", "bf16", "mixer", "precision")]


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("case,dtype,module,issue", CASES)
def test_report_ranks_the_faulty_module_first(case, dtype, module, issue, level):
    train(case, opt_level=level, dtype=dtype, numerics="report", numerics_every=2,
          numerics_shadow_every=1)
    report = ampx.numerics_report()
    first = report.modules[0]
    assert (first.name, first.issue) == (module, issue), report.table()
    # nothing outside it is judged to break on its own (others at most carry its inf/NaN)
    for other in report.modules[1:]:
        if not other.name.startswith(module + "."):
            assert other.issue not in ("overflow", "precision", "underflow"), report.table()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_keep_fp32_advice_removes_the_overflow(level):
    train("big", opt_level=level, dtype="fp16", numerics="report", numerics_every=1)
    advice = ampx.numerics_report().advice()
    keep = next(line for line in advice if "keep_fp32=" in line)
    # O2 casts mid's output back to fp16, where it overflows again: the advice moves to O1
    assert keep == "ampx.initialize(model, optimizer, opt_level=\"O1\", keep_fp32=['mid'])"
    # paste it: the same run with that line's options has no forward overflow anywhere
    train("big", opt_level="O1", dtype="fp16", numerics="report", numerics_every=1,
          keep_fp32=["mid"])
    fixed = ampx.numerics_report()
    assert all(not m.overflow for m in fixed.modules), fixed.table()
    assert "overflow" not in {m.issue for m in fixed.modules}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_bf16_advice_removes_the_overflow(level):
    train("big", opt_level=level, dtype="fp16", numerics="report", numerics_every=1)
    assert f'ampx.initialize(model, optimizer, opt_level="{level}", dtype="bf16")' in \
        ampx.numerics_report().advice()
    train("big", opt_level=level, dtype="bf16", numerics="report", numerics_every=1)
    assert all(not m.overflow for m in ampx.numerics_report().modules)


def test_keep_fp32_advice_for_an_internal_overflow_at_o2():
    """An overflow inside a module whose output is in range: keep_fp32 works at O2 as well."""
    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(D, D)
            with torch.no_grad():
                self.q.weight.mul_(60.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x)
            return (q @ q.transpose(-1, -2)).softmax(-1) @ x

    def run(**options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, D), Scores(), nn.Linear(D, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, opt = ampx.initialize(model, opt, opt_level="O2", dtype="fp16", verbosity=0,
                                     numerics="report", numerics_every=1, **options)
        for _ in range(3):
            loss = model(torch.randn(8, D) * 3).float().mean()
            with ampx.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        return ampx.numerics_report()

    report = run()
    assert (report.modules[0].name, report.modules[0].issue) == ("1", "overflow")
    assert 'ampx.initialize(model, optimizer, opt_level="O2", keep_fp32=[\'1\'])' in \
        report.advice()
    fixed = run(keep_fp32=["1"])
    assert all(not m.overflow for m in fixed.modules), fixed.table()


def test_loss_scale_range_keeps_gradients_normal():
    train("under", steps=4, opt_level="O1", dtype="fp16", numerics="report", numerics_every=1,
          init_scale=2.0**16)
    report = ampx.numerics_report()
    low, high = report.scale_range()
    assert low > 16  # the branch needs a larger scale than 2^16 ...
    line = next(x for x in report.advice() if "min_loss_scale" in x or "no loss scale" in x)
    assert line  # ... and says what range (or that none fits)


def test_report_does_not_change_training_bitwise():
    plain, _, _ = train("big", steps=5, opt_level="O1", dtype="fp16")
    watched, _, _ = train("big", steps=5, opt_level="O1", dtype="fp16", numerics="report",
                          numerics_every=1, numerics_shadow_every=1)
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)


def _monitor_hooks(model: nn.Module) -> list:
    """Forward hooks on `model` other than the weight-cast cache's (an O1 session's)."""
    return [h for m in model.modules() for h in m._forward_hooks.values()
            if h is not patch.forward_ends]


def test_off_installs_nothing_and_on_unhooks_between_watched_steps():
    model, _, _ = train("norm", steps=2, opt_level="O1", dtype="fp16")
    assert not _monitor_hooks(model)
    model, _, skipped = train("norm", steps=3, opt_level="O1", dtype="fp16",
                              numerics="report", numerics_every=10, init_scale=1.0)
    assert skipped == 0
    monitor = SESSIONS.default.overflow_watch.numerics
    assert not monitor.armed and monitor.watched == 1  # step 0 only
    assert not _monitor_hooks(model)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters()
               if getattr(p, "_post_accumulate_grad_hooks", None) is not None)


def test_restore_takes_the_monitor_off_and_keeps_the_report():
    model, opt, _ = train("big", steps=2, opt_level="O1", dtype="fp16", numerics="report",
                          numerics_every=1)
    monitor = SESSIONS.default.overflow_watch.numerics
    assert monitor.armed
    ampx.restore()
    assert not monitor.armed
    assert all(not m._forward_hooks for m in model.modules())
    model(torch.randn(8, D)).backward()  # nothing of ampx's acts after restore
    assert all(not m._forward_hooks for m in model.modules()) and not monitor.armed


def test_shadow_leaves_batchnorm_statistics_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Linear(D, 1))
    ref = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Linear(D, 1))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O1", dtype="bf16", verbosity=0,
                                 numerics="report", numerics_every=1, numerics_shadow_every=1)
    x = torch.randn(8, D)
    model(x).float().sum()
    with ampx.disable_casts():
        ref(x)
    assert torch.equal(model[1].num_batches_tracked, ref[1].num_batches_tracked)
    assert model[1].num_batches_tracked.item() == 1


def test_fallback_aimed_by_the_report_takes_the_origin():
    patience = 3
    _, _, skipped = train("big", steps=12, opt_level="O1", dtype="fp16", numerics="report",
                          on_overflow="fp32-fallback", overflow_patience=patience,
                          init_scale=1.0)
    watch = SESSIONS.default.overflow_watch
    assert list(watch.fallbacks) == ["mid"]
    assert skipped <= patience + 1
    report = ampx.numerics_report()
    assert report.fallbacks and report.fallbacks[0][0] == "mid"
    assert any("fp32 fallback moved mid" in line for line in report.advice())


def test_unwatched_skip_is_not_attributed_then_the_next_is():
    """An overflow that starts on an unwatched step: patience + 1 skips at most."""
    patience = 2
    torch.manual_seed(0)
    model = Zoo("plain")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = ampx.initialize(model, opt, opt_level="O1", dtype="fp16", verbosity=0,
                                 numerics="report", numerics_every=100, init_scale=1.0,
                                 on_overflow="fp32-fallback", overflow_patience=patience)
    skipped = 0
    for step in range(12):
        if step == 5:
            with torch.no_grad():
                model.mid.weight.mul_(1e6)
        loss = model(torch.randn(8, D) * 3)
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        skipped += ampx.step_was_skipped(opt)
    assert list(SESSIONS.default.overflow_watch.fallbacks) == ["mid"]
    assert skipped <= patience + 1


def test_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    train("big", opt_level="O1", dtype="fp16", numerics="report", numerics_every=1)
    report = ampx.numerics_report()
    paths = report.write(tmp_path)
    assert sorted(p.suffix for p in paths) == [".csv", ".json", ".png", ".txt"]
    data = json.loads((tmp_path / "numerics.json").read_text())
    assert data["modules"][0]["name"] == "mid" and data["advice"]
    rows = (tmp_path / "numerics.csv").read_text().splitlines()
    assert rows[0].startswith("rank,name,leaf,issue") and rows[1].startswith("1,mid,True,overflow")
    assert len(rows) == 1 + len(report.modules)
    assert (tmp_path / "numerics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(report.history["modules"]) == len(report.modules)  # one heat-map row each


def test_tensor_stats_counts():
    t = torch.tensor([0.0, 1e-6, 1.0, 7e4, float("inf"), float("nan")])
    maxabs, over, under, zero, minnz, numel = tensor_stats(t, 2.0**-14).tolist()
    assert not math.isfinite(maxabs)  # NaN here, read as inf by the monitor
    assert (over, under, zero, numel) == (2, 1, 1, 6)
    half = tensor_stats(torch.tensor([0.0, 1e-6, 1.0, 7e3], dtype=torch.float16), 2.0**-14)
    assert half.tolist()[:4] == [7000.0, 0, 1, 1]
    assert minnz == pytest.approx(1e-6)  # the smallest magnitude, a NaN notwithstanding
    finite = tensor_stats(torch.tensor([0.0, -1e-6, 3.0]), 2.0**-14).tolist()
    assert finite[4] == pytest.approx(1e-6) and finite[0] == 3.0


def _reference_stats(t: torch.Tensor, tiny: float) -> list[float]:
    """tensor_stats' row the slow way: float64 comparisons (a NaN makes the max inf and is
    no one's minimum; overflow is non-finite in t's own dtype)."""
    a = t.double().abs().flatten()
    nan = torch.isnan(a)
    nonzero = a[(a != 0) & ~nan]
    return [math.inf if nan.any() else a.max().item(), (~torch.isfinite(a)).sum().item(),
            ((a > 0) & (a < tiny)).sum().item(), (a == 0).sum().item(),
            nonzero.min().item() if nonzero.numel() else math.inf, a.numel()]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_tensor_stats_matches_float_comparisons(dtype, half):
    # magnitudes over the whole range of dtype, subnormals, both zeros, inf and NaN; strided
    gen = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    exps = torch.randint(int(math.log2(info.smallest_normal)) - 12, int(math.log2(info.max)),
                         (40, 50), generator=gen)
    x = (torch.randn(40, 50, generator=gen, dtype=torch.float64) * 2.0 ** exps).to(dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    x[1, :3] = torch.tensor([info.smallest_normal, -info.smallest_normal / 4, 0.0])
    tiny = float(torch.finfo(half).tiny)
    # with and without zeros (the CPU's smallest non-zero takes a shortcut without), all zero,
    # all NaN, a subnormal minimum
    for t in (x, x.t(), x[2:], x[2:].abs() + 1, x[1, :2], torch.zeros(3, dtype=dtype),
              torch.full((2,), math.nan, dtype=dtype)):
        want = _reference_stats(t, tiny)
        assert tensor_stats(t, tiny).tolist() == want, (t.dtype, t.shape)
        parts, f = measure(t, tiny, eager=False)  # as off the CPU: every count computed
        assert all(isinstance(p, torch.Tensor) for p in parts)
        assert decode(_read_stacked(parts), f, t.numel()) == want, (t.dtype, t.shape)


def test_reading_parts_keeps_their_order_and_values():
    parts = [torch.tensor(3, dtype=torch.int16), torch.tensor(2**40), torch.tensor(-7),
             torch.tensor(0.25), torch.tensor(2**15 - 1, dtype=torch.int16)]
    want = [3, 2**40, -7, 0.25, 2**15 - 1]
    assert _read(parts) == _read_stacked(parts) == want  # the accelerator path, on the CPU
    assert _read([5, *parts]) == _read_stacked([5, *parts]) == [5, *want]  # host ints kept
    assert _read([]) == _read_stacked([]) == []


def test_outputs_are_measured_once_and_before_an_in_place_change(monkeypatch):
    """The monitor reuses a module's output numbers for the module fed it and for a parent
    returning it, and an input's for another module fed it; an output changed in place
    afterwards (an inplace ReLU) is a new tensor."""
    import ampx.overflow.numerics as numerics

    calls: list[str] = []
    for name in ("measure", "measure_max", "measure_flush"):
        real = getattr(numerics, name)
        monkeypatch.setattr(numerics, name, lambda t, tiny, real=real, name=name: (
            calls.append(name), real(t, tiny))[1])

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.out = nn.Linear(D, D), nn.ReLU(inplace=True), nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.act(self.fc(x)))

    torch.manual_seed(0)
    model, x, tiny = Block(), torch.randn(8, D), 2.0**-14
    monitor = NumericsMonitor([model], torch.float16, every=1, shadow_every=0)
    with torch.no_grad():
        h = model.fc(x)
        y = model(x)
    model(x).pow(2).sum().backward()
    monitor.step()
    # x once (fc, root); fc's, act's (its input too) and out's outputs (root: out's) and
    # their gradients; four parameters
    assert sorted(calls) == ["measure"] * 6 + ["measure_flush"] * 4 + ["measure_max"]
    got = {name: monitor.samples[i][-1] for i, name in enumerate(monitor.names)}
    assert got["fc"].forward == _reference_stats(h, tiny)  # before the ReLU changed it
    assert got["act"].forward == _reference_stats(h.clamp_min(0), tiny)
    assert got["out"].inputs == got["act"].forward[0]
    assert got["fc"].inputs == got["(root)"].inputs == x.abs().max()
    assert got["out"].forward == _reference_stats(y, tiny) == got["(root)"].forward
    assert got["(root)"].grad == got["out"].grad == _reference_stats(2 * y, tiny)
    # the gradient at fc's output went through the ReLU's mask; at act's output it did not
    assert got["fc"].grad[3] == (h <= 0).sum() > 0 and got["act"].grad[3] == 0
    # parameters: the counts only (a unit dead on the whole batch has zero gradients)
    grads = torch.cat([p.grad.flatten() for p in model.fc.parameters()])
    top, _, under, zeros, low, numel = got["fc"].params
    assert (under, zeros, numel) == (0, (grads == 0).sum(), D * D + D) and zeros > 0
    assert math.isnan(top) and math.isnan(low)


def test_bad_options_are_refused_cleanly():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="numerics"):
        ampx.initialize(model, opt, opt_level="O1", numerics="yes")
    with pytest.raises(ValueError, match="keep_fp32"):
        ampx.initialize(model, opt, opt_level="O1", keep_fp32=[3])
    with pytest.raises(ValueError, match="no module 'nope'"):
        ampx.initialize(model, opt, opt_level="O1", keep_fp32=["nope"])
    assert model.weight.dtype == torch.float32 and not hasattr(opt, "_ampx")
    with pytest.raises(RuntimeError, match='numerics="report"'):
        ampx.numerics_report()
    with pytest.raises(ValueError, match="every"):
        NumericsMonitor([model], torch.float16, every=0)


LEGACY_SCRIPT = '''
import sys
import torch
from torch import nn
from apex import amp

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))
with torch.no_grad():
    model[1].weight.mul_(1e6)  # fp16 overflows in layer 1's output
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = amp.initialize(model, opt, opt_level="O1")
for _ in range(int(sys.argv[1])):
    opt.zero_grad()
    loss = model(torch.randn(2, 4)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
'''


def test_ampx_run_numerics_writes_the_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from ampx.cli import main as cli

    script = tmp_path / "train.py"
    script.write_text(LEGACY_SCRIPT)
    out = tmp_path / "numerics"
    assert cli.main(["run", "-q", "--numerics", str(out), "--numerics-every", "2",
                     str(script), "4"]) == 0
    err = capsys.readouterr().err
    assert "ampx numerics (fp16)" in err and "keep_fp32=['1']" in err
    assert sorted(p.name for p in out.iterdir()) == [
        "numerics.csv", "numerics.json", "numerics.png", "numerics.txt"]
    data = json.loads((out / "numerics.json").read_text())
    assert data["modules"][0]["name"] == "1" and data["modules"][0]["issue"] == "overflow"
    # one heat-map row per module: (root), 0, 1, 2, 3
    assert sorted(data["history"]["modules"]) == ["(root)", "0", "1", "2", "3"]
    assert cli.main(["run", "-q", "--numerics-every", "2", str(script), "1"]) == 2


def test_the_docs_demo_ranks_its_four_faults_first(tmp_path, capsys):
    """docs/debugging-overflows.md's report: examples/numerics_demo.py under ampx run."""
    from pathlib import Path

    from ampx.cli import main as cli

    demo = Path(__file__).resolve().parents[2] / "examples" / "numerics_demo.py"
    out = tmp_path / "numerics-out"
    assert cli.main(["run", "-q", "--numerics", str(out), "--numerics-every", "5", str(demo),
                     "--steps", "12"]) == 0
    capsys.readouterr()
    data = json.loads((out / "numerics.json").read_text())
    top = [(m["name"], m["issue"]) for m in data["modules"][:4]]
    assert top == [("block.up", "overflow"), ("block.scores", "precision"),
                   ("aux", "underflow"), ("norm", "near overflow")]
    assert "ampx.initialize(model, optimizer, opt_level=\"O1\", keep_fp32=['block.up', " \
           "'block.scores'])" in data["advice"]


@pytest.mark.slow
def test_sweep_numerics_lists_the_modules_at_risk(tmp_path, capsys):
    """`ampx sweep --numerics`: each O1-O3 row carries its report's top modules at risk."""
    import csv
    from pathlib import Path

    from ampx.cli import main as cli

    demo = Path(__file__).resolve().parents[2] / "examples" / "numerics_demo.py"
    out = tmp_path / "sweep"
    assert cli.main(["sweep", str(demo), "--numerics", "--levels", "O0,O1", "--dtypes", "fp16",
                     "--steps", "4", "--no-plot", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "O1 fp16: numerics at risk: block.up (overflow), block.scores (precision), " \
           "aux (underflow)" in text
    rows = {r["label"]: r for r in json.loads((out / "sweep.json").read_text())["rows"]}
    assert rows["O1 fp16"]["numerics_at_risk"][0] == ["block.up", "overflow"]
    assert rows["O0"]["numerics_at_risk"] == []  # fp32: nothing to watch
    with open(out / "sweep.csv", newline="") as handle:
        by_label = {r["label"]: r for r in csv.DictReader(handle)}
    assert by_label["O1 fp16"]["numerics_at_risk"].startswith("block.up (overflow)")
    reports = sorted(p.parent.name for p in (out / "runs").rglob("numerics.json"))
    assert len(reports) == 1 and reports[0].endswith(".numerics")  # O1's only


class _Counted(nn.Module):
    """A Linear that counts how often its forward runs (a side effect the shadow must not add to
    more than once per watched step)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x)


def _noisy_run(steps: int, **options):
    """A model with dropout (functional and a module) and batch norm, a user forward hook on
    every module; the final state, how often the hooks fired and the counted forward ran."""
    torch.manual_seed(0)
    block = nn.Sequential(_Counted(), nn.Dropout(0.3), nn.BatchNorm1d(D), nn.ReLU())
    model = nn.Sequential(nn.Linear(D, D), block, nn.Dropout(0.2), nn.Linear(D, 1))
    fired = [0]
    for m in model.modules():
        m.register_forward_hook(lambda *_: fired.__setitem__(0, fired[0] + 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampx.initialize(model, opt, opt_level="O1", verbosity=0, **options)
    for _ in range(steps):
        loss = torch.nn.functional.dropout(model(torch.randn(8, D)).float()).mean()
        with ampx.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict(), fired[0], block[0].calls, torch.rand(3)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_shadow_changes_nothing_with_dropout_batchnorm_and_hooks(dtype):
    """The fp32 shadow draws no random numbers of the run's (the RNG is forked), fires no
    hook (user's or ampx's), leaves batch-norm statistics alone, and runs a module's forward
    once per watched step: training, the hooks and the RNG afterwards are as with the report
    off, bitwise."""
    plain = _noisy_run(4, dtype=dtype)
    watched = _noisy_run(4, dtype=dtype, numerics="report", numerics_every=1,
                         numerics_shadow_every=1)
    for (name, a), b in zip(plain[0].items(), watched[0].values()):
        assert torch.equal(a, b), name
    assert watched[1] == plain[1] == 4 * 10  # each of 10 modules' hook once a step
    # the counted Linear: once a step, plus one fp32 re-run per module whose shadow runs it
    # (itself, block, root), on each of the 4 watched steps
    assert watched[2] == 4 + 4 * 3 and plain[2] == 4
    assert torch.equal(plain[3], watched[3])  # the RNG's stream goes on as without the shadow
    report = ampx.numerics_report()
    # the shadow replays the forward's random draws: dropout is no "precision" issue
    assert all(m.issue != "precision" for m in report.modules), report.table()
