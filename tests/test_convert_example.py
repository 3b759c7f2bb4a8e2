"""The AR -> BDLM example runs end to end on CPU (tiny model, ~1 minute): conversion, Fast-dLLM v2
training that lowers the loss, export that transformers reloads with the same logits."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_ar_to_bdlm_example(tmp_path):
    r = subprocess.run([sys.executable, "examples/ar_to_bdlm/run.py", "--workdir", str(tmp_path / "w"), "--steps", "40"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    before = float(re.search(r"before: fast-dllm-v2 eval loss ([\d.]+)", r.stdout).group(1))
    after = float(re.search(r"after \d+ steps .*?fast-dllm-v2 eval loss ([\d.]+)", r.stdout).group(1))
    assert after < before - 0.5, (before, after)
    assert "done:" in r.stdout and os.path.isfile(tmp_path / "w" / "hf_bdlm" / "model.safetensors")
