"""GLM-5 prompt state: the MLA latent per token and the DSA indexer key per token.

What absorbed MLA attends to is one single-head (MQA) key per token, ``[c_kv ; k_rope]``:

- ``c_kv``: ``kv_layernorm(kv_down(h)[:kv_lora_rank])``, the normalized compressed latent. With
  matrix absorption the K up projection is folded into the query and the V up projection is
  applied after attention, so the latent itself is both the key's no-RoPE part and the value;
  the decompressed per-head K/V never exist.
- ``k_rope``: ``RoPE(kv_down(h)[kv_lora_rank:])`` at the token's absolute position, shared by
  every head (there is no head dimension).

Both only depend on the token's hidden state and position, not on the up projections, so they
are the whole MLA prompt state. They are kept in one buffer ``[s, b, kv_lora_rank +
qk_rope_head_dim]`` in exactly the layout Megatron's ``AbsorbedMLASelfAttention`` hands its core
attention (``c_kv_SBC`` / ``k_rope_SBR`` are views). Under TP every rank holds the whole latent
(it is per token, not per head: MQA).

A DSA layer with its own indexer (HF ``indexer_types == "full"``) also keeps the indexer key of
every prompt token ``[s, b, index_head_dim]``: ``k_norm(wk(h))`` with RoPE on its first
``qk_rope_head_dim`` dims (and the Hadamard rotation when ``dsa_indexer_rotate_activation``),
so a response query's top-k selection ranks prompt and response tokens together. A ``"shared"``
layer has no indexer (Megatron builds none) and reuses the top-k of its source layer, whose key
positions are the same, so it keeps no indexer keys. Indexer keys never carry gradient (Megatron
computes the indexer under ``no_grad`` from detached inputs), so ``--prompt-gradient exact``
keeps a gradient buffer for the latents only (``grads.buffer("latent_SBD")``, same shape).

Bytes per prompt, per sample (batch 1), with ``e`` the parameter dtype's size:
``P * e * (L * (kv_lora_rank + qk_rope_head_dim) + L_full * index_head_dim)`` plus the last
hidden state ``hidden_size * e`` (``PromptState``), for ``L`` layers of which ``L_full`` have an
indexer.

Decoding (``MLADecodeState``, ``IndexerDecodeState``) keeps the same per-token entries for each
sample's generated tokens, ``[capacity, samples, d]``, after the shared batch-1 prompt state,
which it references and never copies.
"""

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_longstraw.core.state import LayerState


class _PagedState(LayerState):
    """A buffer ``[prompt, b, d]`` sized for the whole prompt, filled page by page (``length``).

    Under context parallelism ``positions_P`` holds the global prompt position of every row of
    this rank's buffer (set by the context-parallel ``capture_prompt``; bookkeeping, not state: one int64 tensor
    shared by all layers, excluded from ``tensors``); ``None`` otherwise.
    """

    length: int
    positions_P: Optional[torch.Tensor] = None
    sample_dim = 1

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state's tensors by field name (not the shared positions)."""
        return {name: t for name, t in super().tensors().items() if name != "positions_P"}

    def filled_positions(self) -> torch.Tensor:
        """Global positions of the filled rows (context parallelism only)."""
        assert self.positions_P is not None, "positions are set by the context-parallel capture"
        return self.positions_P[: self.length]

    def _buffer(self) -> torch.Tensor:
        raise NotImplementedError

    def append(self, page_SBD: torch.Tensor) -> None:
        """Write the next page of tokens (no concatenation: the buffer is preallocated)."""
        buffer = self._buffer()
        end = self.length + page_SBD.shape[0]
        if end > buffer.shape[0]:
            raise ValueError(f"prompt state overflow: {end} tokens > {buffer.shape[0]}")
        buffer[self.length:end] = page_SBD
        self.length = end

    def filled(self) -> torch.Tensor:
        """The tokens written so far, ``[length, b, d]``."""
        return self._buffer()[: self.length]


@dataclass
class MLALatentState(_PagedState):
    """Absorbed-MLA key per prompt token: ``[c_kv ; k_rope]``, ``[s, b, kv_lora_rank + rope]``."""

    latent_SBD: torch.Tensor
    kv_lora_rank: int
    length: int = 0
    positions_P: Optional[torch.Tensor] = None

    def _buffer(self) -> torch.Tensor:
        return self.latent_SBD

    @property
    def c_kv_SBC(self) -> torch.Tensor:
        """The normalized compressed latent of the filled tokens."""
        return self.filled()[..., : self.kv_lora_rank]

    @property
    def k_rope_SBR(self) -> torch.Tensor:
        """The post-RoPE shared key of the filled tokens."""
        return self.filled()[..., self.kv_lora_rank:]


@dataclass
class IndexerKeyState(_PagedState):
    """DSA indexer key per prompt token (after ``k_norm`` and RoPE), ``[s, b, index_head_dim]``."""

    key_SBD: torch.Tensor
    length: int = 0
    positions_P: Optional[torch.Tensor] = None

    def _buffer(self) -> torch.Tensor:
        return self.key_SBD


@dataclass
class MLADecodeState(MLALatentState):
    """Decode: the samples' own latents ``[capacity, samples, kv_lora_rank + rope]`` (filled
    ``length`` rows) after the shared batch-1 ``prompt`` latents (referenced, not copied)."""

    prompt: Optional[MLALatentState] = field(default=None, kw_only=True)


@dataclass
class IndexerDecodeState(IndexerKeyState):
    """Decode: the samples' own indexer keys ``[capacity, samples, index_head_dim]`` (filled
    ``length`` rows) after the shared batch-1 ``prompt`` keys (referenced, not copied)."""

    prompt: Optional[IndexerKeyState] = field(default=None, kw_only=True)
