"""How stateful layers learn what to do: capture, replay, decode, the reverse sweep, or the
stop-gradient reference.

A layer that owns prompt state subclasses ``StatefulModule``: it creates its empty state
(``new_prompt_state``), its per-sample continuation of a captured state (``new_decode_state``)
and implements one method per mode it serves, ``forward_capture(binding, ...)``,
``forward_replay``, ``forward_decode``, ``forward_sweep``, ``forward_reference``, which
``StatefulModule.forward`` calls with the layer's binding (unbound: the layer's own forward).
``bind`` sets one binding record on every stateful module of a model for the duration of a
block: a ``CaptureBinding``, ``ReplayBinding``, ``DecodeBinding``, ``SweepBinding`` or
``ReferenceBinding``, each holding only what its mode uses, with each layer's own ``state``.
``read_state`` reads a state field, with its gradient where the mode asks for it.
"""

import contextlib
import dataclasses
import enum
import hashlib
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch

from megatron_longstraw.core.state import LayerState, StateSet
from megatron_longstraw.core.state_grad import SweepTargets, read_with_grad


class Mode(enum.Enum):
    """What a bound stateful layer does in forward; its value names the layer's method
    (``forward_<value>``)."""

    CAPTURE = "capture"
    REPLAY = "replay"
    DECODE = "decode"
    SWEEP = "sweep"
    REFERENCE = "reference"


@dataclass(frozen=True, kw_only=True)
class Binding:
    """What one bound stateful module sees: one record per ``Mode`` (below), each with only the
    fields its mode uses (reading another is an ``AttributeError``)."""

    mode: ClassVar[Mode]


@dataclass(frozen=True, kw_only=True)
class StateBinding(Binding):
    """A mode that runs against the layer's prompt state."""

    state: Optional[LayerState] = None  # this layer's own (``bind`` fills it per layer)
    position_offset: int = 0            # position of this forward's first token


@dataclass(frozen=True, kw_only=True)
class CaptureBinding(StateBinding):
    """No grad; the input is the next prompt chunk (this rank's shard under CP): attend over /
    start from the state so far, then append to / update it."""

    mode = Mode.CAPTURE
    valid_length: int  # the real tokens; under sequence parallelism the layers see them padded to
    # a multiple of TP, and keep state of the first rows
    shard_sizes: Optional[tuple[int, ...]] = None  # under CP: the chunk's tokens per CP rank (rank r
    # feeds shard r); None without context parallelism (``core/collectives.py``)
    exact: bool = False  # --prompt-gradient exact: keep what the reverse sweep needs (a recurrent
    # layer's state at every chunk start)


@dataclass(frozen=True, kw_only=True)
class ReplayBinding(StateBinding):
    """Autograd; the input is response tokens after the prompt: read the state (``read_state``)."""

    mode = Mode.REPLAY
    exact: bool = False  # --prompt-gradient exact: read the state with gradients into its buffers


@dataclass(frozen=True, kw_only=True)
class DecodeBinding(StateBinding):
    """No grad; the input is the next token(s) of every sample: read the shared prompt state,
    append to / update the sample's own (the layer's ``DecodeState`` entry)."""

    mode = Mode.DECODE
    valid_length: int  # the real tokens (sequence parallelism pads them at the end)
    static_decode: Optional["StaticDecode"] = None  # in fixed shapes (a CUDA graph's step)


@dataclass(frozen=True, kw_only=True)
class SweepBinding(StateBinding):
    """Autograd; the input is a prompt chunk (this rank's shard under CP) recomputed by the
    reverse sweep of ``--prompt-gradient exact``: read the state before the chunk with gradients
    into its buffers (``read_state``), hand the chunk's own state entries to ``targets``
    (``core/state_grad.py``). ``position_offset`` is the chunk's (shard's) first position."""

    mode = Mode.SWEEP
    valid_length: int  # the real tokens (sequence parallelism pads them at the end)
    targets: SweepTargets  # where the chunk's own state entries go, with their gradients
    local_offset: int  # the rows of this rank's state before the chunk (under CP its shards of
    # the earlier chunks; without CP the chunk's first position)
    shard_sizes: Optional[tuple[int, ...]] = None  # under CP: the chunk's tokens per CP rank


@dataclass(frozen=True, kw_only=True)
class ReferenceBinding(Binding):
    """The full-graph baseline: an ordinary full sequence, no state; detach the first
    ``prefix_length`` rows of the tensors that make up the prompt state (the stop-gradient
    reference; 0 for the exact mode's)."""

    mode = Mode.REFERENCE
    prefix_length: int = 0  # prompt tokens at the start of the sequence


@dataclass
class StaticDecode:
    """A decode step in fixed shapes, as a CUDA graph replays it (``longstraw/decode_graph.py``).

    The count of tokens each sample fed so far is the device tensor ``length_t`` (``[1]`` int64),
    not a Python number, so the captured step reads the current one at every replay; the step
    writes the new tokens' entries at that row and advances it. The samples' own-key buffers are
    read over their first ``rows`` rows, the rows past the tokens fed so far masked out.
    """

    length_t: torch.Tensor
    rows: int


def read_state(binding: StateBinding, name: str, rows: Optional[int] = None) -> torch.Tensor:
    """The first ``rows`` rows (all: ``None``) of field ``name`` of the bound layer's state. In
    exact replay and in the reverse sweep they enter the autograd graph with their gradient added
    into the field's buffer (``state.grads``, ``core/state_grad.py``); otherwise they are the
    state's tensor itself."""
    state = binding.state
    value = getattr(state, name) if rows is None else getattr(state, name)[:rows]
    if not (isinstance(binding, SweepBinding) or (isinstance(binding, ReplayBinding) and binding.exact)):
        return value
    buffer = state.grads.buffer(name)
    return read_with_grad(value, buffer if rows is None else buffer[:rows])


