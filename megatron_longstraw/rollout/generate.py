"""Batched autoregressive decoding of G samples from one captured prompt state.

``generate_from_state`` decodes every unfinished sample one token per step in one batched forward
(``longstraw.decode_step``). The prompt state is shared: its K/V pages, MLA latents and DSA
indexer keys are read in place by every sample; each sample owns only its generated tokens'
entries and its copy of the Gated DeltaNet state (``longstraw.decode_state``). A sample stops
after EOS (included in its response) or ``max_new_tokens``; finished samples are dropped from the
batch (their per-sample state with them), so late steps cost only the samples still running,
except where the steps replay CUDA graphs (``cuda_graphs``, ``longstraw/decode_graph.py``), whose
batch stays whole.

Tensor parallelism: the logits are vocabulary-sharded, so they are all-gathered over the TP group
and every TP rank samples from the same full logits; TP rank 0's tokens are then broadcast over
the group, so every rank feeds the same tokens whatever its generator. Pass the same
``generator`` seed on every TP rank to keep the generators in step (the random draws are then
identical anyway). Context parallelism: the prompt state's K/V pages (GLM-5: MLA latents and DSA
indexer keys) are sharded over the CP group (``core/collectives.py``) and every CP rank runs this
same loop on the same samples; the attention merges the ranks' page parts (GLM-5's top-k is chosen
over every rank's keys), so the logits are the same on every CP rank,
and CP rank 0's tokens are broadcast over the CP group (after the TP broadcast), so the tokens
are replicated exactly. Sequence parallelism: a step's tokens are padded to a multiple of TP
(``decode_step``). Pipeline parallelism: every stage runs this loop on the same samples, the
hidden states pass stage to stage (``decode_step``), the last stage samples, and its tokens and
log-probabilities are broadcast over the pipeline group, so every stage keeps the same samples.
"""

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from megatron.core import parallel_state, tensor_parallel

from megatron_longstraw.core.decode_state import new_decode_state
from megatron_longstraw.longstraw import decode_graph
from megatron_longstraw.longstraw.decode_step import decode_step
from megatron_longstraw.longstraw.expert_lockstep import ExpertLockstep
from megatron_longstraw.longstraw.model_steps import output_logits
from megatron_longstraw.longstraw.pipeline import check_pipeline, pipeline_parallel
from megatron_longstraw.core.state import PromptState
from megatron_longstraw.models.norms import fused_without_autograd
from megatron_longstraw.models.pipeline_stage import last_chunk
from megatron_longstraw.rollout.sampling import TokenDistribution, check_sampling


@dataclass
class RolloutProgress:
    """What a progress callback sees after each decode step."""

    step: int               # tokens sampled so far by the longest-running sample
    max_new_tokens: int
    active: int             # samples still decoding
    finished: int           # samples done (EOS or length)
    generated_tokens: int   # tokens sampled over all samples
    elapsed_s: float


@dataclass
class Rollouts:
    """The G responses of one prompt, with the model's log-probabilities of their tokens.

    ``logprobs[i][t]`` is ``log p(responses[i][t])`` under the model itself (temperature 1, no
    top-p: what replay computes for the same tokens), fp32; ``sampling_logprobs`` the same under
    the distribution it was drawn from (temperature and top-p applied; 0 when greedy).
    ``step_logits`` (only with ``keep_logits``; on the last pipeline stage) holds, per sample, the
    full-vocabulary logits each token was sampled from, ``[len, vocab]``.
    """

    responses: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    sampling_logprobs: list[torch.Tensor]
    stopped_by_eos: list[bool]
    seconds: float
    decode_steps: int                 # batched forwards through the model (with graphs, one launched
    # ahead is counted also when every sample then stopped)
    decode_state_bytes: int           # per-sample state allocated at the start (this rank)
    cuda_graphs: bool = False         # decode steps were replayed from CUDA graphs
    step_logits: Optional[list[torch.Tensor]] = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """Tokens generated over all samples."""
        return sum(r.numel() for r in self.responses)


def full_vocab_logits(model, logits_BV: torch.Tensor) -> torch.Tensor:
    """fp32 logits over the whole vocabulary: all-gathered over TP when the model keeps them sharded."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1 and logits_BV.shape[-1] < model.vocab_size:
        logits_BV = tensor_parallel.gather_from_tensor_model_parallel_region(logits_BV)
    assert logits_BV.shape[-1] >= model.vocab_size, (logits_BV.shape, model.vocab_size)
    return logits_BV[..., : model.vocab_size].float()


def _same_on_tp_ranks(tokens_B: torch.Tensor) -> torch.Tensor:
    """TP rank 0's tokens on every rank of the TP group."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(tokens_B, src=parallel_state.get_tensor_model_parallel_src_rank(),
                                    group=parallel_state.get_tensor_model_parallel_group())
    return tokens_B


