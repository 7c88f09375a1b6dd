"""One GRPO prompt group on LongStraw: capture -> rollouts -> rewards -> advantages -> old
log-probs -> replay with autograd. The optimizer step and logging live in ``train_grpo.py``.

The loss is ``--loss-type``'s from ``grpo/registry.py``, built per group (``for_group``); its
normalization over the global batch, and any rescale ``train_grpo.py`` applies once the step's
groups are done (``finish_step``), are the loss's (``grpo/loss_base.py``).
"""

import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.trainer import TrainerConfig
from megatron_longstraw.grpo.advantages import advantage_stats, group_advantages
from megatron_longstraw.grpo.loss_base import StepShape
from megatron_longstraw.grpo.registry import get_policy_loss
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.full_graph import full_graph_hidden, full_graph_responses
from megatron_longstraw.longstraw.micro_batches import micro_batches
from megatron_longstraw.longstraw.model_steps import response_logprobs
from megatron_longstraw.longstraw.pipeline import from_last_stage, pipeline_parallel, score_logprobs_pp
from megatron_longstraw.longstraw.prompt_backward import prompt_backward
from megatron_longstraw.longstraw.replay import replay_hidden, replay_responses
from megatron_longstraw.rewards.scoring import score_group
from megatron_longstraw.rollout.generate import generate_from_state
from megatron_longstraw.training.dynamic_sampling import agree_uniform
from megatron_longstraw.training.progress import progress_bar


@dataclass
class PromptGroup:
    """One prompt with its G responses (internal rollouts fill ``responses`` and ``rewards_G``)."""

    prompt_ids_S: torch.Tensor
    answer: object = None
    metadata: Optional[dict] = None
    source: Optional[str] = None  # <file>:<line> or synthetic:<index>, named in errors
    responses: list = field(default_factory=list)
    rewards_G: Optional[torch.Tensor] = None
    sampler_logprobs: Optional[list] = None  # the sampler's per-token log-probs, when known


class PhaseClock:
    """Wall time and peak GPU memory per phase (``time/<phase>_s``, ``mem/<phase>_peak_gib``)."""

    def __init__(self):
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        """Time the block (synchronizing the GPU at both ends) and record its peak memory."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                key = f"mem/{phase}_peak_gib"
                self.metrics[key] = max(self.metrics.get(key, 0.0), torch.cuda.max_memory_allocated() / 2 ** 30)
            key = f"time/{phase}_s"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - start


def _same_on_tp_ranks(rewards_G: torch.Tensor) -> torch.Tensor:
    """TP rank 0's rewards on every TP rank (a non-deterministic reward must not split them)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(rewards_G, parallel_state.get_tensor_model_parallel_src_rank(),
                                    group=parallel_state.get_tensor_model_parallel_group())
    return rewards_G


def score_logprobs(model, state, prompt_ids_1S, responses, longstraw: LongStrawConfig) -> list[torch.Tensor]:
    """Per-response log-probs under ``model`` without a graph, computed exactly as the training
    forward computes them (replay against ``state``, or the full graph in ``--replay-mode full``);
    under pipeline parallelism on the last stage (``score_logprobs_pp``)."""
    if pipeline_parallel():
        return score_logprobs_pp(model, state, responses, longstraw.replay_micro_batch_size)
    out = []
    with torch.no_grad():
        for ids_BR, _, indices in micro_batches(responses, longstraw.replay_micro_batch_size):
            chunk = [responses[i] for i in indices]
            hidden_RBH = (replay_hidden(model, state, ids_BR) if longstraw.replay_mode == "longstraw"
                          else full_graph_hidden(model, prompt_ids_1S, ids_BR))
            logprobs_RB = response_logprobs(model, hidden_RBH, ids_BR.t())
            out.extend(logprobs_RB[: r.numel(), i].float() for i, r in enumerate(chunk))
    return out


def _answer_ids(group: PromptGroup, loss_type: str, max_length: int) -> torch.Tensor:
    """The record's answer as token ids (what ``--loss-type sft`` trains on as its response), cut
    to ``max_length`` (``--max-response-length``); ``ValueError`` naming the loss and the record
    otherwise."""
    answer = group.answer
    if not (isinstance(answer, (list, tuple)) and answer and all(isinstance(i, int) for i in answer)):
        raise ValueError(f"--loss-type {loss_type}: record {group.source} has no token-id answer to train on "
                         f"(got {type(answer).__name__}); give \"answer\" as a list of ids, or responses")
    return torch.tensor(list(answer)[:max_length], dtype=torch.long)


