"""Exact prompt gradients (``--prompt-gradient exact``): gradients of the prompt state.

Detached LongStraw replay treats the prompt state as a constant. The exact mode keeps, beside
each state tensor, an fp32 buffer of the same shape that accumulates the gradient of the loss
with respect to that tensor over every response and micro-batch of the group (``StateGrads``).
Then one reverse sweep over the prompt (``longstraw/prompt_backward.py``), last chunk first,
recomputes each chunk's forward with autograd from the state before it and backpropagates the
accumulated gradients of the chunk's own state entries: parameter gradients add to replay's,
gradients of the earlier positions' state add to their buffers, and a recurrent layer's
gradient at the chunk's start becomes the gradient of the previous chunk's final state. By the
chain rule this is the gradient of the full graph (prompt + responses, nothing detached), with
memory for the state, its gradient buffers and one chunk's activations.

- ``read_with_grad(value, buffer)``: ``value`` (a state tensor, a constant) as an input of the
  autograd graph whose gradient is added into ``buffer``; no gradient reaches ``value`` itself.
- ``SweepTargets``: what a chunk's recomputed forward produced of the state, with the gradient to
  inject for each, and what to do after the chunk's backward.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


class _ReadWithGrad(torch.autograd.Function):
    """Identity on ``value``; backward adds the incoming gradient into ``buffer``."""

    @staticmethod
    def forward(ctx, anchor, value, buffer):
        ctx.buffer = buffer
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        ctx.buffer.add_(grad.to(ctx.buffer.dtype))
        return None, None, None


_ANCHOR = torch.empty(0, requires_grad=True)  # makes the output of _ReadWithGrad part of the graph


def read_with_grad(value: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``value`` (detached state) entering the graph; its gradient is added into ``buffer``
    (same shape, fp32). Outside autograd it is ``value`` itself."""
    assert value.shape == buffer.shape, (tuple(value.shape), tuple(buffer.shape))
    if not torch.is_grad_enabled():
        return value
    return _ReadWithGrad.apply(_ANCHOR, value.detach(), buffer)


class StateGrads:
    """Gradient buffers (fp32, or the state's dtype if wider) of one layer's state tensors, by
    field name, made on first use."""

    def __init__(self, state):
        self._state = state
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str) -> torch.Tensor:
        """The gradient buffer of field ``name`` (zeros until something adds to it)."""
        if name not in self._buffers:
            value = getattr(self._state, name)
            dtype = torch.promote_types(value.dtype, torch.float32)  # fp64 states (tests): fp64
            self._buffers[name] = torch.zeros(value.shape, dtype=dtype, device=value.device)
        return self._buffers[name]

    def replace(self, name: str, buffer: torch.Tensor) -> None:
        """Make ``buffer`` the gradient of field ``name`` (a recurrent state's gradient handed on
        to the previous chunk during the sweep)."""
        self._buffers[name] = buffer

    def nbytes(self) -> int:
        """Bytes of the buffers made so far."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def free(self) -> None:
        """Drop the buffers."""
        self._buffers.clear()


@dataclass
class SweepTargets:
    """A recomputed chunk's own state entries with the gradients to inject into them, and the
    callbacks to run after the chunk's backward (``longstraw/prompt_backward.py``)."""

    outputs: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    after_backward: list = field(default_factory=list)

    def inject(self, output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        """Backpropagate ``grad`` into ``output`` (a tensor of the recomputed graph)."""
        if grad is None or not output.requires_grad:
            return
        self.outputs.append(output)
        self.grads.append(grad.to(output.dtype))

    def inject_reaching(self, output: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        """``inject``, with a zero gradient where ``grad`` is ``None``: the chunk's backward then
        still reaches ``output`` (every layer below it runs its backward, and with it its
        collectives, on every rank that must take part)."""
        self.inject(output, torch.zeros_like(output) if grad is None else grad)

    def take(self, start: int = 0) -> tuple[list, list]:
        """The outputs injected after the first ``start`` ones and their gradients, removed from
        the targets (a pipeline stage backpropagates its own with its output's gradient)."""
        outputs, grads = self.outputs[start:], self.grads[start:]
        del self.outputs[start:], self.grads[start:]
        return outputs, grads

    def then(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the chunk's backward is done."""
        self.after_backward.append(callback)

    def backward(self) -> None:
        """One backward through the chunk's graph from every injected gradient."""
        if self.outputs:
            torch.autograd.backward(self.outputs, self.grads)
        for callback in self.after_backward:
            callback()
        self.outputs.clear()
        self.grads.clear()
        self.after_backward.clear()
