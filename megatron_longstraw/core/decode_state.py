"""Decode state: ``G`` samples continuing one captured prompt, sharing its state.

Per stateful layer, a ``DecodeState`` entry references the layer's batch-1 prompt state (K/V
pages, MLA latents, DSA indexer keys: read, never copied) and owns what each sample adds or
mutates: the K/V / latents / indexer keys of the tokens fed so far (buffers of ``capacity`` rows
per sample, filled as decoding advances) and a copy of Gated DeltaNet's recurrent state and conv
tail (small). Every sample is at the same position (lock-step decoding); samples that finish are
dropped with ``select_samples``.
"""

from dataclasses import dataclass, field

import torch

from megatron_longstraw.core.binding import check_state_matches, stateful_modules
from megatron_longstraw.core.state import LayerState, PromptState


@dataclass
class DecodeState:
    """The decode-time state of every stateful layer, keyed like ``PromptState.layers``.

    ``length`` counts the tokens fed through the model so far (the same for every sample);
    the next fed token sits at position ``prompt.prompt_length + length``.
    """

    prompt: PromptState
    num_samples: int
    capacity: int
    layers: dict[str, LayerState] = field(default_factory=dict)
    length: int = 0

    @property
    def model_signature(self) -> str:
        """The prompt state's model signature (``bind`` checks it)."""
        return self.prompt.model_signature

    @property
    def position(self) -> int:
        """Position of the next token fed through the model."""
        return self.prompt.prompt_length + self.length

    def nbytes(self) -> int:
        """Bytes of the per-sample part only (the shared prompt state is not counted)."""
        return sum(layer.nbytes() for layer in self.layers.values())

    def check_room(self, tokens: int) -> None:
        """``ValueError`` unless ``tokens`` more tokens per sample fit in the capacity."""
        if self.length + tokens > self.capacity:
            raise ValueError(f"decode state of capacity {self.capacity} cannot take {tokens} more tokens "
                             f"after {self.length}")

    def advance(self, tokens: int) -> None:
        """Record that ``tokens`` more tokens per sample went through the model."""
        assert self.length + tokens <= self.capacity, "decode state overflow"
        self.length += tokens

    def select_samples(self, index_B: torch.Tensor) -> "DecodeState":
        """Keep only the samples ``index_B`` (e.g. the unfinished ones), in that order; returns self."""
        for layer in self.layers.values():
            layer.select_samples(index_B)
        self.num_samples = int(index_B.numel())
        return self

    def free(self) -> None:
        """Release the per-sample tensors (the prompt state is left alone)."""
        for layer in self.layers.values():
            layer.free()
        self.layers.clear()


def new_decode_state(model, prompt: PromptState, num_samples: int, capacity: int) -> DecodeState:
    """A decode state for ``num_samples`` samples of at most ``capacity`` fed tokens each.

    ``prompt`` must be a batch-1 state captured by ``model`` (``ValueError`` otherwise).
    """
    check_state_matches(model, prompt)
    if prompt.batch != 1:
        raise ValueError(f"decoding needs a prompt state of batch 1, got batch {prompt.batch}")
    assert num_samples >= 1 and capacity >= 0, (num_samples, capacity)
    state = DecodeState(prompt, num_samples, capacity)
    for name, module in stateful_modules(model).items():
        state.layers[name] = module.new_decode_state(prompt.layers[name], num_samples, capacity)
    return state
