"""Run the trainer in a (spawned) process for multi-process tests; returns what tests compare."""


def train_worker(argv: list[str]) -> dict:
    """``train_grpo.train`` on ``argv`` in this rank; returns the last metrics and, from the
    first data-parallel rank, the parameters (CPU copies)."""
    import train_grpo
    from megatron_longstraw.distributed import destroy_distributed, init_distributed

    import torch

    args = train_grpo.parse_args(argv, world_size=torch.distributed.get_world_size()
                                 if torch.distributed.is_initialized() else _world_size())
    init_distributed(args.parallel, seed=args.seed)
    try:
        metrics, model = train_grpo.train(args)
        params = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}  # pickles by value
    finally:
        destroy_distributed()
    return {"metrics": metrics, "params": params}


def _world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))