class StatefulModule:
    """Mixin for modules that keep prompt state; ``longstraw`` is ``None`` unless bound.

    List it before the ``torch.nn.Module`` base: its ``forward`` runs ``forward_unbound`` when
    unbound (by default the next base's forward, e.g. Megatron's), else ``forward_bound``, which
    calls the layer's method of the binding's mode, ``forward_<mode>(binding, ...)``
    (``forward_capture``, ``forward_replay``, ``forward_decode``, ``forward_sweep``,
    ``forward_reference``). A layer overrides ``forward_bound`` to check or reduce the forward's
    arguments before that call; a mode it does not implement is a ``NotImplementedError``.

    ``supports_context_parallel``: the layer can capture/replay with its prompt state sharded
    over the CP group (``core/collectives.py``). ``supports_prompt_gradient``: it serves
    ``--prompt-gradient exact`` (``core/state_grad.py``). ``supports_static_decode``: its decode
    step keeps fixed shapes and reads no Python-side count under ``DecodeBinding.static_decode``,
    so a CUDA graph can replay it.
    """

    longstraw: Optional[Binding] = None
    supports_context_parallel: bool = False
    supports_prompt_gradient: bool = False  # implements ``exact`` capture/replay and ``forward_sweep``
    supports_static_decode: bool = False  # implements ``DecodeBinding.static_decode``

    def forward(self, *args, **kwargs):
        """``forward_unbound`` when unbound, else ``forward_bound`` with the binding."""
        binding = self.longstraw
        if binding is None:
            return self.forward_unbound(*args, **kwargs)
        return self.forward_bound(binding, *args, **kwargs)

    def forward_unbound(self, *args, **kwargs):
        """The forward of the next base class (Megatron's module's)."""
        return super().forward(*args, **kwargs)

    def forward_bound(self, binding: Binding, *args, **kwargs):
        """The layer's method of ``binding``'s mode, ``forward_<mode>(binding, *args, **kwargs)``."""
        return self.mode_method("forward", binding)(binding, *args, **kwargs)

    def mode_method(self, prefix: str, binding: Binding) -> Callable:
        """This layer's ``<prefix>_<mode>`` method for ``binding``'s mode; ``NotImplementedError``
        naming the layer and the mode when it has none."""
        method = getattr(self, f"{prefix}_{binding.mode.value}", None)
        if method is None:
            raise NotImplementedError(f"{type(self).__name__} does not implement the {binding.mode.value} "
                                      f"mode ({prefix}_{binding.mode.value})")
        return method

    def new_prompt_state(self, prompt_length: int, batch: int, device) -> LayerState:
        """An empty state for a prompt of ``prompt_length`` tokens (this rank's share)."""
        raise NotImplementedError

    def new_decode_state(self, prompt: LayerState, num_samples: int, capacity: int) -> LayerState:
        """The per-sample continuation of the captured batch-1 ``prompt`` state for ``num_samples``
        samples of up to ``capacity`` fed tokens each. It references ``prompt`` (never copies
        what it only reads) and owns only what each sample adds or mutates."""
        raise NotImplementedError


def stateful_modules(model) -> dict[str, StatefulModule]:
    """Every stateful module of ``model`` by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, StatefulModule)}


def model_signature(model) -> str:
    """A fingerprint of the architecture and this rank's parameter shapes (not values)."""
    digest = hashlib.sha256(type(model).__name__.encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()[:16]


def check_state_matches(model, state: StateSet, modules=None) -> None:
    """``ValueError`` unless ``state`` was made by ``model`` (same signature, every stateful layer)."""
    if state.model_signature != model_signature(model):
        raise ValueError("prompt state was captured with a different model "
                         "(architecture or parallel layout differs)")
    modules = stateful_modules(model) if modules is None else modules
    missing = sorted(set(modules) - set(state.layers))
    if missing:
        raise ValueError(f"prompt state has no entry for layers {missing[:3]}")


@contextlib.contextmanager
def bind(model, binding: Binding, state: Optional[StateSet] = None):
    """Bind every stateful module of ``model`` to ``binding`` for the block, each with its own
    entry of ``state`` as ``binding.state`` (a ``StateBinding``'s); restores the previous
    bindings on exit.

    Keep backward inside the block when activations are recomputed (``--recompute-granularity``):
    recomputation re-runs forward during backward and must see the same binding.
    """
    modules = stateful_modules(model)
    if state is not None:
        assert isinstance(binding, StateBinding), f"the {binding.mode.value} mode binds no state"
        check_state_matches(model, state, modules)
    previous = {name: module.longstraw for name, module in modules.items()}
    for name, module in modules.items():
        module.longstraw = binding if state is None else dataclasses.replace(binding, state=state.layers[name])
    try:
        yield
    finally:
        for name, module in modules.items():
            module.longstraw = previous[name]


def detach_prefix(tensor: torch.Tensor, prefix_length: int, seq_dim: int) -> torch.Tensor:
    """``tensor`` with its first ``prefix_length`` rows along ``seq_dim`` detached."""
    if prefix_length <= 0:
        return tensor
    head, tail = tensor.split([prefix_length, tensor.shape[seq_dim] - prefix_length], dim=seq_dim)
    return torch.cat([head.detach(), tail], dim=seq_dim)


def pad_rows_to(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended along dim 0 up to ``rows`` (the output rows of the
    sequence-parallel padding tokens, which keep no state)."""
    if tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
