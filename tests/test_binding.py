"""The binding records and the per-mode dispatch of ``core/binding.py``: ``bind`` hands every
stateful layer its own state, ``StatefulModule`` runs the bound mode's method (unbound, the
layer's own forward), a mode a layer does not implement is one error naming both, a record holds
only its mode's fields, and ``read_state`` reads with gradients exactly where the mode asks."""

import dataclasses

import pytest
import torch

from megatron_longstraw.core.binding import (
    CaptureBinding, DecodeBinding, ReferenceBinding, ReplayBinding, StatefulModule, SweepBinding, bind,
    model_signature, read_state, stateful_modules)
from megatron_longstraw.core.state import LayerState, PromptState
from megatron_longstraw.core.state_grad import SweepTargets


@dataclasses.dataclass
class _RowsState(LayerState):
    """Rows ``[s, d]``, the first ``length`` filled."""

    rows_SD: torch.Tensor
    length: int = 0


class _Toy(StatefulModule, torch.nn.Module):
    """Serves capture (appends its input's real rows) and replay (adds the state's rows' sum)."""

    def new_prompt_state(self, prompt_length, batch, device):
        """Zero rows."""
        return _RowsState(torch.zeros(prompt_length, 2, dtype=torch.float64, device=device))

    def forward_unbound(self, x_SD):
        """The input itself."""
        return x_SD

    def forward_capture(self, binding, x_SD):
        """Appends the first ``valid_length`` rows."""
        state, valid = binding.state, binding.valid_length
        state.rows_SD[state.length:state.length + valid] = x_SD[:valid]
        state.length += valid
        return x_SD

    def forward_replay(self, binding, x_SD):
        """The input plus the sum of the filled rows (read through ``read_state``)."""
        return x_SD + read_state(binding, "rows_SD", binding.state.length).sum(0)


class _Careless(_Toy):
    """Reads in replay a field only capture, decode and the sweep have."""

    def forward_replay(self, binding, x_SD):
        """The input's first ``valid_length`` rows."""
        return x_SD[:binding.valid_length]


class _Model(torch.nn.Module):
    """Two stateful layers and a parameter (for the signature)."""

    def __init__(self, second=_Toy):
        super().__init__()
        self.first, self.second = _Toy(), second()
        self.proj = torch.nn.Linear(2, 2)


def _state(model, length: int) -> PromptState:
    state = PromptState(length, 1, model_signature(model))
    for name, module in stateful_modules(model).items():
        state.layers[name] = module.new_prompt_state(length, 1, "cpu")
    return state


def _x(rows: int) -> torch.Tensor:
    return torch.arange(2.0 * rows, dtype=torch.float64).view(rows, 2)


def test_bind_gives_every_layer_its_own_state_and_dispatches_by_mode():
    model = _Model()
    state, x = _state(model, 4), _x(3)
    assert model.first(x) is x  # unbound: the layer's own forward
    with bind(model, CaptureBinding(position_offset=0, valid_length=2), state):
        assert isinstance(model.first.longstraw, CaptureBinding)
        assert model.first.longstraw.state is state.layers["first"]
        assert model.second.longstraw.state is state.layers["second"]
        model.first(x)
        model.second(x + 1)
    assert model.first.longstraw is None and model.second.longstraw is None  # restored
    assert torch.equal(state.layers["first"].rows_SD[:2], x[:2])
    assert torch.equal(state.layers["second"].rows_SD[:2], x[:2] + 1)
    with bind(model, ReplayBinding(position_offset=2), state):
        assert torch.equal(model.first(x), x + x[:2].sum(0))


def test_a_mode_a_layer_does_not_implement_names_the_layer_and_the_mode():
    model = _Model()
    with bind(model, DecodeBinding(valid_length=1), _state(model, 4)):
        with pytest.raises(NotImplementedError, match=r"^_Toy does not implement the decode mode \(forward_decode\)"):
            model.first(_x(1))
    with bind(model, ReferenceBinding(prefix_length=1)):
        with pytest.raises(NotImplementedError, match="reference mode"):
            model.second(_x(1))


def test_a_record_holds_only_its_modes_fields():
    with pytest.raises(AttributeError):
        ReplayBinding(exact=True).valid_length
    with pytest.raises(AttributeError):
        ReferenceBinding().state
    with pytest.raises(AttributeError):
        CaptureBinding(valid_length=1).targets
    with pytest.raises(TypeError):
        CaptureBinding(1)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        ReplayBinding().exact = True
    model = _Model(second=_Careless)
    with bind(model, ReplayBinding(), _state(model, 4)):  # a layer reading a field its mode does not set
        with pytest.raises(AttributeError, match="valid_length"):
            model.second(_x(1))


def test_read_state_reads_with_gradients_in_exact_replay_and_the_sweep_only():
    def fresh():
        state = _RowsState(torch.ones(5, 2, dtype=torch.float64), length=3)
        return state, torch.arange(6.0, dtype=torch.float64).view(3, 2)

    for binding in (CaptureBinding(valid_length=1), ReplayBinding(), DecodeBinding(valid_length=1)):
        state, _ = fresh()
        rows = read_state(dataclasses.replace(binding, state=state), "rows_SD", 3)
        assert not rows.requires_grad and rows.data_ptr() == state.rows_SD.data_ptr()
        assert "_grads" not in state.__dict__  # no gradient buffer made
    for binding in (ReplayBinding(exact=True), SweepBinding(valid_length=1, targets=SweepTargets(), local_offset=3)):
        state, weight = fresh()
        rows = read_state(dataclasses.replace(binding, state=state), "rows_SD", 3)
        (rows * weight).sum().backward()
        assert torch.equal(state.grads.buffer("rows_SD")[:3], weight)
        assert not state.grads.buffer("rows_SD")[3:].any()
        assert state.rows_SD.grad is None
