"""The decode step in fixed shapes (what a CUDA graph replays), run eagerly on the CPU: against the
ordinary decode step, against the full forward inside ``generate_from_state``, and what it refuses."""

import pytest
import torch

from megatron_longstraw.core.decode_state import new_decode_state
from megatron_longstraw.longstraw import decode_graph
from megatron_longstraw.longstraw.capture import capture_prompt
from megatron_longstraw.longstraw.decode_step import decode_step
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.rollout.generate import generate_from_state
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import forward_logits, megatron_from_hf

PROMPT, CHUNK, SAMPLES = 29, 8, 3


def _model(preset="qwen3.5-debug"):
    hf = resolve_hf_config(preset)
    return hf, megatron_from_hf(hf, build_hf_model(hf, seed=0), ModelOptions(params_dtype=torch.float32))


def _prompt(hf):
    return torch.randint(0, hf["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(3))


def test_fixed_shape_steps_equal_the_decode_step(single_process, monkeypatch):
    """The same tokens through both: logits within 1e-5 at every step while the own-key rows grow
    2 -> 4 -> 8 -> 11 (the capacity), each step's rows past the count masked."""
    monkeypatch.setattr(decode_graph, "MIN_OWN_ROWS", 2)
    hf, model = _model()
    tokens = torch.randint(0, hf["vocab_size"], (SAMPLES, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        prompt = capture_prompt(model, _prompt(hf), CHUNK)
        eager = new_decode_state(model, prompt, SAMPLES, capacity=11)
        fixed = decode_graph.GraphedDecoder(model, new_decode_state(model, prompt, SAMPLES, capacity=11),
                                            use_graphs=False)
        rows = []
        for step in range(11):
            want = decode_step(model, eager, tokens[:, step:step + 1])
            got = fixed.step(tokens[:, step:step + 1])
            rows.append(fixed.rows)
            diff = (got - want).abs().max().item()
            assert diff <= 1e-5, (step, diff)
        assert int(fixed.length_t.item()) == fixed.state.length == 11
        # the rows a fixed-shape step reads before they are written are finite (zeros)
        fresh = new_decode_state(model, prompt, SAMPLES, capacity=11)
        own = [t for layer in fresh.layers.values() for name, t in layer.tensors().items() if name.endswith("_SBGD")]
        assert own and all(not t.any() for t in own)
        with pytest.raises(ValueError, match="decode state of capacity 11 cannot take 1 more tokens after 11"):
            fixed.step(tokens[:, :1])
    assert rows == [2, 2, 4, 4, 8, 8, 8, 8, 11, 11, 11]


def test_generate_with_the_whole_batch_matches_full_forward(single_process, monkeypatch):
    """``generate_from_state`` on the fixed-shape step (the batch kept whole after a sample stops
    at EOS): every sample's logits at every step equal the full forward of prompt + its tokens, the
    EOS sample ends there, the others go on."""
    monkeypatch.setattr(decode_graph, "MIN_OWN_ROWS", 2)
    hf, model = _model()
    prompt_1S = _prompt(hf)
    used = []

    def fixed(model, state):
        used.append(decode_graph.GraphedDecoder(model, state, use_graphs=False))
        return used[-1]
    with torch.no_grad():
        state = capture_prompt(model, prompt_1S, CHUNK)
        free = generate_from_state(model, state, SAMPLES, 10, temperature=1.0,
                                   generator=torch.Generator().manual_seed(5))
        tokens = torch.stack(free.responses)
        step = next(k for k in range(2, 7) if (tokens[:, : k + 1] == tokens[0, k]).sum() == 1)
        monkeypatch.setattr(decode_graph, "graphed_decoder", fixed)
        result = generate_from_state(model, state, SAMPLES, 10, temperature=1.0, eos_id=tokens[0, step].item(),
                                     generator=torch.Generator().manual_seed(5), keep_logits=True,
                                     cuda_graphs=True)
        fulls = [forward_logits(model, torch.cat([prompt_1S, r[None]], 1))[0, PROMPT - 1:-1]
                 for r in result.responses]
    assert len(used) == 1 and used[0].state.num_samples == SAMPLES  # never narrowed
    assert result.stopped_by_eos[0] and result.responses[0].tolist() == tokens[0, : step + 1].tolist()
    assert max(r.numel() for r in result.responses[1:]) > step + 1
    for response, logits, full in zip(result.responses, result.step_logits, fulls):
        assert logits.shape[0] == response.numel()
        assert (logits - full).abs().max().item() <= 1e-5


def test_what_graphs_refuse(single_process):
    """Qwen3.5 (full attention and Gated DeltaNet) decodes in fixed shapes; GLM-5 (MoE, MLA) and
    FP8 do not; on the CPU no graph is made and ``generate_from_state`` decodes eagerly."""
    _, qwen = _model()
    hf, glm = _model("glm-5-debug")
    assert decode_graph.refusal(qwen) is None
    assert decode_graph.refusal(glm) == "MoE layers"
    glm.config.num_moe_experts, experts = None, glm.config.num_moe_experts
    try:
        assert decode_graph.refusal(glm).endswith("layers") and "MoE" not in decode_graph.refusal(glm)
    finally:
        glm.config.num_moe_experts = experts
    qwen.config.fp8 = "hybrid"
    try:
        assert decode_graph.refusal(qwen).startswith("FP8")
    finally:
        qwen.config.fp8 = None
    with torch.no_grad():
        state = capture_prompt(qwen, _prompt(resolve_hf_config("qwen3.5-debug")), CHUNK)
        assert decode_graph.graphed_decoder(qwen, new_decode_state(qwen, state, 2, 3)) is None  # CPU
        eager = generate_from_state(qwen, state, 2, 4, temperature=0.0)
        graphs = generate_from_state(qwen, state, 2, 4, temperature=0.0, cuda_graphs=True)
    assert [r.tolist() for r in graphs.responses] == [r.tolist() for r in eager.responses]
    assert not graphs.cuda_graphs and not eager.cuda_graphs
