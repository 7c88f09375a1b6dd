"""GPU tier: fused prefix attention against the math reference; capture/replay in bf16 with fla."""

import pytest
import torch

from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
from megatron_longstraw.attention.prefix_attention_cuda import prefix_causal_attention_cuda
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.full_graph import full_graph_responses
from megatron_longstraw.longstraw.replay import replay_logits, replay_responses
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import forward_logits, megatron_from_hf

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("dim,batch,prefix,block", [(256, 1, 300, 262144), (128, 3, 517, 262144),
                                                    (256, 2, 0, 262144), (256, 2, 517, 128)])
def test_fused_prefix_attention_matches_math(monkeypatch, backend, dim, batch, prefix, block, record_property):
    monkeypatch.setenv("LONGSTRAW_ATTENTION_BACKEND", backend)
    monkeypatch.setenv("LONGSTRAW_PREFIX_BLOCK", str(block))
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq, heads, groups = 70, 8, 2
    q = torch.randn(seq, batch, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(seq, batch, groups, dim, device="cuda", generator=gen, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    pk, pv = (torch.randn(prefix, 1, groups, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
              for _ in range(2))
    grad = torch.randn(seq, batch, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    results = []
    for fn in (prefix_causal_attention_cuda, prefix_causal_attention_math):
        out = fn(q, k, v, pk, pv)
        (dq, dk, dv) = torch.autograd.grad(out, (q, k, v), grad)
        results.append((out, dq, dk, dv))
    errors = [_rel(a, b) for a, b in zip(*results)]
    record_property("rel_err_out_dq_dk_dv", ",".join(f"{e:.1e}" for e in errors))
    assert max(errors) < 2e-2, errors


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


def test_capture_replay_bf16_matches_full_graph(single_process, record_property):
    """qwen3.5-debug on fla + fused attention: logits and gradients against the full graph."""
    hf = resolve_hf_config("qwen3.5-debug")
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0).to("cuda", torch.bfloat16),
                             ModelOptions(params_dtype=torch.bfloat16))
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 1000), device="cuda", generator=gen)
    responses = [torch.randint(0, hf["vocab_size"], (n,), device="cuda", generator=gen) for n in (200, 131)]
    with torch.no_grad():
        full = forward_logits(model, torch.cat([prompt, responses[0][None]], 1))[0, 999:-1].float()
        state = capture_prompt(model, prompt, 256)
        replayed = replay_logits(model, state, responses[0][None])[:, 0].float()
    logit_err = (replayed - full).abs().max().item() / full.abs().max().item()

    def loss_fn(logprobs_RB, mask_RB, indices):
        return -(logprobs_RB * mask_RB).sum() / 331

    full_graph_responses(model, prompt, responses, loss_fn)
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    replay_responses(model, state, responses, loss_fn, micro_batch_size=2)
    cosines = {n: _cosine(p.grad, reference[n]) for n, p in model.named_parameters()}
    worst = min(cosines, key=cosines.get)
    record_property("logit_rel_err", f"{logit_err:.2e}")
    record_property("worst_grad_cosine", f"{cosines[worst]:.5f} ({worst})")
    assert logit_err < 2e-2
    assert cosines[worst] > 0.99
