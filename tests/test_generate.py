"""Generation from a real checkpoint: KV-cached decoding equals the recompute path, runs end to end."""
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import train_rank

SP = ("--data-path {prefix} --split 100,0,0 --num-layers 2 --hidden-size 32 --num-attention-heads 4 "
      "--num-query-groups 2 --seq-length 32 --block-size 8 --micro-batch-size 2 --global-batch-size 2 "
      "--train-iters 2 --log-interval 1 --no-progress-bar")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from megatron_csbp.data.preprocess import main as preprocess_main
    tmp = tmp_path_factory.mktemp("gen")
    prefix = preprocess_main(["--input", "shipped", "--output-prefix", str(tmp / "corpus"), "--append-eod"])
    save = str(tmp / "ckpt")
    # Saved under CSBP on 2 ranks; generation loads it into one process.
    run_distributed(train_rank, 2, SP.format(prefix=prefix).split() + [
        "--context-parallel-size", "2", "--block-parallel-size", "2", "--save", save,
        "--data-cache-path", str(tmp / "cache")])
    return save


def _compare(rank, world_size, save):
    from megatron_csbp.data.megatron_data import build_tokenizer
    from megatron_csbp.generate import BlockDiffusionSampler, load_for_generation
    model, margs, step = load_for_generation(save)
    tok = build_tokenizer("SentencePieceTokenizer", None, None)
    prompt = tok.tokenize("The for statement is used to iterate")
    out = {}
    logits = {}
    for cache in (True, False):
        s = BlockDiffusionSampler(model.bdlm, margs["vocab_size"], margs["mask_token_id"], tok.eod,
                                  margs["block_size"], kv_cache=cache)
        out[cache] = s.generate(prompt, 20, max_length=32)
        # Logits of one denoising step of block 1 with the first 10 tokens clean.
        toks = (prompt * 3)[:8] + [margs["mask_token_id"]] * 8
        from megatron_csbp.layout.masks import BlockGeometry
        s.state.geometry = BlockGeometry(16, 8)
        s.state.kv.clear()
        if cache:
            s._clean_rows(toks, 0, 8)
        logits[cache] = s.block_logits(toks, 1).float()
        for m in model.modules():  # unwrap for the next sampler
            if hasattr(m, "core_attention") and hasattr(m.core_attention, "inner"):
                m.core_attention = m.core_attention.inner
    return dict(out=out, logits=logits, step=step)


def test_kv_cache_matches_recompute(checkpoint):
    r = run_distributed(_compare, 1, checkpoint)[0]
    assert r["step"] == 2
    assert torch.allclose(r["logits"][True], r["logits"][False], rtol=1e-4, atol=1e-5)
    assert r["out"][True] == r["out"][False]
    assert 0 < len(r["out"][True]) <= 20


def test_cli(checkpoint):
    res = subprocess.run([sys.executable, "-m", "megatron_csbp.generate", "--load", checkpoint, "--prompt",
                          "The if statement", "--max-new-tokens", "16"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "iteration 2" in res.stdout and "The if statement" in res.stdout
