"""examples/sft_agent/run.py runs as its README says: tool-use trajectories rendered by a chat
template, trained under CSBP on 2 ranks for a tiny DiffusionGemma and a tiny Qwen3-style model,
exported and decoded by transformers' `generate` from the same template."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # two conversions, two 2-rank trainings, two exports (~2 min on 2 cores)
def test_sft_agent_example_runs(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "sft_agent", "run.py"), "--workdir",
                        str(tmp_path), "--train-iters", "2"], capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name, masks in (("diffusiongemma", "its generation markers"), ("qwen3", "rendered prefixes")):
        assert f"[{name}] transformers generate:" in r.stdout
        assert os.path.isfile(tmp_path / name / "export" / "chat_template.jinja")
        assert f"rendered with the tokenizer's chat template (loss masks from {masks})" in r.stdout
    assert r.stdout.count("[[") >= 2  # inspect's supervised spans
