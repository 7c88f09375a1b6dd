"""The typed configuration (``megatron_longstraw/config/``): one definition per flag, shared by the
trainer's, the planner's and the benchmarks' command lines; the configuration objects, not an
argparse namespace, below ``training/``."""

import argparse
import ast
import sys
from pathlib import Path

import pytest

from megatron_longstraw.config import cli
from megatron_longstraw.config.benchmark import BenchmarkConfig
from megatron_longstraw.config.grpo import LossConfig, RolloutConfig
from megatron_longstraw.config.longstraw import LongStrawConfig
from megatron_longstraw.config.planner import PlannerConfig
from megatron_longstraw.config.trainer import TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_longstraw"
sys.path.insert(0, str(ROOT / "tools"))


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """The trainer's, the planner's and every benchmark's command line, by command. (Not the
    checkpoint converter's: its --load, --save, --model and --tokenizer-model name a conversion's
    input and output, not a run's.)"""
    import bench_convert_memory
    import bench_decode
    import bench_fp8_attention
    import bench_fp8_attention_calls
    import bench_linear_fp8
    import bench_longstraw
    import exact_gradient_check
    import fp8_sensitivity
    import plan_budget

    from megatron_longstraw.training.arguments import build_parser

    return {"train_grpo.py": build_parser(), "tools/plan_budget.py": plan_budget.build_parser(),
            "tools/bench_longstraw.py": bench_longstraw.build_parser(),
            "tools/bench_decode.py": bench_decode.build_parser(),
            "tools/bench_fp8_attention.py": bench_fp8_attention.build_parser(),
            "tools/bench_linear_fp8.py": bench_linear_fp8.build_parser(),
            "tools/exact_gradient_check.py": exact_gradient_check.build_parser(),
            "tools/fp8_sensitivity.py": fp8_sensitivity.build_parser(),
            "tools/bench_fp8_attention_calls.py": bench_fp8_attention_calls.build_parser(),
            "tools/bench_convert_memory.py": bench_convert_memory.build_parser()}


def _definition(action: argparse.Action) -> tuple:
    """What a user sees of a flag: its kind, type, choices, help (with its default)."""
    return (type(action).__name__, getattr(action.type, "__name__", action.type),
            tuple(action.choices or ()), action.help, action.metavar)


