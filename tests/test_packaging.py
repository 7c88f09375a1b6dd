"""The project as an installed package: pyproject.toml mirrors requirements.txt, the environment of
scripts/setup_env.sh imports the package from any working directory (so do the entry scripts),
and the example launch scripts run in that environment."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import megatron_longstraw

ROOT = Path(__file__).resolve().parents[1]


def _requirement_lines(path: Path) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def test_pyproject_dependencies_are_requirements_txt():
    """``pip install -e .`` installs what requirements.txt pins (pytest as the ``test`` extra);
    the GPU packages only as the ``gpu`` extra, so a CPU install never builds them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dependencies = set(project["project"]["dependencies"])
    extras = project["project"]["optional-dependencies"]
    assert dependencies | set(extras["test"]) == _requirement_lines(ROOT / "requirements.txt")
    assert not dependencies & set(extras["gpu"])
    assert project["project"]["requires-python"] == ">=3.12"
    assert project["tool"]["setuptools"]["packages"]["find"]["include"][0] == "megatron_longstraw"


def test_the_environment_imports_the_package_from_any_directory(tmp_path):
    """Outside the repository and without PYTHONPATH (``-E``), the package imports (setup_env.sh
    installs it in editable mode) and the entry scripts answer ``--help``."""
    run = [sys.executable, "-E"]
    probe = subprocess.run([*run, "-c", "import importlib.metadata as m, megatron_longstraw as p; "
                                        "print(m.version('megatron-longstraw'), p.__version__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, f"run `bash scripts/setup_env.sh` (or pip install -e .): {probe.stderr[-500:]}"
    assert probe.stdout.split() == [megatron_longstraw.__version__] * 2
    for script in ("train_grpo.py", "tools/convert_checkpoint.py"):
        result = subprocess.run([*run, str(ROOT / script), "--help"], cwd=tmp_path, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.startswith("usage:"), (script, result.stderr[-1000:])


def _stub(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)
    return path


def test_the_tiny_demo_runs_in_the_project_environment(tmp_path):
    """``examples/tiny_cpu_demo.sh`` runs the interpreter scripts/setup_env.sh prints (here a
    stand-in venv, LONGSTRAW_VENV, whose python records its arguments), not ``python`` from PATH;
    PYTHON picks another one."""
    last_call = tmp_path / "last_call"
    venv = tmp_path / "venv"
    _stub(venv / "bin" / "python", f'printf "%s\\0" "$@" > "{last_call}"')
    (venv / ".requirements.sha256").write_text(
        subprocess.run(["sha256sum", str(ROOT / "requirements.txt")], capture_output=True, text=True,
                       check=True).stdout.split()[0] + "\n")
    for name in ("python", "python3", "torchrun"):
        _stub(tmp_path / "path" / name, f'echo "{name} from PATH" >&2; exit 3')
    env = {**os.environ, "PATH": f"{tmp_path / 'path'}{os.pathsep}{os.environ['PATH']}",
           "LONGSTRAW_VENV": str(venv)}
    env.pop("PYTHON", None)
    result = subprocess.run(["bash", str(ROOT / "examples" / "tiny_cpu_demo.sh"), "--seed", "7"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    last = last_call.read_text().split("\0")[:-1]
    assert last[0] == "train_grpo.py" and last[-2:] == ["--seed", "7"], last

    other = _stub(tmp_path / "other" / "python", f'printf "%s\\0" "$@" > "{tmp_path / "other_call"}"')
    subprocess.run(["bash", str(ROOT / "examples" / "tiny_cpu_demo.sh")], env={**env, "PYTHON": str(other)},
                   check=True, capture_output=True, timeout=60)
    assert (tmp_path / "other_call").read_text().split("\0")[0] == "train_grpo.py"
