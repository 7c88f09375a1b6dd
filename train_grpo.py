"""GRPO on LongStraw: capture each prompt once, sample G responses from its state, replay each
response with autograd against the detached state, step the optimizer.

    python train_grpo.py                    # embedded demo: tiny hybrid model, synthetic task
    torchrun --nproc-per-node 8 train_grpo.py --model qwen3.6-27b ...   (see examples/)

Flags follow Megatron's names (``python train_grpo.py --help``); every one is a field of
``megatron_longstraw/config/trainer.py``'s ``TrainerConfig``.
"""

import os
import sys

from megatron_longstraw import console
from megatron_longstraw.training.arguments import parse_args


def main(argv=None) -> None:
    """Parse, set up the process groups, train, tear down."""
    console.quiet_third_party()  # before torch and Megatron load
    config = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    # torch, Megatron and the training modules load only now: --help and a bad flag answer at once
    from megatron_longstraw.distributed import destroy_distributed, init_distributed
    from megatron_longstraw.training.loop import train

    console.print_optional_line()
    init_distributed(config.parallel.sizes, seed=config.training.seed)
    try:
        train(config)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
