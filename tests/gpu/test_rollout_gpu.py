"""GPU tier: decode attention on the fused kernels; rollouts against the full forward (fla, cuDNN)."""

import time

import pytest
import torch

from megatron_longstraw.attention.decode_attention import decode_attention
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.core.decode_state import new_decode_state
from megatron_longstraw.longstraw import decode_graph
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.decode_step import decode_step
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.rollout.generate import generate_from_state
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import forward_logits, megatron_from_hf

pytestmark = pytest.mark.gpu


def _rel_norm(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
@pytest.mark.parametrize("dim,batch,prompt,own,seq,split", [(256, 8, 3000, 37, 1, 1024), (128, 3, 517, 5, 2, 128),
                                                             (256, 8, 700, 9, 1, 1024)])
def test_decode_attention_fused_matches_math(backend, dim, batch, prompt, own, seq, split, record_property):
    """The pages in whole splits and a rest (3000 = 2 x 1024 + 952; 517 = 4 x 128 + 5) or in one
    call (700 < 1024), on the fused kernels, against the fp64 math."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, groups = 8, 2
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = rand(seq, batch, heads, dim), rand(own, batch, groups, dim), rand(own, batch, groups, dim)
    pk, pv = rand(prompt, 1, groups, dim), rand(prompt, 1, groups, dim)
    got = decode_attention(q, k, v, pk, pv, options=KernelOptions(attention_backend=backend, decode_split_keys=split))
    ref_pk = torch.cat([pk.expand(-1, batch, -1, -1), k[: own - seq]]).double()
    ref_pv = torch.cat([pv.expand(-1, batch, -1, -1), v[: own - seq]]).double()
    want = prefix_causal_attention_math(q.double(), k[own - seq:].double(), v[own - seq:].double(), ref_pk, ref_pv)
    error = _rel_norm(got, want)
    record_property("rel_err", f"{error:.1e}")
    assert error < 1e-2, error


def test_decode_merge_kernel_matches_torch_path(record_property):
    """The Triton own-keys-and-merge kernel (what ``decode_attention`` runs for one query per
    sample on a GPU) against the torch path it replaces, on the same cuDNN page partials: a
    fixed-shape step's 96 own rows of which 50 are valid (the rest NaN: never read), 3000 pages
    in two whole splits and a rest, bf16."""
    from megatron_longstraw.attention import decode_attention as da
    from megatron_longstraw.attention.decode_merge_triton import decode_merge

    gen = torch.Generator(device="cuda").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = rand(1, 8, 8, 256), rand(96, 8, 2, 256), rand(96, 8, 2, 256)
    k[50:], v[50:] = float("nan"), float("nan")
    pk, pv = rand(3000, 1, 2, 256), rand(3000, 1, 2, 256)
    options, scale = KernelOptions(decode_split_keys=1024), 256 ** -0.5
    valid = torch.tensor([50], device="cuda")
    got = decode_merge(q[0], k, v, scale, valid, da._prompt_stacks(q, pk, pv, scale, options))
    acc, lse = da._own_keys_part(q.permute(1, 2, 0, 3), k[:50].permute(1, 2, 0, 3), v[:50].permute(1, 2, 0, 3), scale)
    want = da._prompt_part(q, pk, pv, scale, options, acc, lse)[0][:, :, 0]
    error = _rel_norm(got, want)
    record_property("rel_err", f"{error:.1e}")
    assert torch.isfinite(got).all() and error < 1e-2, error


# bf16 only: fp32 would compile a second set of fla kernels (minutes of GPU time); fp32
# exactness of decoding is checked on CPU (tests/test_rollout.py)
@pytest.mark.parametrize("preset,dtype", [("qwen3.5-debug", torch.bfloat16)])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_rollout_matches_full_forward(single_process, preset, dtype, cuda_graphs, record_property):
    """Sampled rollouts of 4 samples after a 1000-token prompt: every step's logits against the full
    forward of prompt + that sample's tokens so far (fla and fused attention; fp32 runs the prompt
    part in plain torch, fla may use TF32), the steps run eagerly or replayed from CUDA graphs.
    GLM-5's decode path is plain torch, covered on CPU."""
    hf = resolve_hf_config(preset)
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0).to("cuda", dtype), ModelOptions(params_dtype=dtype))
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 1000), device="cuda", generator=gen)
    with torch.no_grad():
        state = capture_prompt(model, prompt, 256)
        result = generate_from_state(model, state, 4, 24, temperature=1.0, generator=gen, keep_logits=True,
                                     cuda_graphs=cuda_graphs)
    assert result.cuda_graphs == cuda_graphs
    with torch.no_grad():
        errors = []
        for response, logits in zip(result.responses, result.step_logits):
            full = forward_logits(model, torch.cat([prompt, response[None].cuda()], 1))[0, 999:-1].float()
            errors.append(_rel_norm(logits.cuda(), full))
    record_property("logit_rel_err_per_sample", ",".join(f"{e:.1e}" for e in errors))
    assert max(errors) < (3e-2 if dtype == torch.bfloat16 else 2e-3), errors


