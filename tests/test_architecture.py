"""The package's structure as ``docs/architecture.md`` states it: every path the page names
exists, there is no import cycle, and the layers import only downwards."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_longstraw"
TOP_LEVEL = ("megatron_longstraw/", "tools/", "tests/", "docs/", "examples/", "scripts/")


def _doc_paths(text: str) -> list[str]:
    """Backticked module paths of a page: ``x/y.py``, ``x.py`` or a folder ``x/``."""
    return [t for t in re.findall(r"`([^`\s]+)`", text)
            if re.fullmatch(r"[\w./-]+(\.py|/)", t) and not t.startswith(("-", "."))]


def _resolve(path: str) -> Path:
    return ROOT / path if path.startswith(TOP_LEVEL) or path == "train_grpo.py" else PACKAGE / path


def test_every_module_path_in_the_architecture_page_exists():
    paths = _doc_paths((ROOT / "docs" / "architecture.md").read_text())
    assert len(paths) > 30, paths  # the page names the modules of every step
    missing = [p for p in paths if not _resolve(p).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_doc_path_check_catches_a_missing_module():
    """The check above can fail: a page naming a module that does not exist is caught."""
    paths = _doc_paths("`core/binding.py` and `longstraw/context_parallel.py`, `tools/` and `--flag`")
    assert paths == ["core/binding.py", "longstraw/context_parallel.py", "tools/"]
    assert [p for p in paths if not _resolve(p).exists()] == ["longstraw/context_parallel.py"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, module_level: bool) -> set[str]:
    """Package modules imported at module level (or inside functions, ``module_level=False``)."""
    nodes = tree.body if module_level else [
        sub for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for sub in ast.walk(node)]
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_longstraw"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                is_module = (ROOT / (full.replace(".", "/") + ".py")).exists()
                out.add(full if is_module else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("megatron_longstraw"))
    return out


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(ast.parse(p.read_text()), True) for p in sorted(PACKAGE.rglob("*.py"))}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    colour, stack, found = {}, [], []

    def visit(node):
        colour[node] = "grey"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if colour.get(dep) == "grey":
                found.append(stack[stack.index(dep):] + [dep])
            elif dep in graph and dep not in colour:
                visit(dep)
        stack.pop()
        colour[node] = "black"

    for node in sorted(graph):
        if node not in colour:
            visit(node)
    return found


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("package, forbidden", [
    ("config", ("core", "attention", "ops", "models", "longstraw", "rollout", "grpo", "training", "data", "rewards",
                "checkpointing", "testing", "planning", "distributed", "patches", "console")),
    ("core", ("attention", "models", "longstraw", "rollout", "grpo", "training", "data", "rewards",
              "checkpointing", "testing", "planning")),
    ("attention", ("models", "longstraw", "rollout", "training", "testing", "planning")),
    ("models", ("longstraw", "rollout", "training", "testing", "planning")),
    ("longstraw", ("rollout", "training", "testing", "planning")),
    ("planning", ("longstraw", "rollout", "grpo", "training", "data", "rewards", "checkpointing", "testing")),
])
def test_layers_import_only_downwards(package, forbidden):
    bad = sorted((mod, dep) for mod, deps in _graph().items() if mod.startswith(f"megatron_longstraw.{package}.")
                 for dep in deps if dep.split(".")[1] in forbidden)
    assert not bad, f"{package}/ imports a layer above it: {bad}"


@pytest.mark.parametrize("package", ["core", "longstraw"])
def test_no_function_level_imports(package):
    bad = sorted((_module_name(p), dep) for p in sorted((PACKAGE / package).rglob("*.py"))
                 for dep in _imports(ast.parse(p.read_text()), False))
    assert not bad, f"function-level imports in {package}/: {bad}"