def train_group(model, group: PromptGroup, config: TrainerConfig, step: StepShape, *, reward_fn, eos_id: int,
                generator: torch.Generator, reference=None, clock: PhaseClock,
                drop_uniform: bool = False) -> Optional[dict]:
    """Process one prompt group of the ``step``, accumulating gradients in ``model``; returns its
    metrics. ``drop_uniform`` (dynamic sampling): a group whose rewards are all equal is left
    untrained once they are known (before its capture when they come with it), and ``None`` is
    returned."""
    prompt_ids_1S = group.prompt_ids_S[None]
    longstraw, rollout, loss_config = config.longstraw, config.rollout, config.loss
    exact, show = longstraw.exact, config.logging.progress
    policy_loss = get_policy_loss(loss_config.loss_type)
    if drop_uniform and group.rewards_G is not None and agree_uniform(group.rewards_G):
        return None  # rewards from the rollout file: nothing to capture
    with clock("capture"), progress_bar(prompt_ids_1S.shape[1], "capture", show) as bar:
        state = capture_prompt(model, prompt_ids_1S, longstraw.prompt_chunk_size, progress=bar.update, exact=exact)
    try:
        if not group.responses and policy_loss.trains_on_given_responses:
            answer = _answer_ids(group, loss_config.loss_type, rollout.max_response_length)
            group.responses = [answer.to(prompt_ids_1S.device)]  # the one given response
        if not group.responses:
            with clock("rollout"), progress_bar(rollout.max_response_length, "decode", show) as bar:
                rollouts = generate_from_state(
                    model, state, config.grpo.num_generations, rollout.max_response_length,
                    temperature=rollout.temperature, top_p=rollout.top_p, eos_id=eos_id, generator=generator,
                    progress=lambda p: bar.update(p.step - bar.n), cuda_graphs=rollout.decode_cuda_graphs)
                group.responses = [r.to(prompt_ids_1S.device) for r in rollouts.responses]
                # the decoder's own log-probs (temperature 1: what replay scores): the gap is a health signal
                group.sampler_logprobs = [lp.to(prompt_ids_1S.device) for lp in rollouts.logprobs]
        if group.rewards_G is None:
            with clock("reward"):
                group.rewards_G = _same_on_tp_ranks(score_group(
                    reward_fn, group.prompt_ids_S, group.responses, group.answer, group.metadata,
                    source=group.source).to(prompt_ids_1S.device))
        if drop_uniform and agree_uniform(group.rewards_G):
            return None  # the finally below frees the state
        advantages_G = group_advantages(group.rewards_G.float(), policy_loss.advantage_normalization(loss_config))
        with clock("scoring"):
            old_logprobs = score_logprobs(model, state, prompt_ids_1S, group.responses, longstraw)
            ref_logprobs = None
            if reference is not None:
                ref_state = capture_prompt(reference, prompt_ids_1S, longstraw.prompt_chunk_size)
                try:
                    ref_logprobs = score_logprobs(reference, ref_state, prompt_ids_1S, group.responses, longstraw)
                finally:
                    ref_state.free()
        loss_fn = policy_loss.for_group(loss_config, step, old_logprobs, advantages_G.to(old_logprobs[0].device),
                                        ref_logprobs=ref_logprobs, sampler_logprobs=group.sampler_logprobs)
        micro_batch = longstraw.replay_micro_batch_size
        with clock("replay"):
            if longstraw.replay_mode == "longstraw":
                losses = replay_responses(model, state, group.responses, loss_fn, micro_batch, exact=exact)
            else:
                losses = full_graph_responses(model, prompt_ids_1S, group.responses, loss_fn, micro_batch,
                                              exact=exact)
        state_bytes, state_grad_bytes = state.nbytes(), state.state_grad_nbytes()
        if longstraw.exact_sweep:  # one chunked backward through the prompt
            with clock("prompt_backward"):
                prompt_backward(model, state, prompt_ids_1S)
    finally:
        state.free()
    max_length = rollout.max_response_length
    if not pipeline_parallel():
        metrics = _group_metrics(group, advantages_G, loss_fn, sum(losses), state_bytes, eos_id, max_length)
        if longstraw.exact_sweep:
            metrics["prompt/state_grad_bytes"] = float(state_grad_bytes)
        return metrics
    # the loss and its metrics exist on the last stage; the prompt state is spread over the stages
    metrics = from_last_stage(_group_metrics(group, advantages_G, loss_fn, sum(losses), state_bytes, eos_id,
                                             max_length) if parallel_state.is_pipeline_last_stage() else None)
    total_bytes = torch.tensor([float(state_bytes), float(state_grad_bytes)], dtype=torch.float64,
                               device=prompt_ids_1S.device)
    torch.distributed.all_reduce(total_bytes, group=parallel_state.get_pipeline_model_parallel_group())
    metrics["prompt/state_bytes"] = total_bytes[0].item()
    if longstraw.exact_sweep:
        metrics["prompt/state_grad_bytes"] = total_bytes[1].item()
    return metrics


def _group_metrics(group, advantages_G, loss_fn, loss, state_bytes, eos_id, max_response_length: int) -> dict:
    rewards_G = group.rewards_G.float()
    lengths = torch.tensor([r.numel() for r in group.responses], dtype=torch.float32)
    ended = [r.numel() > 0 and int(r[-1]) == eos_id for r in group.responses]
    truncated = [not e and r.numel() >= max_response_length for e, r in zip(ended, group.responses)]
    metrics = {
        "reward/mean": rewards_G.mean().item(), "reward/std": rewards_G.std(unbiased=False).item(),
        "reward/min": rewards_G.min().item(), "reward/max": rewards_G.max().item(),
        "reward/zero_std_groups": float(rewards_G.std(unbiased=False).item() == 0.0),
        **{f"advantage/{k}": v for k, v in advantage_stats(advantages_G).items()},
        "loss/sum": loss,
        "response/length_mean": lengths.mean().item(), "response/length_min": lengths.min().item(),
        "response/length_max": lengths.max().item(),
        "response/truncation_rate": sum(truncated) / len(truncated),
        "prompt/length": float(group.prompt_ids_S.numel()), "prompt/state_bytes": float(state_bytes),
        "tokens/response": lengths.sum().item(),
    }
    metrics.update(loss_fn.logged_metrics())
    return metrics
