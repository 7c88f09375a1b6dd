"""The policy-loss protocol every registered loss (``grpo/registry.py``) implements, and what the
losses share: the group's stored log-probs laid out like a micro-batch, the KL and entropy terms,
the rollout correction's weights, metric sums.

A loss receives its own configuration (``config/grpo.py``'s ``LossConfig``) and the step's shape
(``StepShape``), never the command line, and owns, for the trainer:

- ``check_config(config)``: the flags it reads, checked once at start-up (the values it takes of
  ``--loss-aggregation`` and ``--advantage-normalization``; ``aggregation`` and
  ``advantage_normalization`` give its defaults of them);
- ``for_group(config, step, ...)``: the loss function of one prompt group, its normalizer fixed
  for the whole global batch;
- ``__call__``: the loss of one replay micro-batch (``longstraw/micro_batches.py``'s ``LossFn``):
  a sum of per-sample terms over the normalizer, so that micro-batches and groups add up;
- ``logged_metrics()``: its metrics under the names it gives them (``metric_names``: the shared
  ones here, each loss adding its own), and ``summed_metrics``, the logged keys summed (not
  averaged) over the step's groups and ranks;
- ``finish_step(metrics, config, step)``: after the step's groups, ``loss/total`` from
  ``loss/sum`` and the factor the accumulated gradients are scaled by before the data-parallel
  average (a normalizer only known once every group is done, such as the global token count).

Tensors are ``[R, B]`` (response position, sample). A micro-batch always holds whole responses.
"""

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch

from megatron_longstraw.config.grpo import AGGREGATIONS, NORMALIZATIONS, LossConfig
from megatron_longstraw.grpo.loss_terms import kl_k3, masked
from megatron_longstraw.grpo.rollout_correction import sequence_weights, token_weights


@dataclass(frozen=True)
class StepShape:
    """What a loss needs to know of the optimizer step besides its own flags."""

    groups_per_rank: int = 1
    """Prompt groups this data-parallel rank trains in the step."""
    data_parallel_size: int = 1
    """Data-parallel ranks (DDP averages their gradients)."""
    max_response_length: int = 1
    """``--max-response-length`` (Dr. GRPO's constant normalizer)."""


@dataclass
class ReplayBatch:
    """One replay micro-batch with the group's stored tensors laid out like it."""

    logprobs_RB: torch.Tensor
    """log-probs under the policy being trained (autograd); padding replaced by the old ones"""
    old_logprobs_RB: torch.Tensor
    """log-probs of the policy that sampled (detached; 0 on padding)"""
    real_RB: torch.Tensor
    """bool: real response tokens"""
    advantages_B: torch.Tensor
    """each sample's advantage, in the log-probs' dtype"""
    ref_kl_RB: Optional[torch.Tensor]
    """k3 of KL(pi || ref) per token (autograd), with reference log-probs only"""
    entropy_RB: Optional[torch.Tensor]
    """the policy's entropy per token, when the replay provides it"""
    sampler_logprobs_RB: Optional[torch.Tensor] = None
    """log-probs of the sampler that drew the responses (detached; the old ones on padding), when
    the rollouts carry them"""


