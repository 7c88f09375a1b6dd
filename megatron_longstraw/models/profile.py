"""What the budget planner needs to know of a model, from its config alone (no weights built).

A family's ``plan_profile(hf)`` describes the whole model (no parallelism) layer by layer: its
parameters, the prompt state each layer keeps, the FLOPs of its mixer, and the bytes autograd
keeps per token when a response is replayed or a prompt chunk recomputed. The planner
(``planning/``) divides these by the layout; the benchmark records the planner's prediction beside
each measured point. Pure data and arithmetic: no torch, no Megatron.

Activation bytes are what autograd saves for backward with the benchmark's settings (bf16, the
local spec, cuDNN SDPA for full attention, fla for Gated DeltaNet, Megatron's ``torch.compile``d
helpers compiled, no activation recomputation), counted as ``SavedTensorMeter`` counts them: every
distinct storage once, whole (a saved view keeps its whole base), parameters and prompt state
excluded. The families derive theirs from the layer code; ``tests/test_plan_profile.py`` checks
them against the H200 measurements of ``docs/bench/``. The blocks every family shares are below.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerProfile:
    """One decoder layer, whole (every TP, CP and EP share together)."""

    mixer: str
    """``"attention"`` (full causal attention), ``"gated_delta_net"`` or ``"mla_dsa"`` (MLA whose
    queries attend to DSA's top-k keys)."""
    moe: bool
    """The MLP is a routed mixture of experts."""
    params: int
    """Every parameter of the layer (norms, router and all experts included)."""
    expert_params: int
    """Of ``params``, the routed experts' (sharded over expert parallelism)."""
    replicated_params: int
    """Of ``params``, those every TP rank holds whole (norms, router, small vectors)."""
    active_linear_params: int
    """Linear weight elements one token passes through (routed experts: the top-k of them)."""
    state_bytes_per_token: float
    """Prompt state kept per prompt token (bf16 model): post-RoPE K/V pages; MLA latent and
    rotary key; DSA indexer keys. Divides over CP (tokens) and, for per-head state, TP."""
    state_bytes_fixed: int
    """Prompt state independent of its length: Gated DeltaNet's fp32 recurrent state and conv
    tail. Exact mode keeps it once more at every chunk start."""
    grad_state_elements_per_token: float
    """Elements per prompt token whose gradient exact mode accumulates (fp32 buffers): K/V; MLA
    latent and rotary key (not the indexer keys: top-k is not differentiable)."""
    grad_state_elements_fixed: int
    """Elements of the fixed state with gradient buffers (recurrent state, conv tail)."""
    tp_sharded_state: bool
    """The per-token state is per head, so TP divides it (MLA's shared latent is replicated)."""
    attention_pair_flops: float
    """Attention FLOPs per visible query-key pair (``2 * heads * (d_qk + d_v)``; 0 without)."""
    sparse_topk: int
    """DSA: keys each query attends to (0: dense)."""
    indexer_pair_flops: float
    """DSA indexer FLOPs per query-key pair scored (``2 * index_heads * index_dim``; 0 without)."""
    delta_rule_flops_per_token: float
    """Gated DeltaNet's chunked delta rule FLOPs per token (0 without)."""
    delta_rule_heads: int
    """Gated DeltaNet value heads (the kernel's parallel units; 0 without)."""
    replay_activation_bytes_per_token: float
    """Bytes autograd keeps for this layer per replayed response token (bf16, fused kernels,
    no activation recomputation); divides over TP where per head or per FFN column."""
    sweep_activation_bytes_per_token: float
    """The same for a prompt chunk recomputed by the exact mode's reverse sweep."""
    replay_hidden_bytes_per_token: float = 0.0
    """Of the replay's (and the sweep's) bytes per token, those of hidden-sized tensors (the
    layer's and its MLP's norm inputs and outputs): whole on every TP rank without sequence
    parallelism; the rest is per head or per FFN column and divides over TP."""
    replay_cp_extra_bytes_per_token: float = 0.0
    """Added to the replay's bytes per token under context parallelism (CP > 1: every CP rank
    replays the whole response): what the layer keeps to merge its attention over the CP group
    (0 where the merge keeps nothing more). The sweep under CP is not modeled."""
    capture_transient_bytes_per_token: float = 0.0
    """A capture chunk's no-grad working set per chunk token where it exceeds the planner's
    default (``planning/memory.py``'s ``CAPTURE_TRANSIENT_BYTES_PER_HIDDEN``): a MoE layer's
    dispatched copies (``moe_capture_transient_bytes``)."""


@dataclass(frozen=True)
class ModelProfile:
    """A whole model for the planner (``plan_profile`` of its family)."""

    name: str
    """The config's name (a preset name or the folder's ``model_type``)."""
    hidden_size: int
    """The model's width."""
    vocab_size: int
    """Its vocabulary (the output layer's rows)."""
    embedding_params: int
    """Input embedding (vocab x hidden)."""
    output_params: int
    """Output layer (0 when tied to the embedding)."""
    final_norm_params: int
    """The final norm's weights."""
    layers: tuple[LayerProfile, ...]
    """Every decoder layer, in order."""
    logits_bytes_per_token: float
    """Bytes autograd keeps per replayed token after the last layer (last stage): the final norm,
    the output layer's input and the per-token log-prob (``replay_output_bytes``). Nothing
    vocabulary-sized: ``response_logprobs`` recomputes each 512-token chunk's logits in backward
    (its transient, one chunk's logits, fp32 copy and gradient, is not kept and not counted)."""
    num_experts: int
    """Routed experts per MoE layer (0: dense); expert parallelism must divide it."""
    tp_divisors: tuple[int, ...]
    """Head and FFN counts TP must divide (the family's own layout check decides the rest)."""
    sweep_final_norm_bytes_per_token: float = 0.0
    """Bytes autograd keeps per swept chunk token after the last layer (last stage): the
    recomputed chunk runs the whole decoder, its final norm included (no logits)."""
    last_hidden_state_bytes: int = 0
    """Prompt state outside the layers (last stage): the last prompt position's final-norm input
    that ``PromptState.nbytes`` counts (``hidden_size`` elements, bf16)."""
    tp_needs_sequence_parallel: bool = False
    """TP > 1 requires ``--sequence-parallel`` (GLM-5's MoE layers), so TP cannot join CP."""
    replay_splits_over_cp: bool = True
    """Under CP the ranks share a response's per-token work (measured: Qwen3.5 replays 1.8x
    faster at CP=2); ``False`` where every CP rank runs all of it (GLM-5: no faster at CP=2)."""
    last_hidden_grad_elements: int = 0
    """Exact mode: elements of that hidden state's fp32 gradient buffer (``state_grad_nbytes``)."""

    @property
    def params(self) -> int:
        """Every parameter of the model."""
        return (self.embedding_params + self.output_params + self.final_norm_params
                + sum(layer.params for layer in self.layers))


def profile_name(hf: dict) -> str:
    """``ModelProfile.name`` of a config: the preset's name, else its ``model_type``."""
    source = hf.get("_source", "")
    return source[len("preset "):] if source.startswith("preset ") else hf["model_type"]


# ----------------------------------------------------------------------------- shared blocks
# Bytes saved per token (bf16 activations). Basis: the saved tensors of one replayed micro-batch
# listed with their shapes (the meter's storages by module, CPU), the parts the GPU runs
# differently read from the kernels' code; their sum per family reproduces the H200 figures of
# docs/bench/ (tests/test_plan_profile.py).

def rms_norm_saved_bytes(width: int) -> int:
    """The project's RMSNorm (``models/norms.py``, eager fp32 math) per normalized row of
    ``width``: the fp32 copy of its input (``pow`` and the multiply by the reciprocal RMS), the
    fp32 normalized row (the multiply by gamma) and the fp32 reciprocal RMS."""
    return 8 * width + 4


def swiglu_mlp_saved_bytes(hidden: int, ffn: int) -> int:
    """Megatron's local ``MLP`` with SwiGLU unfused (``bias_activation_fusion=False``): the fc1
    input, the fc1 output ``[gate; up]`` (kept by ``silu`` through its gate view), the ``silu``
    output, ``up + glu_linear_offset`` (a new tensor) and the fc2 input."""
    return 2 * hidden + 2 * (2 * ffn) + 2 * ffn + 2 * ffn + 2 * ffn


def routed_experts_saved_bytes(hidden: int, experts: int, topk: int, ffn: int) -> int:
    """A ``MoELayer``'s router and routed experts per token (fp32 router, allgather dispatcher,
    ``SequentialMLP`` experts with the probabilities applied in them); measured for GLM-5's
    sigmoid router (``models/glm5/profile.py``); a softmax router keeps the same tensors."""
    router = (4 * experts + 8 * topk + 4 + 4 * topk      # fp32 scores, int64 top-k, fp32 norm and weights
              + experts + 4 * experts + 8 * topk)        # dispatcher: bool map, fp32 probs, int64 permutation
    routed = topk * (2 * hidden                          # per routed copy: fc1 input (the permuted tokens)
                     + 2 * (2 * ffn) + 2 * ffn + 2 * ffn  # the GLU as in the dense MLP
                     + 2 * ffn + 4                       # the probs multiply: GLU output, fp32 prob
                     + 2 * ffn)                          # fc2 input
    return router + routed


def moe_capture_transient_bytes(hidden: int, topk: int) -> int:
    """A MoE layer's no-grad working set per capture-chunk token (allgather dispatcher,
    ``SequentialMLP``): the permuted copies of the tokens, the experts' outputs and their
    probability-weighted copy, each ``topk x hidden`` bf16, beside the layer's input, norm and
    residual (16 bytes per hidden unit, the planner's default). Measured: qwen3.6-35b-a3b cut to
    8 layers, 65,536-token chunks on an H100: the capture peak 10.9 GiB over the weights and the
    state, this term 8.0 GiB, the measured peak 1.04 x the predicted floor
    (``docs/qwen3.6-35b-a3b_1m.md``)."""
    return 6 * topk * hidden + 16 * hidden


def replay_output_bytes(hidden: int) -> int:
    """After the last layer in replay: the final norm, the final hidden states that the logits'
    activation checkpoint keeps as its input (bf16), the loss's fp32 per-token factor (the
    benchmark's ``-(logprobs * mask).sum()`` keeps the mask). The embedding's int64 token ids
    (8 bytes per token, first stage) are left out."""
    return rms_norm_saved_bytes(hidden) + 2 * hidden + 4
