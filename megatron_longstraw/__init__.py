"""megatron-longstraw: GRPO on million-token prompts with Megatron-Core (LongStraw).

The prompt runs once without autograd; each response replays with autograd against the
detached prompt state. See README.md.
"""

__version__ = "0.1.0"
