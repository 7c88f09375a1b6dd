"""The attention kernels' options: the fused backend of full attention and the block sizes.

One ``KernelOptions`` reaches the kernels as an argument. A model takes it from
``ModelOptions.kernel_options`` (``models/builder.py`` hands it to every module that
``UsesKernelOptions``, which passes it down); the trainer and the benchmark fill it from their
``kernels`` flags (``training/arguments.py``); tests pass their own. Nothing is read from the
environment. The block sizes change memory and speed, never the result beyond rounding. The
module imports no torch: the trainer's argument parser reads its defaults before torch loads.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ATTENTION_BACKENDS = ("cudnn", "flash", "emulated")
DSA_TOPK_MODES = ("packed", "float")
FP8_ATTENTION_MODES = ("off", "capture")
MAX_DECODE_SPLITS = 256
"""At most this many splits of the pages per decode attention call (``decode_split_keys``)."""


@dataclass(frozen=True)
class KernelOptions:
    """How the attention kernels run (not what they compute)."""

    attention_backend: str = "cudnn"
    """Fused kernels of full attention over the prompt state on a GPU: ``cudnn`` (the fastest on
    Hopper at head dim 128/256) or ``flash``, both from torch; ``emulated`` runs the same kernel
    interface in plain torch, and on a CPU takes the place of the math path (tests)."""

    prefix_block: int = 262_144
    """Prompt keys per fused-kernel call of full attention: the bound of one call's transients
    (in backward the blocks' dK/dV, kept only where the pages require a gradient)."""

    decode_split_keys: int = 1024
    """Fewest prompt keys per split of a decode step's attention over the pages. A step's few
    queries would keep only a handful of the GPU's multiprocessors busy in one fused call, so the
    pages are cut into at most ``MAX_DECODE_SPLITS`` splits of at least this many keys, computed
    in one batched call (one split per batch entry) and merged by log-sum-exp."""

    dsa_key_block: int = 16384
    """DSA indexer keys scored at a time by the blockwise top-k."""

    dsa_score_elements: int = 1 << 27
    """fp32 elements of one block of DSA index scores (``[query block, heads, key block]`` in
    torch, ``[query block, key block]`` in the fused kernel): sets the query block."""

    dsa_gather_elements: int = 1 << 27
    """Elements of one query block's gathered latents plus attention scores in the blockwise
    sparse attention: sets its query block."""

    dsa_topk: str = "packed"
    """How a key block's fp32 index scores enter the running top-k: ``packed`` ranks every score
    packed with its position in one int64 (64-bit keys); ``float`` first takes the block's top-k
    on the fp32 scores (32-bit keys, half the radix passes) and packs only those, unless a tie at
    the k-th score could have been cut arbitrarily (that block then goes the packed way). Both
    select the same keys."""

    fp8_attention: str = "off"
    """``capture``: the no-grad prompt capture's full attention in FP8 (E4M3) on Hopper, cuDNN's
    ``sdpa_fp8`` (``attention/fp8_capture_attention.py``); replay, decoding and the prompt
    backward stay in the model's dtype. Unlike the other options it changes the result beyond
    bf16 rounding (the prompt state is computed from FP8 attention)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of an option that cannot work."""
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        for name in ("prefix_block", "decode_split_keys", "dsa_key_block", "dsa_score_elements", "dsa_gather_elements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.fp8_attention not in FP8_ATTENTION_MODES:
            raise ValueError(f"--fp8-attention must be one of {FP8_ATTENTION_MODES}, got {self.fp8_attention!r}")
        if self.dsa_topk not in DSA_TOPK_MODES:
            raise ValueError(f"--dsa-topk must be one of {DSA_TOPK_MODES}, got {self.dsa_topk!r}")


class UsesKernelOptions:
    """A module whose attention kernels take ``KernelOptions``: it passes ``kernel_options`` (the
    defaults until ``set_kernel_options``) to them."""

    kernel_options: KernelOptions = KernelOptions()


def set_kernel_options(model: "torch.nn.Module", options: KernelOptions) -> None:
    """Hand ``options`` (validated) to every module of ``model`` that ``UsesKernelOptions``."""
    options.validate()
    for module in model.modules():
        if isinstance(module, UsesKernelOptions):
            module.kernel_options = options
