"""Model-parity helpers shared by the CPU tests and the GPU test runner."""

import zlib

import torch
from megatron.core import parallel_state

from megatron_longstraw.config.parallel import ParallelSizes
from megatron_longstraw.distributed import device, init_distributed
from megatron_longstraw.models.builder import build_stage_model, load_full_state_dict, shard_for_rank
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.pipeline_stage import model_chunks
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.models.registry import family_for
from megatron_longstraw.testing.hf_reference import build_hf_model


def megatron_from_hf(hf: dict, hf_model, options: ModelOptions = ModelOptions(), parallel_output: bool = False):
    """A Megatron model (eval mode) holding ``hf_model``'s weights; full logits, or with
    ``parallel_output`` this TP rank's vocabulary shard (what the vocab-parallel loss needs)."""
    model = build_stage_model(hf, options, parallel_output=parallel_output)
    load_full_state_dict(model, family_for(hf["model_type"]).weights.hf_to_mcore(hf_model.state_dict(), hf))
    return model.eval()


def seeded_model(hf: dict, dtype=torch.float32, seed: int = 0, parallel_output: bool = False, **options):
    """``megatron_from_hf`` of the HF reference model built from ``seed``, in ``dtype``
    (``options``: further ``ModelOptions`` fields, e.g. ``sequence_parallel``)."""
    return megatron_from_hf(hf, build_hf_model(hf, seed=seed).to(dtype), ModelOptions(params_dtype=dtype, **options),
                            parallel_output)


def bf16_and_fp32_models(preset: str, device: str = "cuda", transformer_impl: str = "local", **overrides):
    """``(hf, bf16 model, fp32 model)`` with the same (bf16-rounded) weights of the HF reference
    built from seed 0, on ``device``: a bf16 run (local spec or ``transformer_engine``) and its
    fp32 truth (local spec). ``overrides`` change HF config fields of the preset."""
    hf = {**resolve_hf_config(preset), **overrides}
    hf_model = build_hf_model(hf, seed=0).to(device, torch.bfloat16)
    model = megatron_from_hf(hf, hf_model, ModelOptions(params_dtype=torch.bfloat16, transformer_impl=transformer_impl))
    return hf, model, megatron_from_hf(hf, hf_model.float(), ModelOptions(params_dtype=torch.float32))


def pipeline_global_names(model):
    """A function mapping this pipeline stage's parameter names to the whole model's
    (``decoder.layers.{local}`` -> the global layer number; with tied embeddings the last
    stage's ``output_layer.weight`` is the embedding it shares)."""
    from megatron_longstraw.models.pipeline_stage import StageChunks, chunk_layer_ids

    chunks = list(model) if isinstance(model, StageChunks) else None
    ids = [chunk_layer_ids(c) for c in chunks] if chunks else [chunk_layer_ids(model)]
    tied = (chunks[-1] if chunks else model).share_embeddings_and_output_weights

    def rename(name: str) -> str:
        parts = name.split(".")
        chunk = 0
        if chunks:  # a chunk's names start with its index (virtual pipeline stages)
            chunk, parts = int(parts[0]), parts[1:]
        if tied and parts == ["output_layer", "weight"]:
            return "embedding.word_embeddings.weight"
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(ids[chunk][int(parts[2])])
        return ".".join(parts)
    return rename


