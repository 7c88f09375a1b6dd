"""Where a benchmark tool's results land, and the command that made them: ``{output_dir}/{stem}.json`` (the raw record, with the
command) and ``{stem}.md`` (the table, with the command), ``stem`` naming the tool, the model
and the run's tag."""

import json
import shlex
import sys
from pathlib import Path


def command_line(argv=None) -> str:
    """The command that runs the tool with ``argv`` (``sys.argv[1:]`` when ``None``), as the
    results record it: ``python tools/<tool>.py ...``."""
    return "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])


def bench_stem(kind: str, model: str, tag: str = "") -> str:
    """``{kind}_{model}`` with ``_{tag}`` when a tag is given."""
    return f"{kind}_{model}{('_' + tag) if tag else ''}"


def write_bench_files(output_dir, stem: str, record: dict, lines: list[str]) -> Path:
    """Write ``record`` as JSON and ``lines`` as markdown; returns the folder."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return out
