"""End to end (slow): the DFlash example on a small budget: verifier trained here, features captured
from the shipped corpus, drafter trained with CSBP on 2 ranks, exported, run by transformers' DFlash
decoding against the verifier: greedy outputs identical to the verifier alone."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_dflash_example_end_to_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "dflash", "run.py"), "--workdir", str(tmp_path),
                    "--verifier-steps", "60", "--drafter-steps", "20", "--max-prompts", "96",
                    "--eval-sequences", "4", "--max-new-tokens", "24"], check=True, env=env, cwd=ROOT)
    report = json.load(open(tmp_path / "evaluate.json"))
    ev = report["evaluate"]
    assert ev["identical"] is True
    assert ev["new_tokens"] == 4 * 24
    # every verifier step yields at least its own token; drafted tokens only add to that
    assert ev["tokens_per_step"] >= 1.0 and ev["verifier_steps"] <= ev["verifier_steps_alone"]
    assert report["drafter_history"]["step"] == 20
    # the measured acceptance length within the bound derived from the estimator on the same
    # documents at serving's anchors (docs/dflash.md)
    lo, hi = ev["measured_acceptance_length_bound"]
    assert lo - 1e-12 <= ev["measured_acceptance_length"] <= hi + 1e-12
