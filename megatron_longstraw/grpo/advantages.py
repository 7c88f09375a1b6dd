"""Group-relative advantages: each sample's reward against the other samples of its prompt group."""

import torch

from megatron_longstraw.config.grpo import NORMALIZATIONS


def group_advantages(rewards_G: torch.Tensor, normalization: str = "group-std",
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages ``[G]`` (fp32) of one prompt group's rewards ``[G]``.

    ``"group-std"``: ``(r - mean(r)) / (std(r) + eps)`` with the *unbiased* (Bessel-corrected,
    ``n - 1``) standard deviation, i.e. ``torch.std``'s default as used by TRL's GRPOTrainer and
    verl's ``compute_grpo_outcome_advantage``. ``"none"``: only ``r - mean(r)`` (Dr. GRPO).

    A group whose rewards are all equal (including a group of one sample) carries no signal and
    gets exactly zero advantages, never NaN or rounding noise amplified by ``1 / eps``.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"--advantage-normalization must be one of {', '.join(NORMALIZATIONS)}, "
                         f"got {normalization!r}")
    if not eps >= 0:
        raise ValueError(f"advantage eps must be >= 0, got {eps}")
    if rewards_G.dim() != 1 or rewards_G.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor, got shape {tuple(rewards_G.shape)}")
    rewards_G = rewards_G.detach().to(torch.float64)
    if not torch.isfinite(rewards_G).all():
        raise ValueError(f"rewards must be finite, got {rewards_G.tolist()}")
    if bool((rewards_G == rewards_G[0]).all()):
        return torch.zeros(rewards_G.shape, dtype=torch.float32, device=rewards_G.device)
    advantages_G = rewards_G - rewards_G.mean()
    if normalization == "group-std":
        # G >= 2 here: a single sample is an all-equal group
        advantages_G = advantages_G / (rewards_G.std(unbiased=True) + eps)
    return advantages_G.to(torch.float32)


def advantage_stats(advantages_G: torch.Tensor) -> dict[str, float]:
    """``mean``/``std``/``min``/``max`` of advantages as floats for logging (``std``: population,
    so a single sample logs 0 rather than NaN)."""
    values = advantages_G.detach().to(torch.float64).flatten()
    if values.numel() == 0:
        raise ValueError("advantage_stats needs at least one advantage")
    return {"mean": values.mean().item(), "std": values.std(unbiased=False).item(),
            "min": values.min().item(), "max": values.max().item()}
