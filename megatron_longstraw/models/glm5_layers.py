"""Small local-spec building blocks that GLM-5 (``glm_moe_dsa``) needs beyond Megatron's own.

Megatron's DSA spec (``get_dsa_module_spec_for_backend``) is written for Transformer Engine: the
indexer's projections are ``backend.linear()`` (``TELinear`` with ``parallel_mode="duplicated"``)
and the local ``LocalSpecProvider`` has no such linear; its ``WrappedTorchNorm`` also refuses
sequence parallelism, which Megatron's ``AbsorbedMLASelfAttention`` requires whenever TP > 1.
HF also builds the MLA latent norms (``q_a_layernorm``, ``kv_a_layernorm``) with a fixed
``eps=1e-6`` while Megatron passes ``config.layernorm_epsilon`` (GLM-5's ``rms_norm_eps`` is 1e-5).
These classes fill exactly those gaps; everything else is Megatron's.

``GlmAbsorbedMLASelfAttention`` exists for a gradient bug: with column-parallel down projections
(the only local choice Megatron's MLA accepts) and TP > 1, Megatron gathers ``kv_down``'s output
with ``gather_from_tensor_model_parallel_region``, whose backward only splits; the RoPE key
slice ``k_pos_emb`` then keeps just this rank's heads' share of its gradient (the latent part is
summed by the sequence-parallel gather, the RoPE part is not). Forward logits are right, input and
``kv_down`` gradients are not. Megatron's Transformer Engine spec avoids that path by using
duplicated down projections; the subclass does the same with ``DuplicatedLinear``.
"""

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class DuplicatedLinear(MegatronModule):
    """A linear layer whose full weight lives on every TP rank (local twin of ``TELinear``
    with ``parallel_mode="duplicated"``); returns ``(output, bias)`` like Megatron's linears."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method=None, bias: bool = False, skip_bias_add: bool = False,
                 parallel_mode: str = "duplicated", **kwargs):
        super().__init__(config=config)
        if parallel_mode != "duplicated":
            raise ValueError(f"DuplicatedLinear supports parallel_mode='duplicated', got {parallel_mode!r}")
        if bias:
            raise ValueError("DuplicatedLinear: bias is not supported")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization and init_method is not None:
            init_method(self.weight)
        # on sequence-parallel input each TP rank's gradient covers its own tokens: Megatron's
        # finalize_model_grads sums such weights over TP (the DSA indexer marks its duplicated
        # weights ``average_gradients_across_tp_domain`` instead, which takes precedence)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor):
        """``x @ W^T`` and no bias."""
        return F.linear(x, self.weight), None

    def backward_dw(self) -> None:
        """No delayed weight-gradient computation (interface of Megatron's linears)."""


class GlmAbsorbedMLASelfAttention(AbsorbedMLASelfAttention):
    """``AbsorbedMLASelfAttention`` that also accepts ``DuplicatedLinear`` down projections.

    Megatron only accepts TE/ColumnParallel down projections and would, with ColumnParallel,
    lose part of the RoPE-key gradient under TP (module docstring). This subclass builds the
    parent with ColumnParallel placeholders and swaps in ``DuplicatedLinear``: the forward then
    takes Megatron's duplicated-projection branch, exactly as with ``TELinear`` under TE.
    """

    _DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")

    def __init__(self, config, submodules, *args, **kwargs):
        swap = [name for name in self._DOWN_PROJECTIONS if getattr(submodules, name) is DuplicatedLinear]
        placeholders = dataclasses.replace(submodules, **{name: ColumnParallelLinear for name in swap})
        super().__init__(config, placeholders, *args, **kwargs)
        sizes = {"linear_q_down_proj": config.q_lora_rank,
                 "linear_kv_down_proj": config.kv_lora_rank + config.qk_pos_emb_head_dim}
        for name in swap:
            setattr(self, name, DuplicatedLinear(config.hidden_size, sizes[name], config=config,
                                                 init_method=config.init_method))


class IndexerLayerNorm:
    """``torch.nn.LayerNorm`` (with bias) for the DSA indexer's ``k_norm``.

    Unlike ``WrappedTorchNorm`` it does not refuse sequence parallelism: the indexer gathers the
    sequence before ``k_norm``, so its weights are plain duplicated parameters.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        return torch.nn.LayerNorm(hidden_size, eps=eps, device=device, dtype=config.params_dtype)


class _FixedEpsNorm:
    norm = None
    eps = None

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = None, **kwargs):
        return cls.norm(config=config, hidden_size=hidden_size, eps=cls.eps, **kwargs)


def fixed_eps_norm(norm, eps: float) -> type:
    """A norm builder that always uses ``eps`` whatever epsilon the caller passes."""
    name = f"{getattr(norm, '__name__', 'Norm')}Eps{eps:g}"
    return type(name, (_FixedEpsNorm,), {"norm": staticmethod(norm), "eps": eps})
