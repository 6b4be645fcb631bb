"""RNNs under O1 on CPU: half-precision compute via per-weight casts, fp32 gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import ampx
from ampx.o1 import patch

SEQUENCE_MODULES = {
    "rnn_tanh": lambda: nn.RNN(6, 5, num_layers=2),
    "rnn_relu": lambda: nn.RNN(6, 5, nonlinearity="relu"),
    "lstm": lambda: nn.LSTM(6, 5, num_layers=2, bidirectional=True),
    "lstm_proj": lambda: nn.LSTM(6, 5, proj_size=3, batch_first=True),
    "gru": lambda: nn.GRU(6, 5, batch_first=True),
}
CELLS = {
    "rnn_cell": lambda: nn.RNNCell(6, 5),
    "rnn_relu_cell": lambda: nn.RNNCell(6, 5, nonlinearity="relu"),
    "lstm_cell": lambda: nn.LSTMCell(6, 5),
    "gru_cell": lambda: nn.GRUCell(6, 5),
}


def _first(out: object) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    assert isinstance(out, torch.Tensor)
    return out


def _check_grads(module: nn.Module) -> None:
    for name, p in module.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("kind", list(SEQUENCE_MODULES))
def test_sequence_modules_run_in_half(kind: str, half_dtype: torch.dtype) -> None:
    module = SEQUENCE_MODULES[kind]()
    reference = [p.detach().clone() for p in module.parameters()]
    ampx.initialize(module, opt_level="O1", dtype=half_dtype, verbosity=0)
    x = torch.randn(4, 3, 6)
    out, hidden = module(x)
    assert out.dtype == half_dtype
    assert _first(hidden).dtype == half_dtype
    # Numerically the fp32 module's result, to half precision.
    with ampx.disable_casts():
        expected, _ = module(x)
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.05)
    out.float().sum().backward()
    _check_grads(module)
    assert all(torch.equal(a, b) for a, b in zip(reference, module.parameters()))


@pytest.mark.parametrize("kind", list(CELLS))
def test_cells_run_in_half(kind: str, half_dtype: torch.dtype) -> None:
    cell = CELLS[kind]()
    ampx.initialize(cell, opt_level="O1", dtype=half_dtype, verbosity=0)
    x = torch.randn(3, 6)
    state = None
    for _ in range(3):  # feed the half state back in
        state = cell(x, state)
        assert _first(state).dtype == half_dtype
    _first(state).float().sum().backward()
    _check_grads(cell)


def test_packed_sequences(half_dtype: torch.dtype) -> None:
    lstm = nn.LSTM(6, 5, batch_first=True)
    ampx.initialize(lstm, opt_level="O1", dtype=half_dtype, verbosity=0)
    x = torch.randn(3, 4, 6)
    packed = pack_padded_sequence(x, torch.tensor([4, 2, 1]), batch_first=True)
    out, (h, c) = lstm(packed)
    assert out.data.dtype == half_dtype and h.dtype == half_dtype
    padded, lengths = pad_packed_sequence(out, batch_first=True)
    assert padded.shape == (3, 4, 5) and lengths.tolist() == [4, 2, 1]
    padded.float().sum().backward()
    _check_grads(lstm)


def test_half_input_and_fp32_hidden_state_are_accepted(half_dtype: torch.dtype) -> None:
    # A half activation from an earlier O1 layer, and a user-made fp32 initial state.
    gru = nn.GRU(6, 5)
    ampx.initialize(gru, opt_level="O1", dtype=half_dtype, verbosity=0)
    x = torch.randn(4, 2, 6).to(half_dtype)
    out, h = gru(x, torch.zeros(1, 2, 5))
    assert out.dtype == half_dtype and h.dtype == half_dtype


class _TwoChunks(nn.Module):
    """One forward that runs its LSTM over two chunks of the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.lstm(x[:1])
        return self.lstm(x[1:], state)[0]


def test_weights_are_cast_once_per_forward(half_dtype: torch.dtype) -> None:
    """The weight cache lives one forward of the initialized model (plus its backward):
    the second chunk reuses the first's casts; the next forward casts afresh."""
    model = _TwoChunks()
    ampx.initialize(model, opt_level="O1", dtype=half_dtype, verbosity=0)
    cache = patch.active().cache  # type: ignore[union-attr]
    x = torch.randn(2, 1, 6)
    model(x)
    assert cache.misses == 4 and cache.hits == 4
    model(x)
    assert cache.misses == 8 and cache.hits == 8


def test_rnn_without_o1_is_untouched() -> None:
    lstm = nn.LSTM(6, 5)
    out, _ = lstm(torch.randn(2, 1, 6))
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        lstm(torch.randn(2, 1, 6, dtype=torch.float16))