def _same_on_model_parallel_ranks(tokens_B: torch.Tensor) -> torch.Tensor:
    """The tokens of (TP rank 0, CP rank 0) on every rank of its TP x CP slice."""
    tokens_B = _same_on_tp_ranks(tokens_B)
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_context_parallel_world_size() > 1:
        torch.distributed.broadcast(tokens_B, src=parallel_state.get_context_parallel_global_ranks()[0],
                                    group=parallel_state.get_context_parallel_group())
    return tokens_B


def _first_logits(model, prompt_state: PromptState) -> torch.Tensor:
    """Next-token logits ``[1, vocab / tp]`` after the prompt (kept by capture, else recomputed)."""
    if prompt_state.last_logits_BV is not None:
        return prompt_state.last_logits_BV
    if prompt_state.last_hidden_1BH is None:
        raise ValueError("the prompt state has neither last logits nor last hidden state (freed?)")
    tail = last_chunk(model)
    return output_logits(tail, tail.decoder.final_layernorm(prompt_state.last_hidden_1BH))[0]


def _check(model, prompt_state: PromptState, num_samples: int, max_new_tokens: int,
           temperature: float, top_p: float) -> None:
    check_sampling(temperature, top_p)
    if num_samples < 1:
        raise ValueError(f"--num-generations must be >= 1, got {num_samples}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-response-length must be >= 1, got {max_new_tokens}")
    if prompt_state.prompt_length + max_new_tokens > model.max_sequence_length:
        raise ValueError(
            f"--max-response-length {max_new_tokens} after a {prompt_state.prompt_length}-token prompt "
            f"exceeds the model's {model.max_sequence_length} positions")
    check_pipeline(model)