class PolicyLoss:
    """Base of the policy losses: ``loss_fn(logprobs_RB, mask_RB, indices, entropy_RB=None)`` for
    one prompt group's replay, plus the start-up and end-of-step hooks (module doc).

    ``old_logprobs``/``ref_logprobs``/``sampler_logprobs`` hold one 1-D tensor per group sample
    (its response length); ``advantages_G`` one advantage per sample. The config's ``kl_coef``
    weighs k3(pi, ref) and ``entropy_coef`` the entropy bonus, per token (``regularized``); with
    the sampler's log-probs the policy term takes ``rollout_correction``'s weights
    (``corrected_tokens`` / ``corrected_sequences``, ``grpo/rollout_correction.py``) and the
    sampler-trainer gap is logged. Subclasses implement ``loss`` and the hooks.
    """

    name: ClassVar[str] = ""
    """The registered name (set by ``register_policy_loss``)."""
    summary: ClassVar[str] = ""
    """A few words for ``--loss-type``'s help."""
    aggregations: ClassVar[tuple[str, ...]] = ("token",)
    """``--loss-aggregation`` values the loss takes; the first is its default."""
    advantage_normalizations: ClassVar[tuple[str, ...]] = NORMALIZATIONS
    """``--advantage-normalization`` values the loss takes; the first is its default."""
    summed_metrics: ClassVar[tuple[str, ...]] = ("loss/sum",)
    """Logged metric keys summed over the step's groups and data-parallel ranks."""
    metric_names: ClassVar[dict[str, str]] = {
        "approx_kl": "kl/approx", "ref_kl": "kl/reference", "entropy": "entropy/mean",
        "ratio_mean": "ratio/mean", "ratio_max": "ratio/max",
        "sampler_logprob_diff": "rollout/logprob_diff_mean", "sampler_logprob_diff_max": "rollout/logprob_diff_max",
        "correction_weight": "rollout/weight_mean", "correction_weight_min": "rollout/weight_min",
        "correction_weight_max": "rollout/weight_max", "corrected": "rollout/corrected_frac"}
    """``metrics()`` name -> logged name of the metrics every loss has (the shared terms); a loss
    adds its own."""
    per_sequence_metrics: ClassVar[tuple[str, ...]] = ()
    """``metrics()`` names averaged over sequences rather than tokens."""
    needs_entropy: ClassVar[bool] = True
    """Replay hands every call the per-token entropies (``model_steps.loss_of``): they are logged
    even when ``entropy_coef`` is 0."""
    trains_on_given_responses: ClassVar[bool] = False
    """The trainer samples the responses (False) or takes the records' given ones (the answer ids
    of a prompt, a rollout file's responses: ``grpo/losses/sft.py``)."""

    def __init__(self, old_logprobs: Sequence[torch.Tensor], advantages_G: torch.Tensor, *,
                 normalizer: float, config: LossConfig = LossConfig(),
                 ref_logprobs: Optional[Sequence[torch.Tensor]] = None,
                 sampler_logprobs: Optional[Sequence[torch.Tensor]] = None):
        type(self).check_config(config)
        if not normalizer > 0:
            raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
        if advantages_G.dim() != 1 or advantages_G.numel() != len(old_logprobs):
            raise ValueError(f"{advantages_G.numel()} advantages for {len(old_logprobs)} samples' "
                             "old log-probs")
        if any(t.dim() != 1 or t.numel() == 0 for t in old_logprobs):
            raise ValueError("old log-probs must be one non-empty 1-D tensor per sample")
        if ref_logprobs is not None and [t.shape for t in ref_logprobs] != [t.shape for t in old_logprobs]:
            raise ValueError("reference log-probs must match the old log-probs sample by sample")
        if config.kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"--kl-coef {config.kl_coef} needs reference log-probs (ref_logprobs)")
        if sampler_logprobs is not None and [t.shape for t in sampler_logprobs] != [t.shape for t in old_logprobs]:
            raise ValueError("sampler log-probs must match the old log-probs sample by sample")
        if config.rollout_correction != "none" and sampler_logprobs is None:
            raise ValueError(f"--rollout-correction {config.rollout_correction} needs the sampler's log-probs")
        self.config = config
        self.aggregation = self.aggregation_of(config)
        self.sampler_logprobs = None if sampler_logprobs is None else list(sampler_logprobs)
        self.old_logprobs, self.ref_logprobs = list(old_logprobs), ref_logprobs
        self.advantages_G = advantages_G.detach()
        self.clip_eps_low, self.clip_eps_high = config.clip_eps_low, config.clip_eps_high
        self.kl_coef, self.entropy_coef = config.kl_coef, config.entropy_coef
        self.normalizer = normalizer
        self._sums: dict[str, torch.Tensor] = {}

    # ---- start-up and step hooks ------------------------------------------------------------

    @classmethod
    def check_config(cls, config: LossConfig) -> None:
        """Check the flags the loss reads beyond ``LossConfig``'s own checks (once, at start-up):
        the ``--loss-aggregation`` and ``--advantage-normalization`` it takes; ``ValueError``
        names the flag."""
        for flag, value, allowed in (("--loss-aggregation", config.loss_aggregation, cls.aggregations),
                                     ("--advantage-normalization", config.advantage_normalization,
                                      cls.advantage_normalizations)):
            if value is not None and value not in allowed:
                raise ValueError(f"--loss-type {cls.name} takes {flag} {' or '.join(allowed)}, got {value!r}")

    @classmethod
    def aggregation_of(cls, config: LossConfig) -> str:
        """``--loss-aggregation``, or the loss's own default."""
        return config.loss_aggregation or cls.aggregations[0]

    @classmethod
    def advantage_normalization(cls, config: LossConfig) -> str:
        """``--advantage-normalization``, or the loss's own default."""
        return config.advantage_normalization or cls.advantage_normalizations[0]

    @classmethod
    def for_group(cls, config: LossConfig, step: StepShape, old_logprobs: Sequence[torch.Tensor],
                  advantages_G: torch.Tensor, *, ref_logprobs: Optional[Sequence[torch.Tensor]],
                  sampler_logprobs: Optional[Sequence[torch.Tensor]] = None) -> "PolicyLoss":
        """The loss function of one prompt group of the ``step`` on this rank, from the flags and
        what the group provides (the sampler's log-probs when the rollouts carry them)."""
        return cls(old_logprobs, advantages_G, normalizer=cls.group_normalizer(config, step, len(old_logprobs)),
                   config=config, ref_logprobs=ref_logprobs, sampler_logprobs=sampler_logprobs)

    @classmethod
    def group_normalizer(cls, config: LossConfig, step: StepShape, num_responses: int) -> float:
        """What one group's sum of per-sample terms is divided by (``for_group``)."""
        raise NotImplementedError

    @classmethod
    def finish_step(cls, metrics: dict, config: LossConfig, step: StepShape) -> float:
        """After the step's groups (``metrics`` reduced over groups and ranks): replace
        ``loss/sum`` by ``loss/total`` and return the factor for the accumulated gradients."""
        raise NotImplementedError

    # ---- the loss -----------------------------------------------------------------------------

    def loss(self, batch: ReplayBatch) -> torch.Tensor:
        """Scalar loss of one micro-batch (over the normalizer); adds the loss's own metrics."""
        raise NotImplementedError

    def _pad(self, per_sample, indices, lengths, like_RB: torch.Tensor) -> torch.Tensor:
        out_RB = torch.zeros_like(like_RB, requires_grad=False)
        for b, (i, length) in enumerate(zip(indices, lengths)):
            if per_sample[i].numel() != length:
                raise ValueError(f"sample {i}: {per_sample[i].numel()} stored log-probs but "
                                 f"{length} real tokens in the micro-batch")
            out_RB[:length, b] = per_sample[i].detach().to(out_RB)
        return out_RB

    def __call__(self, logprobs_RB: torch.Tensor, mask_RB: torch.Tensor, indices: Sequence[int],
                 entropy_RB: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scalar loss of the micro-batch of group samples ``indices``; accumulates metrics."""
        if self.entropy_coef != 0 and entropy_RB is None:
            raise ValueError(f"--entropy-coef {self.entropy_coef} needs the per-token entropy (entropy_RB)")
        assert logprobs_RB.shape == mask_RB.shape and mask_RB.shape[1] == len(indices)
        real_RB = mask_RB > 0
        lengths = real_RB.sum(0).tolist()
        old_RB = self._pad(self.old_logprobs, indices, lengths, logprobs_RB)
        # padding: new := old, so ratio 1 and k3 0 there, with no inf/NaN to reach the gradient
        logprobs_RB = torch.where(real_RB, logprobs_RB, old_RB)
        advantages_B = self.advantages_G.to(logprobs_RB.device)[list(indices)].to(logprobs_RB.dtype)
        ref_kl_RB = sampler_RB = None
        if self.ref_logprobs is not None:
            ref_kl_RB = kl_k3(logprobs_RB, self._pad(self.ref_logprobs, indices, lengths, logprobs_RB))
        if self.sampler_logprobs is not None:
            sampler_RB = torch.where(real_RB, self._pad(self.sampler_logprobs, indices, lengths, logprobs_RB), old_RB)
        batch = ReplayBatch(logprobs_RB, old_RB, real_RB, advantages_B, ref_kl_RB, entropy_RB, sampler_RB)
        loss = self.loss(batch)
        with torch.no_grad():
            self._accumulate_shared(batch)
        return loss

    def corrected_tokens(self, policy_RB: torch.Tensor, batch: ReplayBatch) -> torch.Tensor:
        """The per-token policy term with the rollout correction's weights (unchanged without the
        sampler's log-probs); logs the weights and the fraction corrected."""
        if batch.sampler_logprobs_RB is None:
            return policy_RB
        weight_RB, corrected_RB = token_weights(batch.old_logprobs_RB, batch.sampler_logprobs_RB,
                                                self.config.rollout_correction, self.config.rollout_correction_cap)
        self._correction_metrics(weight_RB, corrected_RB, batch.real_RB)
        return policy_RB * weight_RB.to(policy_RB.dtype)

    def corrected_sequences(self, policy_B: torch.Tensor, batch: ReplayBatch) -> torch.Tensor:
        """The per-response policy term with the rollout correction's sequence weights (module
        ``rollout_correction``); losses listing ``correction_weight`` and ``corrected`` in
        ``per_sequence_metrics`` log them per response."""
        if batch.sampler_logprobs_RB is None:
            return policy_B
        weight_B, corrected_B = sequence_weights(batch.old_logprobs_RB, batch.sampler_logprobs_RB, batch.real_RB,
                                                 self.config.rollout_correction,
                                                 self.config.rollout_correction_cap)
        self.add_sequence_metric("correction_weight", weight_B)
        self.add_sequence_metric("corrected", corrected_B.float())
        self.add_min_metric("correction_weight_min", weight_B.min())
        self.add_max_metric("correction_weight_max", weight_B.max())
        return policy_B * weight_B.to(policy_B.dtype)

    def _correction_metrics(self, weight_RB: torch.Tensor, corrected_RB: torch.Tensor, real_RB: torch.Tensor) -> None:
        self.add_token_metric("correction_weight", weight_RB, real_RB)
        self.add_token_metric("corrected", corrected_RB.float(), real_RB)
        self.add_min_metric("correction_weight_min", torch.where(real_RB, weight_RB, float("inf")).min())
        self.add_max_metric("correction_weight_max", torch.where(real_RB, weight_RB, float("-inf")).max())

    def regularized(self, per_token_RB: torch.Tensor, batch: ReplayBatch) -> torch.Tensor:
        """``per_token_RB`` + ``kl_coef`` * k3(pi, ref) - ``entropy_coef`` * entropy, per token."""
        if self.kl_coef:
            per_token_RB = per_token_RB + self.kl_coef * batch.ref_kl_RB
        if self.entropy_coef:
            per_token_RB = per_token_RB - self.entropy_coef * batch.entropy_RB
        return per_token_RB

    # ---- metrics ------------------------------------------------------------------------------

    def _add(self, name: str, total: torch.Tensor) -> None:
        total = total.detach().float()
        self._sums[name] = self._sums[name] + total if name in self._sums else total

    def add_token_metric(self, name: str, value_RB: torch.Tensor, real_RB: torch.Tensor) -> None:
        """Add ``value_RB``'s sum over real tokens to metric ``name`` (a per-token mean)."""
        self._add(name, masked(value_RB.detach().float(), real_RB).sum())

    def add_sequence_metric(self, name: str, value_B: torch.Tensor) -> None:
        """Add ``value_B``'s sum to metric ``name`` (listed in ``per_sequence_metrics``)."""
        assert name in self.per_sequence_metrics, name
        self._add(name, value_B.detach().float().sum())

    def add_max_metric(self, name: str, value: torch.Tensor) -> None:
        """Keep the largest ``value`` seen as metric ``name`` (ending in ``_max``)."""
        assert name.endswith("_max"), name
        value = value.detach().float()
        self._sums[name] = torch.maximum(self._sums.get(name, value), value)

    def add_min_metric(self, name: str, value: torch.Tensor) -> None:
        """Keep the smallest ``value`` seen as metric ``name`` (ending in ``_min``)."""
        assert name.endswith("_min"), name
        value = value.detach().float()
        self._sums[name] = torch.minimum(self._sums.get(name, value), value)

    def _accumulate_shared(self, batch: ReplayBatch) -> None:
        real_RB = batch.real_RB
        log_ratio_RB = batch.logprobs_RB.detach() - batch.old_logprobs_RB
        ratio_RB = log_ratio_RB.exp()
        self.add_token_metric("tokens", real_RB, real_RB)
        self._add("sequences", torch.tensor(float(real_RB.shape[1])))
        self.add_token_metric("approx_kl", ratio_RB - 1 - log_ratio_RB, real_RB)  # k3 of KL(old || new)
        self.add_token_metric("ratio_mean", ratio_RB, real_RB)
        self.add_max_metric("ratio_max", torch.where(real_RB, ratio_RB, float("-inf")).max())
        if batch.ref_kl_RB is not None:
            self.add_token_metric("ref_kl", batch.ref_kl_RB, real_RB)
        if batch.entropy_RB is not None:
            self.add_token_metric("entropy_tokens", real_RB, real_RB)
            self.add_token_metric("entropy", batch.entropy_RB, real_RB)
        if batch.sampler_logprobs_RB is not None:  # the sampler-trainer gap (0 up to kernels when on-policy)
            gap_RB = (batch.old_logprobs_RB - batch.sampler_logprobs_RB).abs()
            self.add_token_metric("sampler_logprob_diff", gap_RB, real_RB)
            self.add_max_metric("sampler_logprob_diff_max", torch.where(real_RB, gap_RB, 0.0).max())

    def metrics(self) -> dict[str, float]:
        """Means over all calls so far, per real token unless listed in ``per_sequence_metrics``
        (per sequence): ``policy_loss`` (the policy term only), ``clip_frac_low``/``_high``,
        ``sampler_logprob_diff`` (|old - sampler| per token), ``correction_weight`` and ``corrected``
        (the rollout correction's weights and the fraction truncated or masked; with the sampler's
        log-probs),
        ``approx_kl`` (k3 of old vs new policy), ``ref_kl`` (k3 to the reference; with
        ``ref_logprobs`` only), ``entropy`` (when given), ``ratio_mean`` and the loss's own; the
        ``*_max`` metrics (``ratio_max``) are maxima, the ``*_min`` minima; plus ``tokens`` (the weight for combining
        groups). Empty before a call."""
        if not self._sums:
            return {}
        sums = {name: value.item() for name, value in self._sums.items()}
        tokens, sequences = sums.pop("tokens"), sums.pop("sequences")
        entropy_tokens = sums.pop("entropy_tokens", 0.0)
        out = {}
        for name, value in sums.items():
            if name.endswith(("_max", "_min")):
                out[name] = value
            elif name in self.per_sequence_metrics:
                out[name] = value / sequences
            else:
                out[name] = value / (entropy_tokens if name == "entropy" else tokens)
        out["tokens"] = tokens
        return out

    def logged_metrics(self) -> dict[str, float]:
        """``metrics()`` under the logged names of ``metric_names`` (the rest stay internal)."""
        return {self.metric_names[k]: v for k, v in self.metrics().items() if k in self.metric_names}
