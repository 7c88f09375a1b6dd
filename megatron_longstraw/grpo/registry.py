"""The policy losses by name, selected with ``--loss-type`` (after verl's ``register_policy_loss``).

A loss is a ``grpo/loss_base.py`` ``PolicyLoss`` subclass (the protocol the trainer calls:
``validate_args`` at start-up, ``for_group`` per prompt group, the micro-batch ``__call__``,
``logged_metrics``/``summed_metrics``, ``finish_step``), one file each. Register one with
``@register_policy_loss("name")``; the built-in ones are registered below.
"""

from megatron_longstraw.grpo.cispo_loss import CISPOLoss
from megatron_longstraw.grpo.dr_grpo_loss import DrGRPOLoss
from megatron_longstraw.grpo.gspo_loss import GSPOLoss
from megatron_longstraw.grpo.loss_base import PolicyLoss
from megatron_longstraw.grpo.policy_loss import GRPOLoss
from megatron_longstraw.grpo.sft_loss import SFTLoss

POLICY_LOSSES: dict[str, type[PolicyLoss]] = {}


def register_policy_loss(name: str):
    """Class decorator registering a ``PolicyLoss`` subclass under ``name`` (its ``name`` too)."""
    def register(cls: type[PolicyLoss]) -> type[PolicyLoss]:
        if not (isinstance(cls, type) and issubclass(cls, PolicyLoss)):
            raise TypeError(f"policy loss {name!r} must be a PolicyLoss subclass, got {cls!r}")
        if POLICY_LOSSES.get(name, cls) is not cls:
            raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].__name__})")
        cls.name = name
        POLICY_LOSSES[name] = cls
        return cls
    return register


def get_policy_loss(name: str) -> type[PolicyLoss]:
    """The loss class registered under ``name``; ``ValueError`` naming ``--loss-type`` otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"--loss-type must be one of {', '.join(POLICY_LOSSES)}, got {name!r}")
    return POLICY_LOSSES[name]


for _loss in (GRPOLoss, DrGRPOLoss, GSPOLoss, CISPOLoss, SFTLoss):
    register_policy_loss(_loss.name)(_loss)
