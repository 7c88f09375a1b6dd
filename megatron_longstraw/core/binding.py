"""How stateful layers learn what to do: capture, replay, decode, or stop-gradient reference.

A layer that owns prompt state subclasses ``StatefulModule``: it creates its empty state
(``new_prompt_state``), its per-sample continuation of a captured state (``new_decode_state``)
and reads ``self.longstraw`` (a ``Binding`` or ``None``) in forward. ``bind`` sets the binding
on every stateful module of a model for the duration of a block.
"""

import contextlib
import enum
import hashlib
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_longstraw.core.state import LayerState, StateSet
from megatron_longstraw.core.state_grad import SweepTargets


class Mode(enum.Enum):
    """What a bound stateful layer does in forward."""

    CAPTURE = "capture"      # no grad; the input is the next prompt chunk; update the state
    REPLAY = "replay"        # autograd; the input is response tokens after the prompt; read the state
    DECODE = "decode"        # no grad; the input is the next token(s) of every sample; read the shared
    # prompt state, append to / update the sample's own state (a ``DecodeState`` layer entry)
    REFERENCE = "reference"  # ordinary full sequence; detach the first ``prefix_length`` rows of
    # the tensors that make up the prompt state (the stop-gradient reference)
    SWEEP = "sweep"          # autograd; the input is a prompt chunk recomputed for the reverse sweep
    # of ``--prompt-gradient exact``: read the state before the chunk with gradients into its
    # buffers, hand the chunk's own state entries to ``Binding.sweep`` (``core/state_grad.py``)


@dataclass
class Binding:
    """What one stateful module sees: the mode, its own state, and positions."""

    mode: Mode
    state: Optional[LayerState]
    position_offset: int = 0      # position of this forward's first token
    prefix_length: int = 0        # REFERENCE: prompt tokens at the start of the sequence
    shard_sizes: Optional[tuple[int, ...]] = None  # CAPTURE / SWEEP under CP: this chunk's tokens per CP
    # rank (rank r feeds shard r); None without context parallelism (``core/collectives.py``)
    valid_length: Optional[int] = None  # CAPTURE / DECODE / SWEEP: the real tokens; under sequence
    # parallelism the layers see them padded to a multiple of TP, and keep state of the first rows
    exact: bool = False  # --prompt-gradient exact. CAPTURE: keep what the reverse sweep needs
    # (a recurrent layer's state at every chunk start); REPLAY: read the state with gradients
    sweep: Optional[SweepTargets] = None  # SWEEP: where the chunk's own state entries go
    local_offset: Optional[int] = None  # SWEEP under CP: the rows of this rank's state before the
    # chunk's shard (its shards of the earlier chunks); ``position_offset`` is the shard's first position
    static_decode: Optional["StaticDecode"] = None  # DECODE in fixed shapes (a CUDA graph's step)


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


class StatefulModule:
    """Mixin for modules that keep prompt state; ``longstraw`` is ``None`` unless bound.

    ``supports_context_parallel``: the layer can capture/replay with its prompt state sharded
    over the CP group (``core/collectives.py``). ``supports_prompt_gradient``: it serves
    ``--prompt-gradient exact`` (``core/state_grad.py``). ``supports_static_decode``: its decode
    step keeps fixed shapes and reads no Python-side count under ``Binding.static_decode``, so
    a CUDA graph can replay it.
    """

    longstraw: Optional[Binding] = None
    supports_context_parallel: bool = False
    supports_prompt_gradient: bool = False  # implements ``exact`` capture/replay and ``Mode.SWEEP``
    supports_static_decode: bool = False  # implements ``Binding.static_decode``

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
def bind(model, mode: Mode, state: Optional[StateSet] = None, *,
         position_offset: int = 0, prefix_length: int = 0,
         shard_sizes: Optional[tuple[int, ...]] = None, valid_length: Optional[int] = None,
         exact: bool = False, sweep: Optional[SweepTargets] = None, local_offset: Optional[int] = None,
         static_decode: Optional[StaticDecode] = None):
    """Bind every stateful module of ``model`` for the block; restores the previous binding on exit.

    Keep backward inside the block when activations are recomputed (``--recompute-granularity``):
    recomputation re-runs forward during backward and must see the same binding.
    """
    modules = stateful_modules(model)
    if state is not None:
        check_state_matches(model, state, modules)
    previous = {name: module.longstraw for name, module in modules.items()}
    for name, module in modules.items():
        module.longstraw = Binding(mode, state.layers[name] if state is not None else None,
                                   position_offset, prefix_length, shard_sizes, valid_length, exact, sweep,
                                   local_offset, static_decode)
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
