"""The decode step replayed from a CUDA graph.

A decode step of a small model against a long prompt is about a thousand small kernels besides
the read of the pages; launched one by one from Python they take many times the GPU's work
(``docs/decode.md``). Captured once in a CUDA graph and replayed, they run back to back.

A graph replays fixed shapes and fixed addresses, so the step runs in fixed shapes
(``core/binding.py``'s ``StaticDecode``): the tokens enter through a buffer, RoPE's table for the
step's position through another (computed outside the graph, where the position is a Python
number), the count of tokens fed so far is a device tensor the step advances itself, and each
attention layer reads its samples' own-key buffers over a fixed number of rows with the rows past
the count masked. That number grows by doubling (at least ``MIN_OWN_ROWS``, at most the
state's capacity), and each time it grows the step is captured again: the first step at a new
size runs eagerly on the capture stream (the kernels' first-call work, autotuning and plans,
happens there; it is a real step) and the graph is captured right after it, for the steps
that follow. The batch stays whole: samples that finished keep decoding, their tokens unused.

Graphs need CUDA, one rank per model replica (no TP, CP, PP or EP), no MoE layers (their
routing sizes its work on the host), no FP8, no learned position embedding, and every stateful
layer's ``supports_static_decode``; ``refusal`` says what is missing. Activation recomputation
is off inside the step (it would save the RNG state, which a capture cannot; under no_grad it
recomputes nothing). Each capture synchronizes the GPU and empties the allocator's cache
(``torch.cuda.graph``), a handful of times per call of ``generate_from_state``; rollouts of fewer
than ``MIN_GRAPHED_STEPS`` steps decode eagerly. Without ``use_graphs`` the same fixed-shape step
runs eagerly (what the CPU tests compare against the ordinary decode step).
"""

from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_longstraw.core.binding import DecodeBinding, StaticDecode, bind, stateful_modules
from megatron_longstraw.core.decode_state import DecodeState
from megatron_longstraw.longstraw.model_steps import embed, output_logits, without_activation_recompute

MIN_OWN_ROWS = 64
"""Fewest own-key rows a captured step reads (the first sizes are not worth a capture each)."""

MIN_GRAPHED_STEPS = 4
"""Fewest decode steps (the state's capacity) worth a capture: the first step at each size runs
eagerly and the capture costs about one more, so a rollout of one or two steps gains nothing."""


def refusal(model) -> Optional[str]:
    """Why ``model`` cannot decode in fixed shapes here, or ``None`` if it can."""
    if parallel_state.model_parallel_is_initialized():
        sizes = {"tensor": parallel_state.get_tensor_model_parallel_world_size(),
                 "context": parallel_state.get_context_parallel_world_size(),
                 "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
                 "expert": parallel_state.get_expert_model_parallel_world_size()}
        split = [name for name, size in sizes.items() if size > 1]
        if split:
            return f"{'/'.join(split)} parallelism"
    if getattr(model.config, "num_moe_experts", None):
        return "MoE layers"
    if getattr(model.config, "fp8", None) or getattr(model.config, "fp4", None):
        return "FP8/FP4 (Transformer Engine's scaling bookkeeping runs on the host)"
    if getattr(model.embedding, "add_position_embedding", False):
        return "a learned position embedding"
    layers = [type(m).__name__ for m in stateful_modules(model).values() if not m.supports_static_decode]
    if layers:
        return f"{layers[0]} layers"
    return None


def _rows_for(needed: int, capacity: int) -> int:
    """Own-key rows of the step that needs ``needed``: the next power of two, within bounds."""
    rows = MIN_OWN_ROWS
    while rows < needed:
        rows *= 2
    return min(rows, capacity)


