"""Prompt-state containers: the ``LayerState`` base and the model-wide ``PromptState``.

Each layer kind's container lives with the layer that owns it (``attention/sdpa_core.py``:
K/V pages; ``models/gated_delta_net.py``: recurrent state and conv tail; the GLM-5 layers: MLA
latent and DSA indexer keys). Every container knows its tensors, size in bytes and device, and
can be freed or moved (room for CPU offload with layer-wise staging). Under TP a rank holds its
own heads only; under CP a rank holds its own shard of the pages (``core/collectives.py``).
"""

from dataclasses import dataclass, field, fields
from typing import ClassVar, Optional, Protocol

import torch

from megatron_longstraw.core.state_grad import StateGrads


class LayerState:
    """Base class: tensor fields are the state; everything else is bookkeeping.

    A field holding another ``LayerState`` (a decode state's shared ``prompt``) is a reference,
    not part of this state: ``tensors``, ``nbytes``, ``to``, ``free`` and ``select_samples``
    leave it alone.
    """

    sample_dim: ClassVar[int] = 0  # the dimension of every tensor that indexes samples

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state's tensors by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        """Device of the state's tensors."""
        return next(iter(self.tensors().values())).device

    def to(self, device) -> "LayerState":
        """Move every tensor (e.g. to CPU for offload) in place; returns self."""
        for name, tensor in self.tensors().items():
            setattr(self, name, tensor.to(device))
        return self

    def free(self) -> None:
        """Drop the tensors (and their gradient buffers)."""
        for name in self.tensors():
            setattr(self, name, None)
        if "_grads" in self.__dict__:
            self._grads.free()

    @property
    def grads(self) -> StateGrads:
        """The fp32 gradient buffers of the state's tensors (``--prompt-gradient exact``)."""
        if "_grads" not in self.__dict__:
            self._grads = StateGrads(self)
        return self._grads

    def select_samples(self, index_B: torch.Tensor) -> "LayerState":
        """Keep only the samples ``index_B`` (rows along ``sample_dim``), in that order; returns self."""
        for name, tensor in self.tensors().items():
            setattr(self, name, tensor.index_select(self.sample_dim, index_B.to(tensor.device)))
        return self


class StateSet(Protocol):
    """What ``bind`` takes: the states of every stateful layer by module name, and the signature
    of the model that made them (a ``PromptState`` or a ``decode_state.DecodeState``)."""

    layers: dict[str, LayerState]

    @property
    def model_signature(self) -> str:
        """``binding.model_signature`` of the model that made the states."""


@dataclass
class PromptState:
    """All layers' prompt state plus what replay needs to score the first response token.

    ``layers`` is keyed by the owning module's qualified name in the model. ``last_hidden_1BH``
    is the decoder output (before the final norm) at the last prompt position;
    ``last_logits_BV`` its next-token logits (this rank's vocabulary shard).
    """

    prompt_length: int
    batch: int
    model_signature: str
    layers: dict[str, LayerState] = field(default_factory=dict)
    last_hidden_1BH: Optional[torch.Tensor] = None
    last_logits_BV: Optional[torch.Tensor] = None
    chunk_starts: tuple[int, ...] = ()
    """the first position of every capture chunk (this rank's shard), for the reverse sweep"""
    last_hidden_grad_1BH: Optional[torch.Tensor] = None
    """``--prompt-gradient exact``: fp32 gradient of the loss with respect to ``last_hidden_1BH``"""

    def last_hidden_grad(self) -> torch.Tensor:
        """The gradient buffer of ``last_hidden_1BH`` (fp32, or wider), made on first use."""
        if self.last_hidden_grad_1BH is None:
            dtype = torch.promote_types(self.last_hidden_1BH.dtype, torch.float32)
            self.last_hidden_grad_1BH = torch.zeros_like(self.last_hidden_1BH, dtype=dtype)
        return self.last_hidden_grad_1BH

    def state_grad_nbytes(self) -> int:
        """Bytes of the gradient buffers of every layer's state and of the last hidden state."""
        grad = self.last_hidden_grad_1BH
        extra = 0 if grad is None else grad.numel() * grad.element_size()
        return sum(s.grads.nbytes() for s in self.layers.values() if "_grads" in s.__dict__) + extra

    def nbytes(self) -> int:
        """Bytes of every layer's state plus the last hidden state."""
        extra = 0 if self.last_hidden_1BH is None else (
            self.last_hidden_1BH.numel() * self.last_hidden_1BH.element_size())
        return sum(s.nbytes() for s in self.layers.values()) + extra

    @property
    def device(self) -> torch.device:
        """Device of the layer states."""
        return next(iter(self.layers.values())).device

    def to(self, device) -> "PromptState":
        """Move every layer's state; returns self."""
        for layer in self.layers.values():
            layer.to(device)
        if self.last_hidden_1BH is not None:
            self.last_hidden_1BH = self.last_hidden_1BH.to(device)
        return self

    def free(self) -> None:
        """Release every tensor."""
        for layer in self.layers.values():
            layer.free()
        self.layers.clear()
        self.last_hidden_1BH = self.last_logits_BV = self.last_hidden_grad_1BH = None
