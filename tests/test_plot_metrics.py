"""``tools/plot_metrics.py``: runs side by side with reference levels, and its bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import plot_metrics  # noqa: E402


def _run(folder: Path, rewards, evals=None) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for step, reward in enumerate(rewards, 1):
        row = {"step": step, "reward/mean": reward}
        if evals and step in evals:
            row["eval/greedy_reward"] = evals[step]
        lines.append(json.dumps(row))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "metrics.jsonl"


def test_two_runs_side_by_side(tmp_path, capsys):
    exact = _run(tmp_path / "exact", [0.1] * 5 + [0.9] * 5, evals={5: 0.2, 10: 0.95})
    detached = _run(tmp_path / "detached", [0.1] * 10, evals={5: 0.1, 10: 0.3})
    out = tmp_path / "fig" / "learning.png"
    plot_metrics.main([f"exact={exact}", str(detached), "--keys", "reward/mean,eval/greedy_reward",
                       "--window", "5", "--hline", "0.333:format ceiling", "--output", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not out.with_name("learning.png.partial").exists()
    table = capsys.readouterr().out
    # each run's first and last window: the per-step metric over 5 steps, eval as logged
    assert "| exact | reward/mean | 0.1000 | 0.9000 |" in table
    assert "| detached | reward/mean | 0.1000 | 0.1000 |" in table
    assert "| exact | eval/greedy_reward | 0.2000 | 0.9500 |" in table
    assert "| detached | eval/greedy_reward | 0.1000 | 0.3000 |" in table


@pytest.mark.parametrize("extra,message", [
    (["--keys", "loss/policy"], "has no metric 'loss/policy'"),
    (["--hline", "high:ceiling"], "--hline 'high:ceiling': expected VALUE:LABEL"),
    (["--window", "0"], "--window must be >= 1"),
])
def test_bad_input_is_one_line(tmp_path, extra, message):
    run = _run(tmp_path / "a", [0.5, 0.6])
    out = tmp_path / "a.png"
    result = subprocess.run([sys.executable, str(ROOT / "tools/plot_metrics.py"), str(run), "--output", str(out), *extra],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and not out.exists()
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and message in result.stderr


def test_a_bad_line_names_its_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2,\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not JSON"):
        plot_metrics.read_rows(path)
    with pytest.raises(ValueError, match="no such file"):
        plot_metrics.read_rows(tmp_path / "missing.jsonl")