def sum_tied_embedding_grads(model) -> None:
    """With tied embeddings split over pipeline stages (the first stage's embedding, the last
    stage's output layer), add up their gradients over Megatron's embedding group, as the
    trainer's ``finalize_model_grads`` does, so each holds the tied weight's whole gradient."""
    from megatron.core import parallel_state

    if not parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return
    for chunk in model_chunks(model):  # the chunk with the embedding or the output layer
        if chunk.share_embeddings_and_output_weights and (chunk.pre_process or chunk.post_process) \
                and parallel_state.is_rank_in_embedding_group():
            weight = chunk.shared_embedding_or_output_weight()
            torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def grad_projections(model, rename=lambda name: name) -> dict:
    """Per parameter with a gradient (keyed by ``rename(name)``): its norm and its projections on
    two random directions seeded by that name, on the CPU. Two runs of one model under different
    layouts compare their (large) gradients through these few numbers."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        key = rename(name)
        gen = torch.Generator(device=p.device).manual_seed(zlib.crc32(key.encode()))
        grad = p.grad.float()
        directions = torch.randn(2, *grad.shape, device=p.device, generator=gen)
        out[key] = torch.stack([grad.norm(), (grad * directions[0]).sum(), (grad * directions[1]).sum()]).cpu()
    return out


def random_tokens(hf: dict, n: int, seed: int) -> torch.Tensor:
    """``[1, n]`` token ids uniform over the vocabulary, reproducible from ``seed``."""
    return torch.randint(0, hf["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (the gradient checks' measure)."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def value_error_text(fn) -> str | None:
    """The message of the ``ValueError`` ``fn()`` raises, or ``None`` when it raises none."""
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def forward_logits(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[b, s, vocab]`` for ``tokens_BS``."""
    position_ids = torch.arange(tokens_BS.shape[1], device=tokens_BS.device).expand_as(tokens_BS)
    return model(tokens_BS, position_ids, attention_mask=None)


