"""``train_grpo.py``'s command line: generated from ``config/trainer.py``'s ``TrainerConfig`` (every
flag, its help and default defined once there), then the checks that need more than the
configuration: the registered loss, an out-of-tree model family or reward, the files named.

The parser imports no torch, Megatron or transformers (``--help`` answers at once); what needs
them is checked after parsing, in ``check_config``.
"""

import argparse
import os

from megatron_longstraw.config import cli
from megatron_longstraw.config.trainer import TrainerConfig


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser: every group of ``TrainerConfig``."""
    return cli.build_parser(TrainerConfig, description="GRPO on LongStraw (capture once, replay each response)",
                            usage="%(prog)s [options]")


def check_config(config: TrainerConfig) -> None:
    """What the configuration alone cannot check (``ValueError`` naming the flag): the loss's own
    flags, the files the flags name, an out-of-tree model family or reward function, where the
    run starts from (``training/startup.py``)."""
    from megatron_longstraw.grpo.registry import get_policy_loss  # these import torch: after parsing
    from megatron_longstraw.models.registry import load_family
    from megatron_longstraw.training.startup import model_source, resume_path

    loss = get_policy_loss(config.loss.loss_type)
    loss.check_config(config.loss)
    if loss.trains_on_given_responses and config.grpo.dynamic_sampling:
        raise ValueError(f"--loss-type {config.loss.loss_type} trains on given responses: --dynamic-sampling has "
                         "no group rewards to act on")
    rollout_path, data_path = config.rollout.rollout_path, config.data.data_path
    if rollout_path and not os.path.isfile(rollout_path):
        raise ValueError(f"--rollout-path {rollout_path}: no such file")
    if not config.data.synthetic and config.rollout.rollout_source == "internal" and not os.path.isfile(data_path):
        raise ValueError(f"--data-path {data_path}: no such file")
    extra_family = None
    if config.model.model_family:
        try:
            extra_family = load_family(config.model.model_family)
        except ValueError as err:
            raise ValueError(f"--model-family: {err}") from None
    if ":" in config.reward.reward_fn:  # imported now: a missing module or function fails before the model is built
        from megatron_longstraw.rewards.registry import load_user_reward

        load_user_reward(config.reward.reward_fn)
    for flag, path in (("--load", config.checkpoint.load), ("--pretrained-checkpoint",
                                                            config.checkpoint.pretrained_checkpoint)):
        if path is not None and not os.path.exists(path):
            raise ValueError(f"{flag} {path}: no such checkpoint")
    resume_path(config)
    model_source(config, extra_family)


def parse_args(argv=None, world_size: int = 1) -> TrainerConfig:
    """The checked configuration of the command line ``argv`` for ``world_size`` processes."""
    config, _ = cli.parse(TrainerConfig, argv, build_parser(), world_size=world_size)
    check_config(config)
    return config
