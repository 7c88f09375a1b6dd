"""Per-step times of one layout (pure functions of a profile and ``kernels.py``'s rates).

Each phase is a sum of kernel terms, FLOPs (or work) over the rate ``kernels.py`` measured on an
H200, scaled to the planned GPU by its bf16 peak (bandwidth-bound terms by its memory
bandwidth). Tensor, context and pipeline parallelism divide the terms of capture and replay
(which pipeline their chunks' slices or micro-batches); the exact sweep's stages run one after
another, and a family whose CP ranks each replay the whole response (``replay_splits_over_cp``)
gains nothing from CP in replay. ``kernels.PARALLEL_EFFICIENCY`` and
``PIPELINE_REPLAY_EFFICIENCY`` charge the collectives and pipeline bubbles.
"""

from dataclasses import asdict, dataclass, replace

from megatron_longstraw.models.profile import ModelProfile
from megatron_longstraw.planning import kernels as K
from megatron_longstraw.planning.hardware import REFERENCE_GPU, GpuSpec
from megatron_longstraw.planning.layouts import Layout
from megatron_longstraw.planning.memory import stage_params
from megatron_longstraw.planning.run import PRECISIONS, RunShape

TIME_ERROR = 0.15
"""The planner's stated error on capture, replay and prompt-backward times: every measured run of
``docs/bench/`` lands within it (``tests/test_planning.py``)."""


@dataclass(frozen=True)
class TimePlan:
    """Predicted seconds per step (one prompt group per DP rank per ``prompts_per_rank``)."""

    capture: float
    """The chunked no-grad pass over one prompt."""
    decode: float
    """Sampling the G responses from the state (internal rollouts)."""
    replay: float
    """Every response's forward and backward (the group)."""
    prompt_backward: float
    """Exact mode: the reverse sweep over the prompt."""
    optimizer: float
    """The optimizer step."""
    prompts_per_rank: int
    """Prompt groups each DP rank runs per step."""
    step: float
    """``prompts_per_rank`` x (capture + decode + replay + prompt backward) + optimizer."""

    def as_dict(self) -> dict:
        return asdict(self)


def _pairs(offset: float, length: float) -> float:
    """Visible query-key pairs of ``length`` causal queries after ``offset`` keys."""
    return length * (offset + length / 2)


@dataclass
class KernelWork:
    """Kernel work of a span, whole model (one GPU's share: divide by the layout)."""

    linear: float = 0.0        # GEMM FLOPs
    attention: float = 0.0     # dense attention FLOPs
    sparse: float = 0.0        # sparse MLA FLOPs
    indexer: float = 0.0       # DSA indexer FLOPs (scores and top-k)
    delta_rule: float = 0.0    # Gated DeltaNet token-heads
    tokens: float = 0.0        # token-layers (elementwise, norms, routing)

    def seconds(self, gpu: GpuSpec, layout: Layout, *, backward: bool = False,
                attention_bwd_tflops: float = K.ATTENTION_BWD_TFLOPS, pipeline_efficiency: float = 1.0) -> float:
        """Forward (or forward + backward) time on one GPU at the planned GPU's rates: the
        prompt-length terms (attention, sparse MLA, indexer) divide over TP x CP x PP, the
        per-token terms too."""
        scale = REFERENCE_GPU.bf16_tflops / gpu.bf16_tflops
        keys = (self.attention / K.ATTENTION_FWD_TFLOPS + self.sparse / K.SPARSE_MLA_TFLOPS
                + self.indexer / K.INDEXER_TFLOPS) / 1e12
        tokens = self.linear / K.LINEAR_TFLOPS / 1e12 + self.delta_rule * K.DELTA_RULE_FWD_S + self.tokens * K.TOKEN_LAYER_S
        if backward:
            keys += K.ATTENTION_BWD_FLOPS_RATIO * (self.attention / attention_bwd_tflops
                                                   + self.sparse / K.SPARSE_MLA_BWD_TFLOPS) / 1e12
            tokens += (2 * self.linear / K.LINEAR_TFLOPS / 1e12
                       + self.delta_rule * K.DELTA_RULE_BWD_RATIO * K.DELTA_RULE_FWD_S + 2 * self.tokens * K.TOKEN_LAYER_S)
        split = layout.tp * layout.pp
        seconds = (keys + tokens) / (split * layout.cp)
        efficiency = (K.PARALLEL_EFFICIENCY if layout.tp * layout.cp > 1 else 1.0) * (
            pipeline_efficiency if layout.pp > 1 else 1.0)
        return seconds * scale / efficiency


def span_work(profile: ModelProfile, offset: float, length: float, *, logits: bool, indexer: bool = True) -> KernelWork:
    """The work of ``length`` tokens after ``offset`` earlier positions through every layer."""
    w = KernelWork()
    for layer in profile.layers:
        w.linear += 2.0 * layer.active_linear_params * length
        if layer.sparse_topk:
            w.sparse += layer.attention_pair_flops * length * min(layer.sparse_topk, offset + length / 2)
            if indexer:
                w.indexer += layer.indexer_pair_flops * _pairs(offset, length)
        else:
            w.attention += layer.attention_pair_flops * _pairs(offset, length)
        w.delta_rule += layer.delta_rule_heads * length
        w.tokens += length
    if logits:
        w.linear += 2.0 * profile.hidden_size * profile.vocab_size * length
    return w