def _check_finite(logits_1V: Optional[torch.Tensor], device) -> None:
    """``FloatingPointError`` unless the last pipeline stage's first logits are finite (a NaN would
    end in a device-side assert of the first draw), raised on every stage alike."""
    finite = torch.ones((), dtype=torch.int32, device=device)
    if logits_1V is not None:
        finite.fill_(int(bool(torch.isfinite(logits_1V).all())))
    if pipeline_parallel():
        torch.distributed.broadcast(finite, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
    if not finite.item():
        raise FloatingPointError("the next-token logits after the prompt are not finite (NaN or inf): the "
                                 "capture's forward overflowed, or the model's weights are not finite")


def _to_host(tokens_B: torch.Tensor, scores_B2: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Start copying a step's tokens and scores to the host without waiting for the GPU's later
    work; the returned function waits for the copies only and gives them."""
    if not tokens_B.is_cuda:
        return lambda: (tokens_B.cpu(), scores_B2.cpu())
    tokens_host = torch.empty(tokens_B.shape, dtype=tokens_B.dtype, pin_memory=True)
    scores_host = torch.empty(scores_B2.shape, dtype=scores_B2.dtype, pin_memory=True)
    tokens_host.copy_(tokens_B, non_blocking=True)
    scores_host.copy_(scores_B2, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tokens_B.device))

    def wait():
        copied.synchronize()
        return tokens_host, scores_host
    return wait


def _samples_on_every_stage(tokens_B, scores_B2, rows: int, device):
    """The last pipeline stage's sampled tokens ``[b]`` and their log-probabilities ``[b, 2]`` on
    every stage (the other stages pass ``None`` and get them); unchanged without pipelining."""
    if not pipeline_parallel():
        return tokens_B, scores_B2
    if tokens_B is None:
        tokens_B = torch.empty(rows, dtype=torch.long, device=device)
        scores_B2 = torch.empty(rows, 2, dtype=torch.float32, device=device)
    group, src = (parallel_state.get_pipeline_model_parallel_group(),
                  parallel_state.get_pipeline_model_parallel_last_rank())
    torch.distributed.broadcast(tokens_B, src=src, group=group)
    torch.distributed.broadcast(scores_B2, src=src, group=group)
    return tokens_B, scores_B2


@torch.no_grad()
def generate_from_state(model, prompt_state: PromptState, num_samples: int, max_new_tokens: int, *,
                        temperature: float = 1.0, top_p: float = 1.0, eos_id: Optional[int] = None,
                        generator: Optional[torch.Generator] = None,
                        progress: Optional[Callable[[RolloutProgress], None]] = None,
                        keep_logits: bool = False, cuda_graphs: bool = False) -> Rollouts:
    """Decode ``num_samples`` responses of at most ``max_new_tokens`` tokens from ``prompt_state``.

    ``prompt_state`` is a batch-1 state captured by ``model`` (``capture_prompt``); it is read,
    never modified or copied per sample. Tokens are drawn from the tempered, top-p-filtered
    distribution (``sampling.TokenDistribution``; greedy at ``temperature == 0``). A sample stops
    after ``eos_id`` (kept as its last token) or at ``max_new_tokens``. ``progress``, if given, is
    called after every step. ``cuda_graphs``:
    replay the decode step from CUDA graphs where the model, its layout and its device allow
    (``longstraw/decode_graph.py``; the batch then stays whole, finished samples decoding on
    unused). Raises ``ValueError`` for bad sampling settings, a response that would exceed the
    model's positions, or a state from another model; ``FloatingPointError`` (on every pipeline
    stage) when the logits after the prompt are not finite.
    """
    _check(model, prompt_state, num_samples, max_new_tokens, temperature, top_p)
    start = time.perf_counter()
    samples_here = not pipeline_parallel() or parallel_state.is_pipeline_last_stage()  # has the logits
    state_device = next(model.parameters()).device
    first_1V = full_vocab_logits(model, _first_logits(model, prompt_state)) if samples_here else None
    _check_finite(first_1V, device=state_device)
    state = new_decode_state(model, prompt_state, num_samples, capacity=max_new_tokens - 1)
    state_bytes = state.nbytes()
    graphed = decode_graph.graphed_decoder(model, state) if cuda_graphs else None
    tokens_GT = torch.zeros(num_samples, max_new_tokens, dtype=torch.long)
    logprobs_GT = torch.zeros(num_samples, max_new_tokens, dtype=torch.float32)
    sampling_GT = torch.zeros(num_samples, max_new_tokens, dtype=torch.float32)
    lengths = [0] * num_samples
    stopped_by_eos = [False] * num_samples
    kept_logits = [[] for _ in range(num_samples)] if keep_logits and samples_here else None
    rows = list(range(num_samples))  # sample id of each row of the batch
    decoding = set(rows)  # the samples not finished (with graphs finished ones stay in the batch)
    logits_BV = first_1V.expand(num_samples, -1) if samples_here else None
    steps = 0
    lockstep = ExpertLockstep(model)  # EP over data-parallel ranks: their groups stop at different steps
    with fused_without_autograd():  # the fused RMSNorm kernels (models/norms.py)
        try:
            for step in range(max_new_tokens):
                tokens_B = scores_B2 = None
                if samples_here:
                    distribution = TokenDistribution(logits_BV, temperature, top_p)
                    tokens_B = _same_on_model_parallel_ranks(distribution.draw(generator))
                    scores_B2 = torch.stack(distribution.scores(tokens_B), -1)
                tokens_B, scores_B2 = _samples_on_every_stage(tokens_B, scores_B2, len(rows), device=state_device)
                on_host = _to_host(tokens_B, scores_B2)
                ahead_BV = None
                if graphed is not None and step + 1 < max_new_tokens:
                    # the next step runs on the GPU while the host reads this one's tokens (the batch
                    # stays whole, so it needs nothing the host decides); wasted if every sample stops
                    ahead_BV = graphed.step(tokens_B[:, None])
                    steps += 1
                tokens_cpu, scores_cpu = on_host()
                logprobs_B, sampling_B = scores_cpu.unbind(-1)
                keep = []
                for row, sample in enumerate(rows):
                    if sample not in decoding:
                        continue
                    tokens_GT[sample, step] = tokens_cpu[row]
                    logprobs_GT[sample, step] = logprobs_B[row]
                    sampling_GT[sample, step] = sampling_B[row]
                    lengths[sample] = step + 1
                    if kept_logits is not None:
                        kept_logits[sample].append(logits_BV[row].cpu())
                    if eos_id is not None and tokens_cpu[row].item() == eos_id:
                        stopped_by_eos[sample] = True
                    elif step + 1 < max_new_tokens:
                        keep.append(row)
                if progress is not None:
                    finished = num_samples - len(keep)
                    progress(RolloutProgress(step + 1, max_new_tokens, len(keep), finished, sum(lengths),
                                             time.perf_counter() - start))
                if not keep:
                    break
                decoding = {rows[row] for row in keep}
                if len(keep) < len(rows) and graphed is None:
                    index_B = torch.tensor(keep, dtype=torch.long, device=tokens_B.device)
                    state.select_samples(index_B)
                    tokens_B = tokens_B.index_select(0, index_B)
                    rows = [rows[row] for row in keep]
                if graphed is not None:  # (no expert lockstep: graphs refuse MoE)
                    logits_BV = full_vocab_logits(model, ahead_BV)
                    continue
                lockstep.busy()
                logits_BV = decode_step(model, state, tokens_B[:, None])
                logits_BV = None if logits_BV is None else full_vocab_logits(model, logits_BV)
                steps += 1
            lockstep.finish()
        finally:
            state.free()
    return Rollouts(
        responses=[tokens_GT[i, : lengths[i]].clone() for i in range(num_samples)],
        logprobs=[logprobs_GT[i, : lengths[i]].clone() for i in range(num_samples)],
        sampling_logprobs=[sampling_GT[i, : lengths[i]].clone() for i in range(num_samples)],
        stopped_by_eos=stopped_by_eos,
        seconds=time.perf_counter() - start,
        decode_steps=steps,
        decode_state_bytes=state_bytes,
        cuda_graphs=graphed is not None and graphed.replays > 0,
        step_logits=[torch.stack(x) for x in kept_logits] if kept_logits is not None else None,
    )
