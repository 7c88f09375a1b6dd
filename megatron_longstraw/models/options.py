"""Build options shared by every family: implementation, precision, FP8 and kernel settings."""

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from megatron.core import parallel_state

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.config.model import (FP8Attention, FP8Format, FP8Recipe, ModelConfig, PrecisionConfig,
                                             TransformerImpl)
from megatron_longstraw.config.node import ConfigNode
from megatron_longstraw.config.parallel import ParallelConfig


@dataclass
class ModelOptions(ConfigNode):
    """How to build a model (not what model): backend, dtype, FP8, sequence parallel; the choices
    are the flags' (``config/model.py``), checked on construction as a configuration node's."""

    transformer_impl: TransformerImpl = "local"
    params_dtype: torch.dtype = torch.float32
    fp8_format: Optional[FP8Format] = None
    fp8_recipe: FP8Recipe = "delayed"
    fp8_attention: FP8Attention = "off"
    """``--fp8-attention``: ``capture`` hooks the FP8 capture attention into the attention cores."""
    sequence_parallel: bool = False
    recompute_granularity: Optional[Literal["full"]] = None
    """Megatron's: ``"full"`` or ``None``."""
    perform_initialization: bool = True
    """``False``: leave weights uninitialized (checkpoint layouts)."""
    kernel_options: KernelOptions = field(default_factory=KernelOptions)
    """The attention kernels' backend and block sizes, handed to the attention modules at the build."""

    @classmethod
    def of(cls, model: ModelConfig, precision: PrecisionConfig, parallel: ParallelConfig = ParallelConfig(),
           kernels: KernelOptions = KernelOptions(), **overrides) -> "ModelOptions":
        """The options of a command's configuration groups (``overrides``: fields set apart)."""
        options = dict(transformer_impl=model.transformer_impl,
                       params_dtype=torch.bfloat16 if precision.bf16 else torch.float32,
                       fp8_format=precision.fp8_format, fp8_recipe=precision.fp8_recipe,
                       fp8_attention=precision.fp8_attention, sequence_parallel=parallel.sequence_parallel,
                       recompute_granularity=model.recompute, kernel_options=kernels)
        return cls(**{**options, **overrides})

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag for options that cannot work here (Transformer
        Engine absent)."""
        needs_te = self.transformer_impl == "transformer_engine" or self.fp8_format is not None
        if needs_te and not have_transformer_engine():
            flag = "--fp8-format" if self.fp8_format else "--transformer-impl transformer_engine"
            raise ValueError(f"{flag} needs Transformer Engine, which is not installed")
        if self.fp8_format is not None and self.transformer_impl != "transformer_engine":
            raise ValueError("--fp8-format needs --transformer-impl transformer_engine")

    def config_kwargs(self) -> dict:
        """``TransformerConfig`` keyword arguments common to every family."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
        return dict(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            # the interleaved schedule's point-to-point settings as Megatron's training sets them:
            # its batched exchange posts a send to the previous rank before the send to the next,
            # and with PP=2 (previous = next rank) the receiver takes the two in the other order
            # (activations and gradients swap; found by tests/test_pipeline_parallel.py)
            overlap_p2p_comm=vpp > 1,
            batch_p2p_comm=vpp == 1,
            context_parallel_size=parallel_state.get_context_parallel_world_size(),
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            sequence_parallel=self.sequence_parallel and tp > 1,
            params_dtype=self.params_dtype,
            pipeline_dtype=self.params_dtype,
            bf16=self.params_dtype == torch.bfloat16,
            fp16=self.params_dtype == torch.float16,
            transformer_impl=self.transformer_impl,
            fp8=self.fp8_format,
            fp8_recipe=self.fp8_recipe if self.fp8_format else "delayed",
            use_cpu_initialization=not torch.cuda.is_available(),
            perform_initialization=self.perform_initialization,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            normalization="RMSNorm",
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            recompute_granularity=self.recompute_granularity,
            # full recompute: every layer checkpointed, one at a time
            recompute_method="uniform" if self.recompute_granularity == "full" else None,
            recompute_num_layers=1 if self.recompute_granularity == "full" else None,
        )


def have_transformer_engine() -> bool:
    """True when ``transformer_engine.pytorch`` imports."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails on load
        return False
    return True


def backend_provider(options: ModelOptions):
    """Megatron's spec provider for the chosen implementation (local or Transformer Engine)."""
    options.validate()
    if options.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    from megatron.core.models.backends import LocalSpecProvider

    return LocalSpecProvider()
