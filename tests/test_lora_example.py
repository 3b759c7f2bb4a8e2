"""The LoRA example runs end to end on CPU (tiny Qwen3, ~1.5 minutes): conversion, LoRA fine-tuning
under CSBP on 2 gloo ranks, export as a PEFT adapter that peft loads with the Megatron model's logits."""
import os
import re
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_lora_example(tmp_path):
    r = subprocess.run([sys.executable, "examples/lora/run.py", "--workdir", str(tmp_path / "w")], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    moved, diff = map(float, re.search(r"move the logits by ([\d.e+-]+); max \|megatron \+ LoRA - peft\| = ([\d.e+-]+)",
                                       r.stdout).groups())
    assert moved > 1e-3 and diff <= 1e-4
    assert "layout csbp" in r.stdout + r.stderr and "done: same logits" in r.stdout
    assert re.search(r"\[checkpoint .*lora iteration \d+; \d+ forward calls\]", r.stdout)  # generate --load LORA
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "w" / "adapter"))
