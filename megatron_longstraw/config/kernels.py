"""The attention kernels' options: the fused backend of full attention and the block sizes (the
``kernels`` flag group).

One ``KernelOptions`` reaches the kernels as an argument. A model takes it from
``ModelOptions.kernel_options`` (``models/builder.py`` hands it to every module that
``attention/kernel_options.py``'s ``UsesKernelOptions``, which passes it down); the trainer and
the benchmarks fill it from their ``kernels`` flags; tests pass their own. Nothing is read from
the environment. These options change memory and speed, never the result beyond rounding (what
changes the numerics is ``config/model.py``'s ``PrecisionConfig``).
"""

from dataclasses import dataclass
from typing import ClassVar, Literal

from megatron_longstraw.config.node import ConfigNode

AttentionBackend = Literal["cudnn", "flash", "emulated"]
DSATopk = Literal["packed", "float"]
ATTENTION_BACKENDS = AttentionBackend.__args__
DSA_TOPK_MODES = DSATopk.__args__


@dataclass(frozen=True)
class KernelOptions(ConfigNode):
    """How the attention kernels run (not what they compute)."""

    TITLE: ClassVar[str] = "kernels"

    attention_backend: AttentionBackend = "cudnn"
    """Fused kernels of full attention over the prompt state on a GPU; emulated: their interface in
    plain torch (also on a CPU, for tests).

    ``cudnn`` is the fastest on Hopper at head dim 128/256; ``flash`` the other fused kernel of
    torch; ``emulated`` takes the place of the math path on a CPU."""

    prefix_block: int = 262_144
    """Prompt keys per fused full-attention call in capture and replay (bounds one call's
    transients).

    In backward the blocks' dK/dV are kept only where the pages require a gradient."""

    decode_split_keys: int = 1024
    """Fewest prompt keys per split of a decode step's attention over the pages (the whole splits
    run as one batched call, a shorter rest as a second; merged by log-sum-exp).

    A step's few queries would keep only a handful of the GPU's multiprocessors busy in one fused
    call, so the pages are cut into at most ``attention/kernel_options.py``'s
    ``MAX_DECODE_SPLITS`` splits of at least this many keys."""

    dsa_key_block: int = 16384
    """DSA indexer keys scored at a time by the blockwise top-k."""

    dsa_score_elements: int = 1 << 27
    """fp32 elements of one block of DSA index scores (sets the indexer's query block).

    ``[query block, heads, key block]`` in torch, ``[query block, key block]`` in the fused
    kernel."""

    dsa_gather_elements: int = 1 << 27
    """Elements of one query block's gathered latents and scores in DSA sparse attention (sets its
    query block)."""

    dsa_topk: DSATopk = "packed"
    """How the DSA running top-k ranks a key block's fp32 scores: packed (every score in an int64
    with its position) or float (the block's fp32 top-k first); same selection.

    ``float`` has 32-bit keys, half the radix passes, and packs only the block's top-k, unless a
    tie at the k-th score could have been cut arbitrarily (that block then goes the packed way)."""

    def check(self) -> None:
        for name in ("prefix_block", "decode_split_keys", "dsa_key_block", "dsa_score_elements", "dsa_gather_elements"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
