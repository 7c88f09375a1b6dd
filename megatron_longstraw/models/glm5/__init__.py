"""The GLM-5 family (HF ``glm_moe_dsa``): MLA + DeepSeek sparse attention (DSA) + sigmoid MoE:
its config (``config.py``), layer specs (``spec.py``) and LongStraw layers (``layers.py``, their
state ``state.py``, decoding ``decode.py``), its weights (``convert.py``), cost (``profile.py``)
and presets (``presets.py``), registered as ``FAMILY``.

Every layer is Megatron's ``AbsorbedMLASelfAttention`` with ``DSAttention`` as core attention
(the layout of Megatron's own ``get_dsa_module_spec_for_backend``: duplicated down projections;
the local spec uses ``layers.GlmAbsorbedMLASelfAttention`` for that, and absorbed MLA needs
``--sequence-parallel`` whenever TP > 1); the MLP is a SwiGLU ``MLP``
for the first ``first_k_dense_replace`` layers (HF ``mlp_layer_types == "dense"``) and Megatron's
``MoELayer`` otherwise (``moe_layer_freq`` list). How HF semantics map onto Megatron settings:

- MLA: ``q_a_proj -> q_a_layernorm -> q_b_proj`` and ``kv_a_proj_with_mqa -> kv_a_layernorm ->
  kv_b_proj`` are Megatron's q/kv down/up projections with ``qk_layernorm``; per-head layouts
  (``[nope, rope]`` for q, ``[k_nope, v]`` for kv_b) are identical, so weights map one to one.
  HF applies RoPE to the rope slice with ``apply_rotary_pos_emb_interleave`` (pairs
  ``(x0, x1), ...`` rotated, output de-interleaved): that is exactly Megatron's
  ``mla_rotary_interleaved`` path (always on in MLA). HF's latent norms use eps 1e-6, not
  ``rms_norm_eps`` (see ``layers.fixed_eps_norm``). Softmax scale ``1/sqrt(nope + rope)``.
- DSA indexer: ``wq_b`` (from the normed q latent), ``wk`` + LayerNorm(eps 1e-6, with bias),
  interleaved RoPE on the first ``qk_rope_head_dim`` dims (``dsa_indexer_rope_interleaved``),
  ``relu(q.k) * w * n_heads^-0.5 * head_dim^-0.5`` summed over heads (``dsa_indexer_scoring_relu``;
  no Hadamard rotation), causal mask, top-``index_topk`` (exact score ties broken by position,
  ``patches.dsa_causal_topk``, so a selection never depends on later tokens); attention is causal
  AND top-k.
- ``indexer_types``: a ``"shared"`` layer reuses the top-k of the most recent ``"full"`` layer
  (HF passes ``topk_indices`` down the stack). Megatron's ``dsa_indexer_topk_freq`` /
  ``dsa_indexer_skip_topk_offset`` express the periodic patterns HF derives from
  ``index_topk_freq`` / ``index_skip_topk_offset`` (same formula, same source layer); an
  arbitrary pattern is refused with a ValueError.
- Router: ``sigmoid`` scores, ``e_score_correction_bias`` -> ``expert_bias`` (buffer, routing
  only), group-limited routing (HF sums the top-2 scores of a group; Megatron the top
  ``topk // group_topk``, so a restricting grouping needs ``topk // topk_group == 2``), top-k
  weights renormalized (Megatron always does for sigmoid, so ``norm_topk_prob`` must be true),
  times ``routed_scaling_factor`` (``moe_router_topk_scaling_factor``); router math in fp32 (fp64
  for fp64 parameters, so fp64 tests are fp64 throughout).
- Experts: HF ``gate_up_proj[e]`` is ``[gate; up]`` = Megatron's fused ``linear_fc1`` of
  ``SequentialMLP`` expert ``e``; the shared expert is ``moe_shared_expert_intermediate_size``.
- The full state dict uses GLOBAL expert numbers in ``local_experts.{e}``; ``load_full_state_dict``
  keeps the experts of this EP rank and renumbers them.
- The router's ``expert_bias`` keeps Megatron's aux-loss-free update (``moe_router_bias_update_rate``)
  when training runs ``finalize_model_grads``; Megatron only counts tokens for it with grad
  enabled, so LongStraw capture (no grad) neither counts prompt tokens nor changes the bias;
  replay counts response tokens (padding of a micro-batch included; the full-graph baseline also
  counts the prompt once per response).
- RoPE: ``default`` or ``yarn``; YaRN is Megatron's ``YarnRotaryEmbedding`` in MLA and the
  indexer, its ``mscale`` solved so that cos/sin and the softmax scale are transformers'
  (``models/rope.py``'s ``mla_yarn_kwargs``).
- ``--prompt-gradient exact`` (MoE): the reverse sweep's recomputed prompt chunk routes every
  token as the full graph does (routing is per token, no capacity or token dropping, the same
  ``expert_bias``: it only changes at the optimizer step), so gradients are exact. What differs
  is the expert-bias token count: the sweep runs with grad, so it counts every prompt token once
  (under sequence parallelism a chunk's padding rows too; expert-parallel idle rounds count
  nothing; capture counts none; the full-graph baseline counts the prompt once per response,
  detached replay never), and the step's bias update sees the prompt's routing once. Aux, sequence-aux
  and z losses, which a recompute would add once more, are off for GLM-5
  (``moe_router_load_balancing_type="none"``, ``moe_aux_loss_coeff=0``, no z-loss).
- LongStraw prompt state (``state.py``): per layer the MLA latent ``[c_kv ; k_rope]`` of every
  prompt token, plus the DSA indexer keys on layers with their own indexer (not "shared" ones).
- HF checkpoints carry an MTP layer (``model.layers.{num_hidden_layers}.*``) that HF's own model
  ignores; it is dropped here as well, with a warning.
"""

from megatron_longstraw.models.family import ModelFamily
from megatron_longstraw.models.glm5 import config, convert, presets, profile, spec
from megatron_longstraw.models.registry import register_family

FAMILY = register_family(ModelFamily.of_package(config=config, spec=spec, convert=convert, profile=profile,
                                                presets=presets))
