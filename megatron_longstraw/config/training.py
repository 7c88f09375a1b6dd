"""The trainer's own groups: optimizer and schedule, steps and batch, checkpoints, logging."""

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from megatron_longstraw.config.node import ConfigNode


@dataclass(frozen=True)
class OptimizerConfig(ConfigNode):
    """Megatron's Adam and its learning-rate schedule."""

    TITLE: ClassVar[str] = "optimizer and learning-rate schedule"

    lr: float = 1e-3
    """Peak learning rate (Adam)."""

    min_lr: float = 0.0
    """Learning rate at the end of the decay."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "constant"
    """Learning-rate schedule after the warm-up."""

    lr_warmup_iters: int = 0
    """Steps of linear warm-up from 0 to --lr."""

    lr_decay_iters: Optional[int] = None
    """Steps over which the learning rate decays to --min-lr (default: --train-iters)."""

    weight_decay: float = 0.0
    """Decoupled (AdamW-style) weight decay."""

    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0: no clipping."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    adam_eps: float = 1e-8
    """Adam's epsilon."""

    def check(self) -> None:
        for flag, value in (("--lr", self.lr), ("--min-lr", self.min_lr), ("--weight-decay", self.weight_decay),
                            ("--clip-grad", self.clip_grad), ("--adam-eps", self.adam_eps)):
            if value < 0 or not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} exceeds --lr {self.lr}")
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0 <= value < 1:
                raise ValueError(f"{flag} must be in [0, 1), got {value}")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            raise ValueError(f"--lr-decay-iters must be >= 1, got {self.lr_decay_iters}")

    def decay_iters(self, train_iters: int) -> int:
        """``--lr-decay-iters``, or the run's ``--train-iters`` when unset."""
        return train_iters if self.lr_decay_iters is None else self.lr_decay_iters


@dataclass(frozen=True)
class TrainingConfig(ConfigNode):
    """Steps, batch and seed."""

    TITLE: ClassVar[str] = "training"

    train_iters: int = 4
    """Optimizer steps of the run (a resume counts the loaded ones)."""

    global_batch_size: int = 2
    """Prompt groups per optimizer step, over all data-parallel ranks."""

    seed: int = 1234
    """Seed of the initialization, the data and the sampling."""

    def check(self) -> None:
        for flag, value in (("--train-iters", self.train_iters), ("--global-batch-size", self.global_batch_size)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


@dataclass(frozen=True)
class CheckpointConfig(ConfigNode):
    """Where a run saves and what it resumes or starts from."""

    TITLE: ClassVar[str] = "checkpointing"

    save: str = "runs/grpo-demo/checkpoints"
    """Checkpoint folder: iter_XXXXXXX/ per save, and the latest's number."""

    load: Optional[str] = None
    """Resume from this save directory or checkpoint (default: --save when it holds a
    checkpoint)."""

    no_load: bool = False
    """Start fresh even when --save holds a checkpoint (refused there without --overwrite)."""

    overwrite: bool = False
    """Let a fresh run use a --save that holds checkpoints (each replaced only when this run saves
    that iteration; the earlier tracker is set aside after the first step) and a --wandb-save-dir
    with an earlier run's metrics.jsonl (kept as metrics.jsonl.N)."""

    save_interval: Optional[int] = None
    """Save every N steps (default: only at the end)."""

    exit_duration_in_mins: Optional[float] = None
    """Stop after the first step that ends this many minutes after training began (start-up not
    counted), saving a checkpoint there unless --no-save; the same command run again resumes from
    it (default: unset, run to --train-iters)."""

    no_save: bool = False
    """Write no checkpoint (nor resume from --save)."""

    pretrained_checkpoint: Optional[str] = None
    """Initial weights and the model: a Megatron checkpoint from tools/convert_checkpoint.py or a
    run's save (e.g. a --loss-type sft warm start: its weights only, the run starts at step 1),
    whose hf_config.json gives the model (a --model / --hf-config must describe the same
    architecture) (default: random initialization)."""

    def check(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval must be >= 1, got {self.save_interval}")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise ValueError(f"--exit-duration-in-mins must be > 0, got {self.exit_duration_in_mins}")
        if self.no_load and self.load is not None:
            raise ValueError(f"--no-load contradicts --load {self.load}")


@dataclass(frozen=True)
class LoggingConfig(ConfigNode):
    """The console, metrics.jsonl and wandb."""

    TITLE: ClassVar[str] = "logging"

    log_interval: int = 1
    """A console line every N steps (metrics.jsonl and wandb get every step)."""

    wandb_project: Optional[str] = None
    """wandb project, logged online when credentials exist (default: megatron-longstraw,
    offline)."""

    wandb_exp_name: str = "grpo-demo"
    """wandb run name."""

    wandb_save_dir: str = "runs/grpo-demo"
    """Folder of metrics.jsonl and the wandb files."""

    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None
    """How wandb logs (default: online with --wandb-project and credentials, else offline)."""

    progress: bool = False
    """Progress bars for capture and decoding also without a terminal."""

    peak_tflops: float = 785.0
    """Per-GPU peak for MFU (785: measured bf16 matmul peak of an H200)."""

    def check(self) -> None:
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.log_interval}")
