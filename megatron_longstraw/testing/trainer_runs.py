"""Run the trainer in a (spawned) process for multi-process tests; returns what tests compare."""


def train_worker(argv: list[str]) -> dict:
    """``training.loop.train`` on ``argv`` in this rank; returns the last metrics, this rank's
    parameters (CPU copies, named by global layer number: a pipeline stage's layers are
    numbered from 0 locally) and, for tensor-parallel ones, how TP splits them
    (``{name: (partition dim, fused sections)}``, see ``builder.shard_for_rank``)."""
    from megatron_longstraw.distributed import destroy_distributed, init_distributed
    from megatron_longstraw.models.registry import family_for
    from megatron_longstraw.testing.parity import pipeline_global_names
    from megatron_longstraw.training.arguments import parse_args
    from megatron_longstraw.training.loop import train

    import torch

    config = parse_args(argv, world_size=torch.distributed.get_world_size()
                        if torch.distributed.is_initialized() else _world_size())
    init_distributed(config.parallel.sizes, seed=config.training.seed)
    try:
        metrics, model = train(config)
        rename = pipeline_global_names(model)
        # numpy: pickles by value
        params = {rename(n): p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
        family = family_for(model.hf_config["model_type"])
        splits = {rename(n): (p.partition_dim, family.tp_sections(rename(n), model.config))
                  for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    finally:
        destroy_distributed()
    return {"metrics": metrics, "params": params, "tp_splits": splits}


def _world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def train_workers(argvs: list[list[str]]) -> list[dict]:
    """``train_worker`` on each of ``argvs`` in turn in this rank (one spawn serves several runs;
    each run sets up and tears down its own process groups, on a store port of its own:
    ``multiprocess.use_port``)."""
    from megatron_longstraw.testing.multiprocess import use_port

    results = []
    for i, argv in enumerate(argvs):
        use_port(i)
        results.append(train_worker(argv))
    return results
