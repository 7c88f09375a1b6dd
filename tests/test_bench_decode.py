"""tools/bench_decode.py on a tiny model (CPU): the per-step figures, the bytes a step reads, and
transformers' generate beside it on the same weights, greedy tokens equal."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_decode  # noqa: E402


def test_step_seconds_leave_out_the_warmup():
    assert bench_decode.step_seconds([1.0, 1.5, 2.0, 2.5], 2) == pytest.approx(0.5)
    assert bench_decode.step_seconds([1.0, 2.0], 0) == pytest.approx(1.0)


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_decode_bench_end_to_end_and_greedy_parity_with_transformers(tmp_path, preset):
    bench_decode.main(["--model", preset, "--prompt-lengths", "40,72", "--group-sizes", "1,3", "--hf-group-sizes", "3",
                       "--new-tokens", "5", "--warmup-steps", "2", "--temperature", "0", "--prompt-chunk-size", "32",
                       "--output-dir", str(tmp_path), "--profile", "3"])
    record = json.loads((tmp_path / f"decode_{preset}.json").read_text())
    assert [p["prompt_length"] for p in record["results"]] == [40, 72]
    for point in record["results"]:
        short, long_ = point["ours"]
        assert short["group"] == 1 and long_["group"] == 3 and short["per_step_s"] > 0
        # each step reads the weights and the shared prompt state once, plus every sample's own state
        assert long_["bytes_per_step"] - short["bytes_per_step"] == pytest.approx(
            2 * long_["decode_state_gib"] / 3 * 2 ** 30, rel=1e-6)
        assert short["reads_everything"] == (preset == "qwen3.5-debug")
        assert (short["bandwidth_fraction"] is None) == (preset == "glm-5-debug")
        (theirs,) = point["hf"]
        assert theirs["tokens_match"] is True, (theirs["tokens"], long_["tokens"])
        assert 0 < theirs["prefill_s"] < theirs["total_s"] and 0 < theirs["per_step_s"] < theirs["total_s"]
    profile = (tmp_path / f"decode_{preset}_profile_72.txt").read_text()
    assert profile.startswith("3 samples, 5 tokens") and "by CPU time" in profile
    assert "transformers `generate`" in (tmp_path / f"decode_{preset}.md").read_text()


def test_bad_flags_are_one_line(capsys):
    with pytest.raises(ValueError, match=r"--new-tokens 9 must be at least --warmup-steps 8 \+ 2"):
        bench_decode.parse_args(["--new-tokens", "9"])
