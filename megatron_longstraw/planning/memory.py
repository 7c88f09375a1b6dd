"""Per-GPU memory of one layout: the peak broken into its parts (pure functions of a profile).

The floor is what must be resident at the step's busiest moment: weights, gradients, optimizer
states, the prompt state (and, in exact mode, its gradient buffers and the recurrent layers'
chunk-start states), and the larger of the spans that do not overlap: one capture chunk's
transients, the replayed micro-batches in flight, one swept chunk's recompute. The predicted
peak adds ``ALLOWANCE`` of the floor for the allocator's rounding, the kernels' workspaces and
communication buffers: over every run of ``docs/bench/`` the measured peak is 1.03-1.11 x the
floor (``docs/planning.md``). Under TP the per-head and per-FFN activations divide by TP, the
hidden-sized ones too with sequence parallelism only (TP is not measured here yet).
"""

from dataclasses import asdict, dataclass

from megatron_longstraw.models.profile import LayerProfile, ModelProfile
from megatron_longstraw.planning.layouts import Layout
from megatron_longstraw.planning.run import PRECISIONS, RunShape

GiB = 2 ** 30
ALLOWANCE = 0.06
"""Fraction of the floor added for allocator, workspaces and communication buffers."""
PEAK_ERROR = 0.05
"""The planner's stated error on a GPU's peak: every measured run of ``docs/bench/`` lands within
it (``tests/test_planning.py``)."""
CAPTURE_TRANSIENT_BYTES_PER_HIDDEN = 16
"""A capture chunk's no-grad transients per chunk token and hidden unit (a layer's input,
its norm, the MLP's gate and up projections alive together): an estimate, small beside replay."""


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's predicted memory (GiB), the busiest pipeline stage's."""

    stage: int
    """The pipeline stage these figures are of (the busiest)."""
    weights: float
    """Parameters (and a frozen reference copy with ``--kl-coef`` > 0)."""
    gradients: float
    """Gradient buffers."""
    optimizer: float
    """Main weights and Adam moments (this GPU's shard with the distributed optimizer)."""
    prompt_state: float
    """The captured state (with the recurrent layers' chunk-start states in exact mode)."""
    state_gradients: float
    """Exact mode: the state's fp32 gradient buffers."""
    capture_transients: float
    """One capture chunk's no-grad transients (an estimate)."""
    replay_activations: float
    """The replayed micro-batches in flight on this stage."""
    sweep_activations: float
    """Exact mode: one swept chunk's recompute."""
    floor: float
    """Everything above, the three spans counted by their largest."""
    allowance: float
    """``ALLOWANCE`` of the floor."""
    peak: float
    """The predicted peak: floor + allowance."""

    def as_dict(self) -> dict:
        return asdict(self)


def stage_layers(profile: ModelProfile, layout: Layout, stage: int) -> list[LayerProfile]:
    """The layers pipeline stage ``stage`` holds (its ``vpp`` model chunks, as Megatron splits
    them: chunk ``v`` of stage ``s`` is the ``v * pp + s``-th of ``pp * vpp`` equal slices)."""
    per_chunk = len(profile.layers) // (layout.pp * layout.vpp)
    out = []
    for v in range(layout.vpp):
        first = (v * layout.pp + stage) * per_chunk
        out.extend(profile.layers[first:first + per_chunk])
    return out


def stage_params(profile: ModelProfile, layout: Layout, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of ``stage`` holds."""
    dense = experts = 0.0
    for layer in stage_layers(profile, layout, stage):
        sharded = layer.params - layer.expert_params - layer.replicated_params
        dense += sharded / layout.tp + layer.replicated_params
        experts += layer.expert_params / (layout.ep * layout.tp)
    if stage == 0:
        dense += profile.embedding_params / layout.tp
    if stage == layout.pp - 1:
        dense += profile.final_norm_params
        # an untied output layer, or under PP the last stage's copy of the tied embedding
        output = profile.output_params or (profile.embedding_params if layout.pp > 1 else 0)
        dense += output / layout.tp
    return dense, experts


def _state_bytes(profile: ModelProfile, layers, layout: Layout, run: RunShape, last: bool) -> tuple[float, float]:
    """(prompt state, state-gradient buffers) bytes on one GPU holding ``layers`` (``last``: the
    last stage, which keeps the last prompt position's hidden state too)."""
    state = profile.last_hidden_state_bytes if last else 0.0
    grads = 4.0 * profile.last_hidden_grad_elements if last and run.exact else 0.0
    tokens = run.prompt_length / layout.cp
    for layer in layers:
        heads = layout.tp if layer.tp_sharded_state else 1
        state += layer.state_bytes_per_token * tokens / heads + layer.state_bytes_fixed / layout.tp
        if run.exact:
            state += layer.state_bytes_fixed / layout.tp * run.num_chunks  # chunk-start states
            grads += 4 * (layer.grad_state_elements_per_token * tokens / heads
                          + layer.grad_state_elements_fixed / layout.tp)
    return state, grads


def in_flight_micro_batches(layout: Layout, run: RunShape, stage: int) -> float:
    """Replay micro-batches whose activations one stage holds at once: Megatron's 1F1B warm-up
    keeps ``pp - stage`` (interleaved: more, as its schedule says) of the group's micro-batches."""
    micro_batches = -(-run.num_generations // run.micro_batch_size)
    if layout.pp == 1:
        return 1
    if layout.vpp > 1:
        warmup = (layout.pp - stage - 1) * 2 + (layout.vpp - 1) * layout.pp + 1
        return min(micro_batches * layout.vpp, warmup) / layout.vpp  # per model chunk, in chunks' units
    return min(micro_batches, layout.pp - stage)


def stage_memory(profile: ModelProfile, layout: Layout, run: RunShape, stage: int) -> MemoryPlan:
    """One GPU of pipeline ``stage``: the predicted memory by part."""
    weight_bytes, grad_bytes, optimizer_bytes = PRECISIONS[run.precision]
    dense, experts = stage_params(profile, layout, stage)
    shards_dense = layout.dp * layout.cp if run.distributed_optimizer else 1
    shards_experts = max(layout.dp * layout.cp // layout.ep, 1) if run.distributed_optimizer else 1
    weights = (dense + experts) * weight_bytes * (2 if run.reference_model else 1)  # + the frozen reference
    gradients = (dense + experts) * grad_bytes
    optimizer = dense * optimizer_bytes / shards_dense + experts * optimizer_bytes / shards_experts
    layers = stage_layers(profile, layout, stage)
    last = stage == layout.pp - 1
    state, state_grads = _state_bytes(profile, layers, layout, run, last)
    chunk_tokens = min(run.chunk_size, run.prompt_length) / layout.cp
    capture = chunk_tokens * max([profile.hidden_size * CAPTURE_TRANSIENT_BYTES_PER_HIDDEN]
                                 + [layer.capture_transient_bytes_per_token for layer in layers])
    cp_extra = layout.cp > 1
    sp = run.sequence_parallel or layout.tp == 1

    def on_this_rank(total: float, hidden: float) -> float:  # per-head/FFN bytes divide over TP
        return total / layout.tp if sp else (total - hidden) / layout.tp + hidden

    per_layer = [on_this_rank(layer.replay_activation_bytes_per_token, layer.replay_hidden_bytes_per_token)
                 + (layer.replay_cp_extra_bytes_per_token / layout.tp if cp_extra else 0.0) for layer in layers]
    if run.recompute:  # each layer's bf16 input kept, one layer's activations alive in its backward
        per_layer = [2.0 * profile.hidden_size / (layout.tp if sp else 1)] * len(layers) + [max(per_layer, default=0.0)]
    logits = on_this_rank(profile.logits_bytes_per_token, profile.logits_bytes_per_token) if last else 0.0
    per_response_token = sum(per_layer) + logits
    replay = (per_response_token * run.response_length * run.micro_batch_size
              * in_flight_micro_batches(layout, run, stage))
    sweep_per_token = (sum(on_this_rank(layer.sweep_activation_bytes_per_token, layer.replay_hidden_bytes_per_token)
                           for layer in layers)
                       + (on_this_rank(profile.sweep_final_norm_bytes_per_token, profile.sweep_final_norm_bytes_per_token)
                          if last else 0.0))
    sweep = sweep_per_token * chunk_tokens if run.exact else 0.0
    floor = weights + gradients + optimizer + state + state_grads + max(capture, replay, sweep)
    allowance = ALLOWANCE * floor
    parts = [x / GiB for x in (weights, gradients, optimizer, state, state_grads, capture, replay, sweep,
                               floor, allowance, floor + allowance)]
    return MemoryPlan(stage, *parts)


def memory_plan(profile: ModelProfile, layout: Layout, run: RunShape) -> MemoryPlan:
    """The busiest pipeline stage's memory."""
    return max((stage_memory(profile, layout, run, s) for s in range(layout.pp)), key=lambda m: m.peak)
