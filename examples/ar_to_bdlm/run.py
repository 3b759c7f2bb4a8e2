"""AR -> BDLM on CPU in about a minute: a tiny autoregressive Qwen3 model (random weights, built
locally with transformers) is converted to Megatron, trained for a few steps with the Fast-dLLM v2
objective, and exported back to Hugging Face format.

    python examples/ar_to_bdlm/run.py [--workdir /tmp/ar_to_bdlm] [--steps 30]

Steps (each one is what you would run on a real checkpoint, see docs/conversion.md):
1. Hugging Face folder (config.json + model.safetensors + tokenizer.json with a reserved
   `<|mask|>` token) -> `python -m megatron_csbp.convert hf-to-megatron`.
2. Fast-dLLM v2 training (complementary masks, token shift, mask token looked up by string).
   Choice: this example drives training with a short explicit loop over `BlockDiffusionModel` and
   torch AdamW, to show what one step is made of; the trainer runs the same objective on the
   converted checkpoint (`python -m megatron_csbp.train --load WORKDIR/megatron_ar --objective
   fast-dllm-v2 --mask-token "<|mask|>" ...`, see README.md here and docs/training.md).
3. The trained model is saved as a torch_dist checkpoint (the trainer's format) and exported with
   `python -m megatron_csbp.convert megatron-to-hf`; the exported model is reloaded with
   transformers and its logits are checked against the trained Megatron model's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

MASK = "<|mask|>"


def make_hf_model(path: str) -> None:
    """A tiny Qwen3 with a word-level tokenizer whose last added token is the reserved mask."""
    from tokenizers import Tokenizer, models

    from megatron_csbp.conversion.tiny import save_tiny_model

    save_tiny_model("qwen3", path, seed=0, vocab_size=128, tie_word_embeddings=False)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(120)}, unk_token="t0"))
    tok.add_special_tokens([MASK])  # id 120: reserved, never in the data; no embedding resize
    tok.save(os.path.join(path, "tokenizer.json"))


def batches(step: int, batch: int, seq: int):
    """Arithmetic sequences mod 120 (never the mask id): learnable in a few steps."""
    g = np.random.RandomState(step)
    start = g.randint(0, 120, size=(batch, 1))
    stride = g.randint(1, 4, size=(batch, 1))
    tokens = (start + stride * np.arange(seq)[None]) % 120
    index = torch.arange(step * batch, (step + 1) * batch)  # global sample index: keys the noise
    return torch.from_numpy(tokens), index


def convert(*args: str) -> None:
    cmd = [sys.executable, "-m", "megatron_csbp.convert", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def train(meg: str, trained: str, steps: int, seq: int, block: int, batch: int, lr: float) -> None:
    from megatron_csbp.conversion.api import ARScorer
    from megatron_csbp.checkpoint.files import ASSETS_DIR
    from megatron_csbp.checkpoint.model import load_checkpoint_model, save_gpt_model, single_process_megatron
    from megatron_csbp.conversion.hf_io import copy_assets
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import AutoregressiveObjective, FastDLLMv2Objective
    from megatron_csbp.objectives.fast_dllm_v2 import resolve_mask_token

    with single_process_megatron():
        gpt, info = load_checkpoint_model(meg, params_dtype=torch.float32)
        shape = info.shape
        mask_id = resolve_mask_token(MASK, os.path.join(meg, ASSETS_DIR), shape.vocab_size)
        print(f"mask token {MASK!r} -> id {mask_id} (vocab {shape.vocab_size}, no resize)")
        layout = SequenceLayout(BlockGeometry(seq, block))
        model = BlockDiffusionModel(gpt, FastDLLMv2Objective(block, mask_id, seed=1234), layout)
        ar = BlockDiffusionModel(gpt, AutoregressiveObjective(), layout)
        held_out, held_index = batches(10_000, batch, seq)
        opt = torch.optim.AdamW(gpt.parameters(), lr=lr, weight_decay=0.0)

        def evaluate():
            with torch.no_grad():
                return float(model(held_out, sample_index=held_index).loss), float(ar(held_out).loss)

        bd, arl = evaluate()
        print(f"before: fast-dllm-v2 eval loss {bd:.4f}  AR eval loss {arl:.4f}")
        t0 = time.time()
        for step in range(steps):
            tokens, index = batches(step, batch, seq)
            out = model(tokens, sample_index=index)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
            opt.step()
            if step % 10 == 0 or step == steps - 1:
                print(f"step {step:3d}  fast-dllm-v2 loss {out.loss.item():.6f}  targets {int(out.num_targets)}")
        bd, arl = evaluate()
        print(f"after {steps} steps ({time.time() - t0:.1f}s): fast-dllm-v2 eval loss {bd:.6f}  AR eval loss {arl:.4f}")
        save_gpt_model(gpt, shape, trained)
        copy_assets(os.path.join(meg, ASSETS_DIR), os.path.join(trained, ASSETS_DIR))
        with torch.no_grad():
            logits = ARScorer(gpt, seq)(held_out).numpy()
    np.save(os.path.join(trained, "heldout_logits.npy"), logits)
    np.save(os.path.join(trained, "heldout_tokens.npy"), held_out.numpy())


def check_export(trained: str, exported: str) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    model.eval()
    tokens = torch.from_numpy(np.load(os.path.join(trained, "heldout_tokens.npy")))
    with torch.no_grad():
        ref = model(tokens).logits.numpy()
    diff = float(np.abs(ref - np.load(os.path.join(trained, "heldout_logits.npy"))).max())
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(exported, "tokenizer.json"))
    print(f"exported model reloaded by transformers: max |logits - trained Megatron logits| = {diff:.2e}; "
          f"tokenizer maps {MASK!r} -> {tok.convert_tokens_to_ids(MASK)}")
    return diff


def main() -> int:
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/ar_to_bdlm")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-3)
    a = p.parse_args()
    torch.set_num_threads(1)
    shutil.rmtree(a.workdir, ignore_errors=True)
    hf, meg, trained, exported = (os.path.join(a.workdir, n) for n in ("hf_ar", "megatron_ar", "megatron_bdlm", "hf_bdlm"))
    make_hf_model(hf)
    convert("hf-to-megatron", "--hf-path", hf, "--output", meg)
    train(meg, trained, a.steps, a.seq_length, a.block_size, a.batch_size, a.lr)
    convert("megatron-to-hf", "--load", trained, "--output", exported)
    diff = check_export(trained, exported)
    if diff > 1e-4:
        print("export check FAILED", file=sys.stderr)
        return 1
    print(f"done: {exported}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
