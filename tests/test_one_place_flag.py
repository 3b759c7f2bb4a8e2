"""A model flag is a one-place change (issue 42): one `Option` added to `config/options.py` in a copy
of the package, nothing else edited, reaches the parser, the flag-built model's `TransformerConfig`
(and through it the attention: the loss changes), the checkpoint's saved model args
(bdlm_meta.json) and the Hugging Face export (config.json), and its command-line value round-trips.

The flag: `--softmax-scale`, megatron-core's `TransformerConfig.softmax_scale` (the attention's
logit scale, handed to the core attention by Megatron's `SelfAttention`)."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.train_helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the one line added to OPTIONS
LINE = ('    O(("--softmax-scale",), float, None, "attention logit scale (default: 1/sqrt(--kv-channels))", '
        'group="transformer", config="softmax_scale", saved=True, hf="softmax_scale"),\n')
ANCHOR = "]\ndel O\n"


def copy_with_option(tmp_path) -> str:
    root = str(tmp_path / "copy")
    shutil.copytree(os.path.join(ROOT, "megatron_csbp"), os.path.join(root, "megatron_csbp"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = os.path.join(root, "megatron_csbp", "config", "options.py")
    text = open(path).read()
    assert text.count(ANCHOR) == 1, "the end of OPTIONS moved: update ANCHOR"
    open(path, "w").write(text.replace(ANCHOR, LINE + ANCHOR))
    return root


def run(root, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


#: in the copy: the parsed value, the text that sets it, the flag-built model's TransformerConfig field
PROBE = """
import sys
from megatron_csbp.config.options import flag_text
from megatron_csbp.training.arguments import model_args, parse_args
from megatron_csbp.model.assemble import transformer_config
argv = sys.argv[1:]
run = parse_args(argv, 1)
text = flag_text("softmax_scale", run.softmax_scale)
again = parse_args(argv + text.split(), 1).softmax_scale
print(run.softmax_scale, text, again, transformer_config(model_args(run)).softmax_scale)
"""


@pytest.mark.slow
def test_one_option_reaches_parser_config_checkpoint_and_export(tmp_path):
    root = copy_with_option(tmp_path)
    tiny = TINY + ["--train-iters", "1", "--seed", "3"]
    assert run(root, "-c", PROBE, *tiny, "--softmax-scale", "0.3").split() == ["0.3", "--softmax-scale", "0.3",
                                                                               "0.3", "0.3"]
    losses = {}
    for scale in (None, "0.3"):
        save, log = str(tmp_path / f"ckpt{scale}"), str(tmp_path / f"log{scale}.jsonl")
        run(root, "-m", "megatron_csbp.train", *tiny, "--save", save, "--log-json", log,
            *(("--softmax-scale", scale) if scale else ()))
        losses[scale] = [json.loads(line)["loss"] for line in open(log) if '"loss"' in line][0]
    assert losses[None] != losses["0.3"]  # the scale reached the attention
    meta = glob.glob(os.path.join(save, "iter_*", "bdlm_meta.json"))
    assert len(meta) == 1 and json.load(open(meta[0]))["model_args"]["softmax_scale"] == 0.3
    hf = str(tmp_path / "hf")
    run(root, "-m", "megatron_csbp.convert", "megatron-to-hf", "--load", save, "--output", hf)
    assert json.load(open(os.path.join(hf, "config.json")))["softmax_scale"] == 0.3