class GraphedDecoder:
    """Decode steps of ``state``'s samples in fixed shapes, replayed from CUDA graphs (``use_graphs``).

    ``step`` is ``longstraw/decode_step.py``'s ``decode_step`` for one token per sample, with
    the batch kept whole (``state.select_samples`` is not used with it). ``refusal(model)`` must
    be ``None``.
    """

    def __init__(self, model, state: DecodeState, use_graphs: bool):
        assert refusal(model) is None, refusal(model)
        assert state.length == 0, "a fixed-shape decoder starts from a fresh decode state"
        self.model, self.state, self.use_graphs = model, state, use_graphs
        device = next(model.parameters()).device
        assert not use_graphs or device.type == "cuda", device
        self.length_t = torch.full((1,), state.length, dtype=torch.long, device=device)
        self.ids_B1 = torch.zeros(state.num_samples, 1, dtype=torch.long, device=device)
        self.rotary = None          # RoPE's table of the step's position (static buffer)
        self.rows = 0               # own-key rows of the captured step
        self.graph = None
        self.logits_BV = None       # the captured step's output
        self.replays = 0            # steps replayed from a graph (not the eager ones before captures)
        self.stream = torch.cuda.Stream(device) if use_graphs else None

    def _forward(self) -> torch.Tensor:
        """The step in fixed shapes: what is captured (and run once before each capture)."""
        model = self.model
        static = StaticDecode(self.length_t, self.rows)
        # activation recomputation would save and restore the RNG state (not capturable); under
        # no_grad it recomputes nothing anyway
        with without_activation_recompute(model), \
                bind(model, DecodeBinding(valid_length=1, static_decode=static), self.state):
            hidden_SBH = embed(model, self.ids_B1, 0)  # position ids unused: no learned positions
            hidden_SBH = model.decoder(hidden_states=hidden_SBH, attention_mask=None, rotary_pos_emb=self.rotary)
            logits_BV = output_logits(model, hidden_SBH[-1:])[0]
        self.length_t.add_(1)
        return logits_BV

    def _set_rotary(self) -> None:
        if getattr(self.model, "rotary_pos_emb", None) is None:
            return
        table = self.model.rotary_pos_emb(1, offset=self.state.position)
        if self.rotary is None:
            self.rotary = torch.empty_like(table)
        self.rotary.copy_(table)

    def _capture(self) -> torch.Tensor:
        """This step run eagerly on the capture stream, then captured for the next ones."""
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            logits_BV = self._forward()
        main.wait_stream(self.stream)
        out_BV = logits_BV.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self.logits_BV = self._forward()  # recorded, not run: the state is not touched
        self.graph = graph
        return out_BV

    @torch.no_grad()
    def step(self, ids_B1: torch.Tensor) -> torch.Tensor:
        """Feed one token per sample (``[samples, 1]``); the logits ``[samples, vocab]`` after it."""
        state = self.state
        assert ids_B1.shape == self.ids_B1.shape, (ids_B1.shape, self.ids_B1.shape)
        state.check_room(1)
        self.ids_B1.copy_(ids_B1)
        self._set_rotary()
        needed = state.length + 1
        if needed > self.rows:  # a larger step: the smaller one's graph and memory go first
            self.rows = _rows_for(needed, state.capacity)
            self.graph = self.logits_BV = None
        if not self.use_graphs:
            logits_BV = self._forward()
        elif self.graph is None:
            logits_BV = self._capture()
        else:
            self.graph.replay()
            self.replays += 1
            logits_BV = self.logits_BV.clone()  # the next replay writes over the graph's output
        state.advance(1)
        return logits_BV


def graphed_decoder(model, state: DecodeState) -> Optional[GraphedDecoder]:
    """A ``GraphedDecoder`` replaying CUDA graphs for ``state``, or ``None`` where the model is not
    on a GPU, the rollout is shorter than ``MIN_GRAPHED_STEPS`` steps, or ``refusal`` names what
    the graphs cannot take (decoding then runs eagerly)."""
    if next(model.parameters()).device.type != "cuda" or state.capacity < MIN_GRAPHED_STEPS:
        return None
    if refusal(model) is not None:
        return None
    return GraphedDecoder(model, state, use_graphs=True)
