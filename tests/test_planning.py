"""The budget planner (``planning/``, ``tools/plan_budget.py``): every measured benchmark run
predicted within the stated bounds, layouts, the largest prompt, bad input."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.planning.hardware import GPUS
from megatron_longstraw.planning.layouts import Layout, candidate_layouts, layout_problem
from megatron_longstraw.planning.measured import measured_points
from megatron_longstraw.planning.memory import PEAK_ERROR, memory_plan
from megatron_longstraw.planning.planner import max_prompt, model_profile, plan_all, plan_layout
from megatron_longstraw.planning.run import RunShape
from megatron_longstraw.planning.timing import TIME_ERROR
from megatron_longstraw.testing.multiprocess import run_script

ROOT = Path(__file__).resolve().parents[1]


def _points():
    points, _ = measured_points(ROOT / "docs/bench")
    return points


def test_every_measured_run_is_predicted_within_the_bounds():
    """Every plannable point of docs/bench: peak within 5%, capture and replay (and the exact
    sweep) within 15%; a new JSON there is checked as soon as it lands. Times of a cold point
    (compilation inside: see ``MeasuredPoint.cold``) or of a run whose times the rates do not model
    yet (``measured.UNMODELED_TIMES``) are not compared, its peak is."""
    points = _points()
    assert len(points) >= 20
    failures = []
    for p in points:
        if p.oom:
            continue
        measured, predicted = p.measured(), p.predicted()
        keys = ["peak"] if p.cold or not p.times_modeled else ["peak", "capture", "replay", "prompt_backward"]
        for key in keys:
            if measured[key] is None or predicted[key] is None:
                continue
            error = predicted[key] / measured[key] - 1
            if abs(error) > (PEAK_ERROR if key == "peak" else TIME_ERROR):
                failures.append(f"{p.file}[{p.index}] {key}: predicted {predicted[key]:.2f}, measured "
                                f"{measured[key]:.2f} ({error:+.1%})")
    assert not failures, "\n".join(failures)


def test_the_fitted_rates_are_the_ones_the_planner_uses():
    """kernels.py's rates read off the runs are what the least-squares fit over docs/bench gives
    (within 5%): a new run that moves them asks for a refit."""
    from megatron_longstraw.planning import kernels
    from megatron_longstraw.planning.calibration import fit_rates

    fitted = fit_rates(ROOT / "docs/bench")
    assert len(fitted) == 10
    zero = {name for name, value in fitted.items() if value == 0}  # a term the data cannot resolve
    assert all(getattr(kernels, name) == 0 for name in zero), zero
    off = {name: value / getattr(kernels, name) - 1 for name, value in fitted.items() if name not in zero}
    assert all(abs(x) < 0.05 for x in off.values()), off


def test_every_run_that_ran_out_of_memory_is_predicted_not_to_fit():
    ooms = [p for p in _points() if p.oom]
    assert ooms, "docs/bench holds out-of-memory points (glm-5-mini exact at 512K with 32K chunks)"
    for p in ooms:
        assert not p.plan.fits, f"{p.file}[{p.index}]: predicted {p.plan.memory.peak:.1f} GiB, which fits"


def test_layouts_respect_the_model():
    profile = model_profile(resolve_hf_config("qwen3.6-27b"))
    layouts = candidate_layouts(profile, 8)
    assert Layout(tp=4, dp=2) in layouts and Layout(cp=8) in layouts and Layout(pp=8, vpp=2) in layouts
    assert Layout(tp=8) not in layouts  # 4 KV heads
    assert all(x.world == 8 for x in layouts)
    assert "head/FFN count 4" in layout_problem(profile, Layout(tp=8))
    assert "64 layers" in layout_problem(profile, Layout(pp=3))
    glm = model_profile(resolve_hf_config("glm-5-mini"))
    assert any(x.ep > 1 for x in candidate_layouts(glm, 4))
    assert "experts" in layout_problem(profile, Layout(ep=2, dp=2))


def test_layouts_the_trainer_refuses_are_not_planned():
    """GLM-5 needs sequence parallelism under TP, which CP does not serve: no TP x CP layout."""
    hf = resolve_hf_config("glm-5-mini")
    plans = plan_all(model_profile(hf), RunShape(prompt_length=1 << 16, rollout="file"), GPUS["h200"], 4, hf)
    assert plans and not any(p.layout.tp > 1 and p.layout.cp > 1 for p in plans)
    assert any(p.layout.cp > 1 for p in plans) and any(p.layout.tp > 1 for p in plans)
    internal = plan_all(model_profile(hf), RunShape(prompt_length=1 << 16), GPUS["h200"], 4, hf)
    assert any(p.layout.cp > 1 for p in internal)  # GLM-5 decodes under CP
    assert not any(p.layout.tp > 1 and p.layout.cp > 1 for p in internal)


def test_more_gpus_less_memory_and_exact_costs_more():
    profile = model_profile(resolve_hf_config("qwen3.5-0.8b"))
    run = RunShape(prompt_length=1 << 20)
    one = memory_plan(profile, Layout(), run)
    cp4 = memory_plan(profile, Layout(cp=4, dp=1), run)
    exact = memory_plan(profile, Layout(), replace(run, prompt_gradient="exact"))
    assert cp4.prompt_state == pytest.approx(one.prompt_state / 4, rel=0.01)
    assert exact.peak > one.peak and exact.state_gradients > 0 and one.state_gradients == 0
    again = replace(run, recompute=True)
    assert memory_plan(profile, Layout(), again).replay_activations < one.replay_activations / 5
    gpu = GPUS["h200"]
    assert plan_layout(profile, Layout(), again, gpu).time.replay > plan_layout(profile, Layout(), run, gpu).time.replay


def test_max_prompt_is_the_edge_of_fitting():
    """The largest prompt fits; one granule more does not (for every layout)."""
    profile = model_profile(resolve_hf_config("qwen3.5-0.8b"))
    run = RunShape(prompt_length=1, prompt_gradient="exact", chunk_size=16384)
    length, plan = max_prompt(profile, run, GPUS["h200"], 1)
    assert plan is not None and plan.fits and length > 1 << 20
    over = plan_all(profile, replace(run, prompt_length=length + 1024), GPUS["h200"], 1)
    assert not any(p.fits for p in over)
    timed, plan = max_prompt(profile, run, GPUS["h200"], 1, max_step_seconds=60.0)
    assert 0 < timed < length and plan.time.step <= 60.0


def _plan_budget():
    sys.path.insert(0, str(ROOT / "tools"))
    import plan_budget

    return plan_budget


def test_cli_table_and_json(capsys):
    argv = ["--model", "qwen3.5-0.8b", "--num-gpus", "2", "--prompt-length", "524288"]
    assert _plan_budget().main(argv) == 0
    out = capsys.readouterr().out
    assert "fastest that fits" in out and "TP1 CP2 PP1 DP1" in out
    assert _plan_budget().main(argv + ["--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert {"weights", "prompt_state", "peak"} <= set(plans[0]["memory_gib"])


def test_cli_virtual_stages_alone_search_the_pipeline_size(capsys):
    """Virtual stages given without a pipeline size ask for the layouts of PP > 1."""
    argv = ["--model", "qwen3.5-0.8b", "--num-gpus", "4", "--num-virtual-stages-per-pipeline-rank", "2",
            "--prompt-length", "65536", "--json"]
    assert _plan_budget().main(argv) == 0
    layouts = {(p["layout"]["pp"], p["layout"]["vpp"]) for p in json.loads(capsys.readouterr().out)["plans"]}
    assert layouts == {(2, 2), (4, 2)}


@pytest.mark.parametrize("args, message", [
    (["--gpu", "v100"], "--gpu v100: unknown GPU"),
    (["--model", "{bad"], "neither a preset"),
    (["--tensor-model-parallel-size", "3", "--num-gpus", "3"], "does not divide"),
    (["--tensor-model-parallel-size", "3", "--num-gpus", "3", "--max-prompt"], "does not divide"),
    (["--gpu-tflops", "0"], "--gpu-tflops 0.0: must be positive"),
    (["--max-step-seconds", "600"], "--max-step-seconds needs --max-prompt"),
    (["--against", "/nonexistent"], "--against /nonexistent: no such folder"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-model-parallel-size", "1"],
     "virtual pipeline stages need --pipeline-model-parallel-size > 1"),
])
def test_cli_bad_input_one_line(capsys, args, message):
    base = [] if args[0] == "--model" else ["--model", "qwen3.5-0.8b"]
    assert _plan_budget().main([*base, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_model_file_that_does_not_parse(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "qwen3_5_text",\n  oops}')
    out = run_script(ROOT / "tools/plan_budget.py", ["--model", str(bad)])
    assert out.returncode == 2 and f"{bad}:2: invalid JSON" in out.stderr


def _trainer_args(tmp_path, *extra):
    from megatron_longstraw.training.arguments import parse_args

    return parse_args(["--model", "qwen3.5-0.8b", "--no-save", "--wandb-save-dir", str(tmp_path), "--data-path", "synthetic", "--synthetic-prompt-length", "1048576",
                       "--max-response-length", "8192", "--num-generations", "8", "--bf16", *extra], world_size=1)


def test_trainer_prints_its_plan_and_refuses_a_run_that_cannot_fit(monkeypatch, capsys, tmp_path):
    """Before allocating: the plan's line for the run's own layout; a GPU too small for it gets one
    error naming the predicted peak, the GPU's memory and what fits; --no-plan-check skips that."""
    from megatron_longstraw.planning.hardware import GpuSpec
    from megatron_longstraw.training import plan_check
    from megatron_longstraw.training.setup import policy_hf_config

    args = _trainer_args(tmp_path)
    hf = policy_hf_config(args)
    monkeypatch.setattr(plan_check, "this_gpu", lambda: None)  # a CPU: planned for an H200, never refused
    plan = plan_check.check_plan(args, hf, rank0=True)
    assert ("plan (prompt 1,048,576 tokens, planned for an H200: no GPU here): TP1 CP1 PP1 DP1, chunks of 32,768: "
            "peak") in capsys.readouterr().out
    small = GpuSpec("h100", 40.0, 989.0, 3.35)
    assert plan.memory.peak > 40.0 * 1.05
    monkeypatch.setattr(plan_check, "this_gpu", lambda: small)
    with pytest.raises(ValueError) as err:
        plan_check.check_plan(args, hf, rank0=False)
    message = str(err.value)
    assert f"{plan.memory.peak:.1f} GiB per GPU, over the 40.0 GiB" in message and "--no-plan-check" in message
    assert "a prompt of at most" in message and "(--synthetic-prompt-length)" in message and "\n" not in message
    length = int(message.split("a prompt of at most ")[1].split(" tokens")[0].replace(",", ""))
    fitting = replace(plan_check.trainer_run(args, hf)[1], prompt_length=length)
    assert plan_layout(plan_check.model_profile(hf), plan.layout, fitting, small).fits
    plan_check.check_plan(_trainer_args(tmp_path, "--no-plan-check"), hf, rank0=False)  # skipped: no error