def shared_flag_problems(parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Flags that two commands have in common but do not define once: one of them written by hand
    (not generated from a configuration field), generated from different fields, or shown
    differently."""
    seen: dict[str, list[tuple[str, argparse.Action]]] = {}
    for command, parser in parsers.items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    seen.setdefault(flag, []).append((command, action))
    problems = []
    for flag, uses in sorted(seen.items()):
        if len(uses) < 2:
            continue
        origins = {(spec.owner, spec.name) if (spec := getattr(action, "flag_spec", None)) else None
                   for _, action in uses}
        if None in origins:
            hand = [command for command, action in uses if not hasattr(action, "flag_spec")]
            problems.append(f"{flag}: written by hand in {', '.join(hand)}")
        elif len(origins) > 1:
            problems.append(f"{flag}: generated from {sorted(f'{o.__name__}.{n}' for o, n in origins)}")
        elif len({_definition(action) for _, action in uses}) > 1:
            problems.append(f"{flag}: shown differently by {', '.join(command for command, _ in uses)}")
    return problems


def test_commands_share_one_definition_of_every_common_flag():
    parsers = _parsers()
    assert shared_flag_problems(parsers) == []
    flags = {name: {f for a in p._actions for f in a.option_strings} for name, p in parsers.items()}
    common = flags["train_grpo.py"] & flags["tools/plan_budget.py"] & flags["tools/bench_longstraw.py"]
    assert {"--model", "--prompt-gradient", "--prompt-chunk-size", "--context-parallel-size"} <= common
    assert "--recompute-granularity" in flags["train_grpo.py"] & flags["tools/plan_budget.py"]
    assert "--fp8-format" in flags["train_grpo.py"] & flags["tools/bench_longstraw.py"]


@pytest.mark.parametrize("command", ["train_grpo.py", "tools/plan_budget.py", "tools/bench_longstraw.py"])
def test_every_flag_of_the_main_commands_is_a_configuration_field(command):
    """The trainer, the planner and the LongStraw benchmark define no flag of their own by hand."""
    parser = _parsers()[command]
    hand = [a.option_strings for a in parser._actions if a.option_strings != ["-h", "--help"]
            and not hasattr(a, "flag_spec")]
    assert hand == []


def test_the_shared_flag_check_can_fail():
    """A flag redefined by hand, even with the same help, or generated from another field, is
    caught; so is one shown differently."""
    parsers = _parsers()
    trainer, planner = parsers["train_grpo.py"], parsers["tools/plan_budget.py"]
    redefined = argparse.ArgumentParser()
    original = next(a for a in trainer._actions if "--prompt-gradient" in a.option_strings)
    redefined.add_argument("--prompt-gradient", choices=original.choices, help=original.help)
    assert shared_flag_problems({"trainer": trainer, "redefined": redefined}) == [
        "--prompt-gradient: written by hand in redefined"]
    other = cli.build_parser(TrainerConfig)
    action = next(a for a in other._actions if "--num-generations" in a.option_strings)
    action.flag_spec = cli.flag_spec(RolloutConfig, next(f for f in RolloutConfig.__dataclass_fields__.values()
                                                         if f.name == "max_response_length"))
    assert shared_flag_problems({"planner": planner, "other": other}) == [
        "--num-generations: generated from ['GRPOConfig.num_generations', 'RolloutConfig.max_response_length']"]
    shown = cli.build_parser(TrainerConfig)
    next(a for a in shown._actions if "--kl-coef" in a.option_strings).help = "another text"
    assert shared_flag_problems({"planner": planner, "shown": shown}) == ["--kl-coef: shown differently by planner, shown"]


def test_help_text_default_and_choices_come_from_the_field():
    spec = cli.flag_spec(LongStrawConfig, LongStrawConfig.__dataclass_fields__["prompt_gradient"])
    assert spec.flag == "--prompt-gradient" and spec.kwargs["choices"] == ["detached", "exact"]
    assert spec.kwargs["help"].startswith("detached: the prompt state is a constant (LongStraw); exact:")
    assert spec.kwargs["help"].endswith("(default: detached).")
    chunk = cli.flag_spec(LongStrawConfig, LongStrawConfig.__dataclass_fields__["prompt_chunk_size"])
    assert chunk.kwargs["type"] is int and chunk.kwargs["help"].endswith("(default: 32768).")


def test_parse_builds_the_groups_and_says_which_flags_were_given():
    config, given = cli.parse(PlannerConfig, ["--prompt-gradient", "exact", "--tensor-model-parallel-size", "2"])
    assert config.longstraw.prompt_gradient == "exact" and config.parallel.tensor_model_parallel_size == 2
    assert config.longstraw.prompt_chunk_size == 32768  # the trainer's default
    assert given == {"longstraw.prompt_gradient", "parallel.tensor_model_parallel_size"}
    bench, _ = cli.parse(BenchmarkConfig, ["--prompt-lengths", "4096,8192", "--modes", "longstraw"])
    assert bench.workload.prompt_lengths == (4096, 8192) and bench.full_prompt_lengths == (4096, 8192)
    with pytest.raises(SystemExit):  # argparse: the planner takes no trainer-only flag
        cli.parse(PlannerConfig, ["--lr", "0.1"])


def test_objects_built_in_code_are_held_to_the_flags_rules():
    with pytest.raises(ValueError, match="^--loss-aggregation must be one of token, sequence, got 'mean'$"):
        LossConfig(loss_aggregation="mean")
    with pytest.raises(ValueError, match="^--prompt-chunk-size must be >= 1, got 0$"):
        LongStrawConfig(prompt_chunk_size=0)
    with pytest.raises(ValueError, match="^--global-batch-size 3 must be divisible by the data-parallel size 2$"):
        cli.config_from(TrainerConfig, {"training.global_batch_size": 3}, world_size=2)
    config = TrainerConfig(world_size=2)
    assert config.data_parallel_size == 2 and config.lr_decay_iters == config.training.train_iters
    with pytest.raises(AttributeError):  # frozen: a derived value is a property, never written
        config.training.seed = 1


# ---- no argparse namespace below training/ -------------------------------------------------------

TRAINER_LAYER = ("training", "checkpointing", "console.py")
"""The modules of the trainer layer (``docs/architecture.md``); everything else is below it."""
COMMAND_LINE = "config/cli.py"
"""The one module below the trainer that turns a command line into configuration objects."""
NAMESPACE_NAMES = ("args", "namespace", "ns")


def namespace_problems(source: str, path: str) -> list[str]:
    """Where a module imports argparse, annotates with ``Namespace`` or reads attributes of a
    namespace by its usual names (``args.lr``), in line order."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names):
            problems.append(f"{path}:{node.lineno}: imports argparse")
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
            problems.append(f"{path}:{node.lineno}: imports from argparse")
        elif isinstance(node, ast.arg) and node.annotation is not None and "Namespace" in ast.unparse(node.annotation):
            problems.append(f"{path}:{node.lineno}: parameter {node.arg} annotated {ast.unparse(node.annotation)}")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in NAMESPACE_NAMES):
            problems.append(f"{path}:{node.lineno}: reads {node.value.id}.{node.attr}")
    return sorted(problems, key=lambda p: int(p.split(":")[1]))


def _below_the_trainer() -> list[Path]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.split("/")[0] not in TRAINER_LAYER and relative != COMMAND_LINE:
            out.append(path)
    return out


def test_no_module_below_training_reads_an_argparse_namespace():
    modules = _below_the_trainer()
    assert len(modules) > 100 and any(p.parts[-2] == "grpo" for p in modules)
    problems = [p for path in modules for p in namespace_problems(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert problems == []


def test_the_namespace_check_can_fail():
    source = ("import argparse\nfrom argparse import Namespace\n"
              "def loss(args: argparse.Namespace, x):\n    return args.kl_coef * x\n"
              "def hook(module, args):\n    return args[0]\n")
    assert namespace_problems(source, "m.py") == [
        "m.py:1: imports argparse", "m.py:2: imports from argparse",
        "m.py:3: parameter args annotated argparse.Namespace", "m.py:4: reads args.kl_coef"]


_HELP_PROBE = """
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
sys.path.insert(0, {tools!r})
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as end:
    assert end.code in (0, None), end.code
heavy = sorted({{"torch", "megatron"}} & {{name.split(".")[0] for name in sys.modules}})
print("HEAVY", heavy)
"""


@pytest.mark.parametrize("command", ["train_grpo.py", "tools/plan_budget.py", "tools/bench_longstraw.py",
                                     "tools/bench_decode.py", "tools/bench_fp8_attention.py",
                                     "tools/bench_linear_fp8.py", "tools/exact_gradient_check.py",
                                     "tools/fp8_sensitivity.py"])
def test_help_answers_before_torch_and_megatron_load(command):
    """``--help`` is built from the configuration alone: neither torch nor Megatron is imported
    (what made it take seconds)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _HELP_PROBE.format(tools=str(ROOT / "tools")), str(ROOT / command)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
