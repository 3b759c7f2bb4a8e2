"""Generation from a real checkpoint: KV-cached decoding equals the recompute path (step-wise and
Fast-dLLM threshold decoding), runs end to end, prints text by default, takes ids on NullTokenizer
checkpoints."""
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
    from megatron_csbp.checkpoint.model import load_for_generation
    from megatron_csbp.generation.bd3lm import BlockDiffusionSampler
    model, margs, step = load_for_generation(save)
    tok = build_tokenizer("SentencePieceTokenizer", None, None)
    prompt = tok.tokenize("The for statement is used to iterate")
    out, logits = {}, {}
    for cache in (True, False):
        s = BlockDiffusionSampler(model, margs["vocab_size"], margs["mask_token_id"], tok.eod,
                                  margs["block_size"], use_cache=cache)
        out[cache] = s.generate(prompt, 20, max_length=32)
        out[cache, "threshold"] = s.generate(prompt, 20, max_length=32, threshold=0.05)
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
    # fp32 (u = 2^-24 ~ 6e-8). The cached clean K/V were computed in an earlier forward over other
    # row counts, so CPU matmul kernels may block the same dot products differently: each logit is
    # dots of length <= 64 (hidden 32, ffn) through 2 layers and the LM head, each moving by <= K u
    # sum|terms| ~ 4e-6 of the magnitudes (|logits| < 10 here), i.e. ~1e-5 relative over the 3 stages.
    # Bounds rtol 1e-4 + atol 1e-5 leave 10x (measured: 1.2e-7); a stale or misplaced cache entry
    # moves logits by O(1).
    diff = (r["logits"][True] - r["logits"][False]).abs().max()
    print(f"KV cache vs recompute: max |logit diff| {float(diff):.2e}")
    assert torch.allclose(r["logits"][True], r["logits"][False], rtol=1e-4, atol=1e-5)
    assert r["out"][True] == r["out"][False]
    assert 0 < len(r["out"][True]) <= 20
    # Fast-dLLM's threshold: the same tokens with and without the cache
    assert r["out"][True, "threshold"] == r["out"][False, "threshold"] and len(r["out"][True, "threshold"]) > 0


def _api_text(rank, world_size, save, prompt_text):
    """The generation of the Python API (BlockDiffusionSampler, whose decoding the tests above pin)
    with the settings the CLI test passes explicitly."""
    from megatron_csbp.data.megatron_data import build_tokenizer
    from megatron_csbp.checkpoint.model import load_for_generation
    from megatron_csbp.generation.bd3lm import BlockDiffusionSampler

    model, margs, _ = load_for_generation(save)
    tok = build_tokenizer("SentencePieceTokenizer", None, None)
    s = BlockDiffusionSampler(model, margs["vocab_size"], margs["mask_token_id"], tok.eod, margs["block_size"])
    prompt = tok.tokenize(prompt_text)
    out = s.generate(prompt, 16, None, 0.0, 0, max_length=margs["seq_length"], order="confidence")
    return tok.detokenize(prompt + out)


@pytest.mark.slow  # suite budget (docs/testing.md): generate's CLI also runs in test_data_hf_tokenizer's train-and-generate
def test_cli(checkpoint):
    """The CLI prints the checkpoint it loaded and the API's generation for the same settings."""
    res = subprocess.run([sys.executable, "-m", "megatron_csbp.generate", "--load", checkpoint, "--prompt",
                          "The if statement", "--max-new-tokens", "16", "--temperature", "0", "--seed", "0",
                          "--unmask-order", "confidence"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.rstrip("\n").split("\n")
    assert lines[0].startswith(f"[checkpoint {checkpoint} iteration 2; ")
    expected = run_distributed(_api_text, 1, checkpoint, "The if statement")[0]
    assert expected.startswith("The if statement")
    assert "\n".join(lines[1:]) == expected
    bad = subprocess.run([sys.executable, "-m", "megatron_csbp.generate", "--load", checkpoint, "--prompt", "x",
                          "--threshold", "1.5"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert bad.returncode == 2 and "--threshold must be in (0, 1], got 1.5" in bad.stderr


def _generate_ids(rank, world_size, save):
    from megatron_csbp.checkpoint.model import load_for_generation
    from megatron_csbp.generation.bd3lm import BlockDiffusionSampler

    model, margs, step = load_for_generation(save)
    out = {}
    for cache in (True, False):
        s = BlockDiffusionSampler(model, margs["vocab_size"], margs["mask_token_id"], margs["eod_token_id"],
                                  margs["block_size"], use_cache=cache)
        out[cache] = s.generate([5, 6, 7, 8, 9], 12, max_length=32)
        for m in model.modules():  # unwrap for the next sampler
            if hasattr(m, "core_attention") and hasattr(m.core_attention, "inner"):
                m.core_attention = m.core_attention.inner
    qk_norm = any("q_layernorm" in name for name, _ in model.gpt.named_parameters())
    return dict(out=out, qk_norm=qk_norm)


@pytest.mark.slow  # suite budget (docs/testing.md)
def test_converted_model_trained_as_bd3lm_generates_and_other_objectives_are_refused(tmp_path):
    """A Hugging Face model converted, trained with BD3-LM and saved is rebuilt from its shape file
    for decoding; checkpoints of objectives this sampler does not decode are refused by name."""
    pytest.importorskip("transformers")
    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.tiny import save_tiny_model

    hf, meg, save = str(tmp_path / "hf"), str(tmp_path / "meg"), str(tmp_path / "save")
    save_tiny_model("qwen3", hf, seed=1)
    api.hf_to_megatron_checkpoint(hf, meg)
    base = ["--load", meg, "--mock-data", "--seq-length", "32", "--block-size", "8", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--log-interval", "1", "--no-progress-bar"]
    # One process for all of it (each spawn costs a Megatron import). A checkpoint saved under CSBP
    # loading into one process is the fixture's case above.
    ar = str(tmp_path / "ar")
    r = run_distributed(_train_generate_refuse, 1, base, save, ar)[0]
    assert r["out"][True] == r["out"][False] and 0 < len(r["out"][True]) <= 12
    assert r["qk_norm"]  # Qwen3's QK-norm: the model came from the shape file, not from flags
    assert "checkpoint objective is 'ar'" in r["refusal"]
    # --mock-data trains with a NullTokenizer: --prompt takes ids, and says so when given words
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megatron_csbp.generate", "--load", save]
    bad = subprocess.run(cmd + ["--prompt", "hello"], capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "this checkpoint has a NullTokenizer" in bad.stderr and "--prompt '5 17 42'" in bad.stderr
    ok = subprocess.run(cmd + ["--prompt", "5 6 7", "--max-new-tokens", "8", "--output", str(tmp_path / "ids.npy")],
                        capture_output=True, text=True, timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    import numpy as np

    ids = np.load(tmp_path / "ids.npy")
    assert ids.shape[0] == 1 and 3 < ids.shape[1] <= 11 and ids[0, :3].tolist() == [5, 6, 7]


def _train_generate_refuse(rank, world_size, base, save, ar):
    import torch.distributed as dist

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.checkpoint.model import load_for_generation

    train_rank(rank, world_size, base + ["--train-iters", "1", "--mask-token-id", "127", "--save", save])
    out = _generate_ids(rank, world_size, save)
    bps.destroy_block_parallel()
    dist.destroy_process_group()
    train_rank(rank, world_size, base + ["--train-iters", "1", "--objective", "ar", "--save", ar])
    with pytest.raises(ValueError) as err:
        load_for_generation(ar)
    out["refusal"] = str(err.value)
    return out