def logits_and_grads(hf: dict, tokens_BS: torch.Tensor, seed: int = 0, dtype=torch.float32):
    """Logits and this rank's parameter gradients of a next-token loss, after TP reductions.

    fp64 is for gradient comparisons: some gradients of a random model (e.g. Gated DeltaNet's
    ``dt_bias`` where the decay is strong) are tiny and cancellation-dominated, so fp32 alone
    differs from fp64 by ~1e-3 relative there and cannot resolve a 1e-5 check.
    """
    hf_model = build_hf_model(hf, seed=seed).to(dtype)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    options = ModelOptions(params_dtype=dtype, sequence_parallel=tp > 1)
    model = megatron_from_hf(hf, hf_model, options)
    tokens_BS = tokens_BS.to(device())
    logits = forward_logits(model, tokens_BS)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), tokens_BS[:, 1:].flatten())
    loss.backward()
    reduce_tp_grads(model)
    # parameters without a gradient (GLM-5's DSA indexer: the LM loss does not reach it, in HF
    # either) are left out
    grads = {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach().cpu(), grads, model


def reduce_tp_grads(model) -> None:
    """Megatron's own TP reduction of replicated-parameter gradients (as ``finalize_model_grads``)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron_longstraw.patches.gdn_out_norm_tp_grads import finalize

    model.ddp_config = DistributedDataParallelConfig()
    finalize._allreduce_non_tensor_model_parallel_grads([model], model.config)


def tp_grad_errors(model, grads: dict, reference_grads: dict, scale_floor: float = 1e-12) -> dict[str, float]:
    """Per parameter in ``grads``: max |grad - this TP rank's shard of the TP=1 gradient|, relative
    to that shard's largest entry (at least ``scale_floor``)."""
    family = family_for(model.hf_config["model_type"])
    rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    errors = {}
    for name, param in model.named_parameters():
        if name not in grads:
            continue
        expected = reference_grads[name]
        if getattr(param, "tensor_model_parallel", False):
            expected = shard_for_rank(expected, param.partition_dim, rank, tp, family.tp_sections(name, model.config))
        scale = expected.abs().max().clamp_min(scale_floor)
        errors[name] = ((grads[name] - expected).abs().max() / scale).item()
    return errors


def assert_grads_match(got: dict, want: dict, bound: float, label: str = "") -> None:
    """The same parameters have gradients, each within ``bound`` (``max_rel_error``) of ``want``."""
    assert set(got) == set(want), f"{label}: parameters with gradients differ"
    for name, ref in want.items():
        rel = max_rel_error(got[name], ref)
        assert rel <= bound, f"{label} {name}: relative gradient error {rel}"


def tp_worker(cases: list, tp: int) -> list:
    """Run on each rank: per case ``(hf, tokens_BS, reference_grads, dtype)`` the TP=``tp``
    logits plus the worst gradient error against the TP=1 shards (one process group for all)."""
    init_distributed(ParallelSizes(tensor=tp), seed=1234)
    out = []
    for hf, tokens_BS, reference_grads, dtype in cases:
        logits, grads, model = logits_and_grads(hf, tokens_BS, dtype=dtype)
        assert set(grads) == set(reference_grads), "TP changed which parameters get gradients"
        out.append((logits, max(tp_grad_errors(model, grads, reference_grads).values())))
    return out


def replay_gradients(model, prompt_1S: torch.Tensor, responses, chunk_size: int):
    """One LongStraw capture of ``prompt_1S`` and replay of ``responses`` (one per micro-batch)
    with the loss ``-sum(logprobs) / response tokens``, from zeroed gradients: the loss and
    ``{name: flat gradient}``."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.replay import replay_responses

    model.zero_grad(set_to_none=True)
    tokens = sum(len(r) for r in responses)
    with torch.no_grad():
        state = capture_prompt(model, prompt_1S, chunk_size)
    loss = sum(replay_responses(model, state, responses, lambda lp, mask, idx: -(lp * mask).sum() / tokens, 1))
    return loss, {n: p.grad.detach().flatten().clone() for n, p in model.named_parameters() if p.grad is not None}


def exact_gradients(model, prompt_1S: torch.Tensor, responses, loss_fn, chunk_size: int,
                    micro_batch_size: int = 1) -> None:
    """``--prompt-gradient exact`` on one prompt group: a capture that keeps the chunk starts,
    replay with the state's gradients, then the reverse sweep over the prompt; the gradients
    accumulate in ``model`` (on every rank of its layout) and the state is freed."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.longstraw.prompt_backward import prompt_backward
    from megatron_longstraw.longstraw.replay import replay_responses

    with torch.no_grad():
        state = capture_prompt(model, prompt_1S, chunk_size, exact=True)
    replay_responses(model, state, responses, loss_fn, micro_batch_size, exact=True)
    prompt_backward(model, state, prompt_1S)
    state.free()


def weighted_response_loss(total_tokens: int):
    """A loss of the shape of every policy loss (a sum of per-sample terms over a fixed
    normalizer), with a weight per sample so that the samples' gradients are told apart."""
    def loss_fn(logprobs_RB, mask_RB, indices):
        weights_B = torch.tensor([1.0 + 0.5 * i for i in indices], dtype=logprobs_RB.dtype)
        return -(logprobs_RB * mask_RB * weights_B).sum() / total_tokens
    return loss_fn



def take_grads(model) -> dict[str, torch.Tensor]:
    """The model's gradients by parameter name (those it has), then zeroed."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_exact_equals_full_backprop(model, prompt_1S: torch.Tensor, responses, loss_fn, chunk_size: int,
                                      micro_batch_size: int = 1, bound: float = 1e-9) -> None:
    """``exact_gradients`` against full backprop through prompt + responses with nothing
    detached (``full_graph_responses(exact=True)``): the same parameters, each within ``bound``
    (``max_rel_error``). A routed expert none of whose loss-bearing tokens chose it has a zero
    reference gradient and must have a zero exact one."""
    from megatron_longstraw.longstraw.full_graph import full_graph_responses

    full_graph_responses(model, prompt_1S, responses, loss_fn, micro_batch_size=1, exact=True)
    reference = take_grads(model)
    exact_gradients(model, prompt_1S, responses, loss_fn, chunk_size, micro_batch_size)
    exact = take_grads(model)
    assert set(exact) == set(reference), "exact mode changed which parameters get gradients"
    for name, ref in reference.items():
        if "local_experts" in name and ref.abs().max() == 0:
            assert exact[name].abs().max() == 0, f"{name}: routed in exact mode only"
            continue
        assert ref.abs().max() > 0, f"{name}: zero reference gradient"
        rel = max_rel_error(exact[name], ref)
        assert rel <= bound, f"{name}: relative gradient error {rel}"