def _sparse_keys(run: RunShape, topk: int) -> float:
    """Query-key pairs of DSA's sparse attention over the chunked prompt: a query attends to
    ``min(topk, keys before it)`` (its chunk's keys counted at half, as for dense attention)."""
    total, offset = 0.0, 0
    while offset < run.prompt_length:
        length = min(run.chunk_size, run.prompt_length - offset)
        if offset + length / 2 >= topk:  # every later chunk attends to the full top-k
            return total + (run.prompt_length - offset) * topk
        total += length * (offset + length / 2)
        offset += length
    return total


def prompt_work(profile: ModelProfile, run: RunShape, *, indexer: bool = True) -> KernelWork:
    """The work of the whole chunked prompt: the chunks' causal pairs sum to the prompt's
    (``prompt_length ** 2 / 2``) for any chunking; sparse attention is summed per chunk."""
    w = span_work(profile, 0.0, run.prompt_length, logits=False, indexer=indexer)
    w.sparse = sum(layer.attention_pair_flops * _sparse_keys(run, layer.sparse_topk)
                   for layer in profile.layers if layer.sparse_topk)
    return w


def capture_seconds(profile: ModelProfile, layout: Layout, run: RunShape, gpu: GpuSpec) -> float:
    """The no-grad chunked pass over the prompt."""
    return prompt_work(profile, run).seconds(gpu, layout) + run.num_chunks * K.CHUNK_OVERHEAD_S


def replay_seconds(profile: ModelProfile, layout: Layout, run: RunShape, gpu: GpuSpec) -> float:
    """Every response's forward and backward against the state (the whole group). Under PP the
    micro-batches go through Megatron's schedule: ``pp - 1`` micro-batch times of warm-up and
    drain beside the group's. Each micro-batch also costs ``kernels.REPLAY_OVERHEAD_S`` (host
    work: launches, the autograd graph), not scaled by the GPU."""
    micro_batches = -(-run.num_generations // run.micro_batch_size)
    # a family whose CP ranks each replay the whole response gains nothing from CP here
    replay_layout = layout if profile.replay_splits_over_cp else replace(layout, cp=1)
    work = span_work(profile, run.prompt_length, run.response_length * run.micro_batch_size, logits=True)
    one = work.seconds(gpu, replay_layout, backward=True, pipeline_efficiency=K.PIPELINE_REPLAY_EFFICIENCY)
    if run.recompute:  # every layer's forward once more in backward
        one += work.seconds(gpu, replay_layout, pipeline_efficiency=K.PIPELINE_REPLAY_EFFICIENCY)
    return (one + K.REPLAY_OVERHEAD_S) * (micro_batches + layout.pp - 1)


def sweep_seconds(profile: ModelProfile, layout: Layout, run: RunShape, gpu: GpuSpec) -> float:
    """The exact mode's reverse sweep: each chunk recomputed with autograd and backpropagated
    (the DSA indexer's top-k recomputed without grad, forward only)."""
    if not run.exact:
        return 0.0
    # under PP one micro-batch per chunk goes stage to stage: the stages do not overlap
    serial = replace(layout, pp=1)
    with_grad = prompt_work(profile, run)
    indexer = KernelWork(indexer=with_grad.indexer)  # forward only: top-k takes no gradient
    with_grad.indexer = 0.0
    return (with_grad.seconds(gpu, serial, backward=True, attention_bwd_tflops=K.SWEEP_ATTENTION_BWD_TFLOPS)
            + indexer.seconds(gpu, serial) + run.num_chunks * K.SWEEP_CHUNK_OVERHEAD_S)


def decode_seconds(profile: ModelProfile, layout: Layout, run: RunShape, gpu: GpuSpec, state_bytes: float) -> float:
    """Decoding the G samples in lock step: each step reads this GPU's weights and its prompt
    state once for all samples (bandwidth-bound; ``state_bytes`` may include exact mode's
    chunk-start copies, which decoding does not read: an upper bound there)."""
    if run.rollout != "internal":
        return 0.0
    weight_bytes = PRECISIONS[run.precision][0]
    dense, experts = stage_params(profile, layout, 0)
    per_step = (dense + experts) * weight_bytes * layout.pp + state_bytes * layout.pp
    return run.response_length * (per_step / (gpu.hbm_tbps * 1e12 * K.DECODE_BANDWIDTH_FRACTION) + K.DECODE_STEP_S)


def optimizer_seconds(profile: ModelProfile, layout: Layout, run: RunShape, gpu: GpuSpec) -> float:
    """Adam over this GPU's shard: every weight, gradient and moment read and written."""
    dense, experts = stage_params(profile, layout, 0)
    per_param = sum(PRECISIONS[run.precision])
    shards = layout.dp * layout.cp if run.distributed_optimizer else 1
    return 2 * (dense + experts) * per_param / shards / (gpu.hbm_tbps * 1e12 * K.OPTIMIZER_BANDWIDTH_FRACTION)


def time_plan(profile: ModelProfile, layout: Layout, run: RunShape, gpu: GpuSpec, state_gib: float) -> TimePlan:
    """Every phase of one step."""
    prompts = -(-run.global_batch_size // layout.dp)
    capture = capture_seconds(profile, layout, run, gpu)
    decode = decode_seconds(profile, layout, run, gpu, state_gib * 2 ** 30)
    replay = replay_seconds(profile, layout, run, gpu)
    sweep = sweep_seconds(profile, layout, run, gpu)
    optimizer = optimizer_seconds(profile, layout, run, gpu)
    step = prompts * (capture + decode + replay + sweep) + optimizer
    return TimePlan(capture, decode, replay, sweep, optimizer, prompts, step)
