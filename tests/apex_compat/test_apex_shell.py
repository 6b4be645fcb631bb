"""apex as the outer shell: apex's private names come from ampx.compat.apex, not the engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import ampx
from ampx.compat.apex import shell, stash
from ampx.registry import SESSIONS
from ampx.scaling.scaler import LossScaler


def test_apex_private_scaler_attributes_read_and_write() -> None:
    shell.install()
    s = LossScaler("dynamic")
    s._loss_scale = 512.0
    s._unskipped = 5
    s._scale_seq_len = 10
    assert s.loss_scale() == 512.0 and s._unskipped == 5 and s.growth_interval == 10
    assert s.clean_steps == 5
    assert s._max_loss_scale == 2.0**24 and s._min_loss_scale is None
    static = LossScaler(2.0)
    static._loss_scale = 1.0  # a static 1.0 written through apex's name is known on the host
    assert static.unit_scale()


def test_install_is_idempotent() -> None:
    shell.install()
    shell.install()
    assert sum(e is stash.PRIVATES for e in SESSIONS.extensions) == 1


def test_an_extension_attach_that_fails_leaves_the_optimizer_as_it_was() -> None:
    """The names are bound inside initialize's transaction: a later failure removes them."""
    ampx.Amp  # noqa: B018  (installs the shell)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = dict(vars(opt))

    class Fails:
        def check(self, optimizer: object) -> None:
            pass

        def attach(self, optimizer: object, journal: object) -> None:
            raise RuntimeError("injected")

        def detach_all(self) -> None:
            pass

    failing = Fails()
    SESSIONS.extensions.append(failing)
    try:
        session = ampx.Amp("O1", verbosity=0)
        try:
            session.initialize(model, opt)
        except RuntimeError as exc:
            assert "injected" in str(exc)
        else:
            raise AssertionError("initialize did not raise")
    finally:
        SESSIONS.extensions.remove(failing)
    assert vars(opt).keys() == before.keys() and not stash.is_attached(opt)
    assert not hasattr(opt, "_amp_stash") and not hasattr(opt, "_post_amp_backward")


def test_the_engine_alone_has_no_apex_names_and_the_package_adds_them() -> None:
    """In a fresh process: the engine's modules carry none of apex's names; the first public
    name the package hands out installs the shell, for sessions and hand-built scalers."""
    code = textwrap.dedent('''
        import torch
        from ampx.scaling.scaler import LossScaler
        from ampx.session import Amp

        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        Amp("O1", verbosity=0).initialize(model, opt)
        assert not hasattr(opt, "_amp_stash") and not hasattr(LossScaler, "update_scale")
        import ampx
        assert ampx.Amp is Amp  # the first public name: the shell is installed
        assert hasattr(LossScaler, "update_scale") and hasattr(LossScaler, "_loss_scale")
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        Amp("O1", verbosity=0).initialize(model, opt)
        assert opt._amp_stash.lazy_init_called and callable(opt._post_amp_backward)
        print("ok")
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip().endswith("ok")