def test_graphed_steps_equal_eager_steps(single_process, record_property):
    """The same 100 tokens per sample fed to the eager decode step and to the one replayed from
    CUDA graphs (own-key rows 64, then all 100: two captures), qwen3.5-debug bf16 after a 3000-token
    prompt: logits within bf16 rounding at every step; the per-step times recorded (no bound)."""
    hf = resolve_hf_config("qwen3.5-debug")
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0).to("cuda", torch.bfloat16),
                             ModelOptions(params_dtype=torch.bfloat16))
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 3000), device="cuda", generator=gen)
    tokens = torch.randint(0, hf["vocab_size"], (8, 100), device="cuda", generator=gen)
    times = {"eager": [], "graphs": []}
    with torch.no_grad():
        state = capture_prompt(model, prompt, 1024)
        eager = new_decode_state(model, state, 8, 100)
        graphed = decode_graph.GraphedDecoder(model, new_decode_state(model, state, 8, 100), use_graphs=True)
        errors = []
        for step in range(100):
            ids = tokens[:, step:step + 1]
            for name, run in (("eager", lambda: decode_step(model, eager, ids)), ("graphs", lambda: graphed.step(ids))):
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = run()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
                if name == "eager":
                    want = out
            errors.append(_rel_norm(out.float(), want.float()))
    assert graphed.rows == 100 and int(graphed.length_t.item()) == 100  # 64 rows, then the capacity
    record_property("ms_per_step", ", ".join(f"{k} {1e3 * sorted(v[10:])[len(v[10:]) // 2]:.2f}" for k, v in times.items()))
    record_property("max_logit_rel_err", f"{max(errors):.1e}")
    assert max(errors) < 1e-2, errors


def test_rollout_speed_long_prompt(single_process, record_property):
    """Throughput record (no bound): qwen3.5-debug bf16, 64K-token prompt, 8 samples x 256 tokens."""
    hf = resolve_hf_config("qwen3.5-debug")
    hf["max_position_embeddings"] = 70_000
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0).to("cuda", torch.bfloat16),
                             ModelOptions(params_dtype=torch.bfloat16))
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(0, hf["vocab_size"], (1, 65_536), device="cuda", generator=gen)
    with torch.no_grad():
        state = capture_prompt(model, prompt, 8192)
        generate_from_state(model, state, 8, 8, generator=gen)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = generate_from_state(model, state, 8, 256, generator=gen)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    record_property("decode", f"{result.num_tokens} tokens in {seconds:.2f} s "
                    f"({result.decode_steps} steps, {1e3 * seconds / max(result.decode_steps, 1):.1f} ms/step), "
                    f"per-sample state {result.decode_state_bytes / 2**20:.1f} MiB, prompt state "
                    f"{state.nbytes() / 2**20:.1f} MiB")
