"""What model is built, and in which precision (the ``model`` and ``precision`` flag groups)."""

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_longstraw.config.node import ConfigNode

DEFAULT_MODEL = "qwen3.5-debug"
"""The preset built when neither ``--model`` nor a checkpoint names the model."""

TransformerImpl = Literal["local", "transformer_engine"]
FP8Format = Literal["hybrid", "e4m3"]
FP8Recipe = Literal["delayed", "tensorwise", "blockwise", "mxfp8"]
FP8Attention = Literal["off", "capture"]


@dataclass(frozen=True)
class ModelConfig(ConfigNode):
    """The model: its architecture and how Megatron builds its layers."""

    TITLE: ClassVar[str] = "model"

    model: Optional[str] = None
    """Preset name, HF folder or config.json, or a checkpoint folder (tools/convert_checkpoint.py
    output or a trainer save: its hf_config.json) (default: the model of --pretrained-checkpoint
    where the command takes it, else qwen3.5-debug)."""

    hf_config: Optional[str] = None
    """HF config.json or folder, overriding --model (default: unset)."""

    model_family: Optional[str] = field(default=None, metadata={"metavar": "MODULE_OR_PATH"})
    """An out-of-tree model family: a dotted module path or .py file, optionally :ATTRIBUTE, naming
    a ModelFamily (default attribute FAMILY) that serves its model types; registered before
    --model / --hf-config is resolved (default: the built-in families)."""

    num_layers: Optional[int] = None
    """Keep the model's first N decoder layers: its widths at a reduced depth, e.g. a run scaled
    to fewer GPUs (default: all of them)."""

    max_position_embeddings: Optional[int] = None
    """Override the model's position budget (RoPE extrapolation; default: the model's, times
    --yarn-factor when given)."""

    yarn_factor: Optional[float] = None
    """YaRN over the model's native positions by this factor: rope_type yarn with
    original_max_position_embeddings the config's max_position_embeddings, which grows by the
    factor. The Qwen3.5/3.6 model cards reach ~1M positions with 4 (default: the config's own
    RoPE; a config that already has YaRN of this factor is kept as is)."""

    transformer_impl: TransformerImpl = "local"
    """Megatron's layers: local (plain torch) or transformer_engine (needs Transformer Engine;
    FP8)."""

    recompute_granularity: Literal["none", "full"] = "none"
    """full: recompute each layer's activations in backward instead of keeping them; none: keep
    them."""

    def check(self) -> None:
        for flag, value in (("--num-layers", self.num_layers),
                            ("--max-position-embeddings", self.max_position_embeddings)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.yarn_factor is not None and not self.yarn_factor > 1:
            raise ValueError(f"--yarn-factor must be > 1, got {self.yarn_factor}")

    @property
    def spec(self) -> Optional[str]:
        """What the model config is read from when given: ``--hf-config``, else ``--model``."""
        return self.hf_config or self.model

    @property
    def name(self) -> str:
        """The model as results and messages name it: ``--hf-config`` / ``--model``, else the default preset."""
        return self.spec or DEFAULT_MODEL

    @property
    def spec_flag(self) -> str:
        """The flag of ``spec``."""
        return "--hf-config" if self.hf_config else "--model"

    @property
    def recompute(self) -> Optional[str]:
        """Megatron's ``recompute_granularity``: ``"full"`` or ``None``."""
        return None if self.recompute_granularity == "none" else self.recompute_granularity


@dataclass(frozen=True)
class PrecisionConfig(ConfigNode):
    """The numerics: parameter dtype, FP8 matmuls and FP8 capture attention."""

    TITLE: ClassVar[str] = "precision"

    bf16: bool = False
    """bf16 parameters with fp32 main weights."""

    fp8_format: Optional[FP8Format] = None
    """FP8 matmuls through Transformer Engine: hybrid (e4m3 forward, e5m2 gradients) or e4m3
    (default: no FP8)."""

    fp8_recipe: FP8Recipe = "delayed"
    """FP8 scaling recipe (with --fp8-format)."""

    fp8_attention: FP8Attention = "off"
    """capture: the prompt capture's full attention in FP8 on Hopper (cuDNN's sdpa_fp8; needs
    nvidia-cudnn-frontend); replay, decoding and the prompt backward stay in the model's dtype.
    Unlike the kernel flags it changes the result: log-probs after a 2M-token prompt 1.7e-2 from
    bf16's (docs/transformer_engine.md)."""
