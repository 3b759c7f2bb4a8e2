"""LoRA fine-tuning -> PEFT adapter on CPU in about a minute: a tiny Qwen3 (random weights, built
locally with transformers) is converted to Megatron, fine-tuned with LoRA under CSBP (CP 2 x BP 2) on
2 gloo ranks, exported as a PEFT adapter, loaded by peft onto the Hugging Face model, and checked to
give the same logits as the Megatron model with its adapters.

    python examples/lora/run.py [--workdir /tmp/lora_example] [--steps 4]

Each step is a command you would run on a real checkpoint (docs/lora.md#worked-example):
1. `python -m megatron_csbp.convert hf-to-megatron --hf-path HF --output MEG`
2. `torchrun --nproc-per-node 2 -m megatron_csbp.train --pretrained-checkpoint MEG --save LORA
   --lora-rank 4 ...`: the base frozen, the adapters trained and saved alone (a LoRA checkpoint)
3. `python -m megatron_csbp.convert megatron-to-hf --load LORA --output ADAPTER`: adapter_config.json
   + adapter_model.safetensors
4. `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(HF), ADAPTER)` against
   `python -m megatron_csbp.convert score --load LORA` (the LoRA checkpoint's base with its adapters);
   `python -m megatron_csbp.generate --load LORA` decodes the LoRA checkpoint the same way.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SEQ, BLOCK = 32, 4
#: float32 on both sides: the HF-parity tolerance of tests/test_convert_equivalence.py
TOLERANCE = 1e-4


def run(*cmd: str) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run([sys.executable, *cmd], check=True, cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/lora_example")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args(argv)
    shutil.rmtree(a.workdir, ignore_errors=True)
    hf, meg, lora, adapter = (os.path.join(a.workdir, n) for n in ("hf", "megatron", "lora", "adapter"))

    from megatron_csbp.conversion.tiny import save_tiny_model

    save_tiny_model("qwen3", hf, seed=0)  # vocabulary 128: id 127 is the mask, never in the mock data
    run("-m", "megatron_csbp.convert", "hf-to-megatron", "--hf-path", hf, "--output", meg)
    run("-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megatron_csbp.train",
        "--pretrained-checkpoint", meg, "--save", lora, "--save-interval", str(a.steps), "--train-iters", str(a.steps),
        "--context-parallel-size", "2", "--block-parallel-size", "2",  # CSBP on 2 ranks
        "--lora-rank", "4", "--lora-alpha", "8",
        "--objective", "bd3lm", "--mask-token-id", "127", "--mock-data", "--seq-length", str(SEQ),
        "--block-size", str(BLOCK), "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-2",
        "--log-interval", "1", "--eval-iters", "0", "--no-progress-bar", "--seed", "1234")
    run("-m", "megatron_csbp.convert", "megatron-to-hf", "--load", lora, "--output", adapter)
    tokens = np.random.RandomState(0).randint(0, 127, (2, SEQ))
    np.save(os.path.join(a.workdir, "tokens.npy"), tokens)
    run("-m", "megatron_csbp.convert", "score", "--load", lora, "--tokens", os.path.join(a.workdir, "tokens.npy"),
        "--output", os.path.join(a.workdir, "megatron_logits.npy"))

    # the LoRA checkpoint decodes directly (its base with the adapters folded in)
    np.save(os.path.join(a.workdir, "prompt.npy"), tokens[:1, :8])
    run("-m", "megatron_csbp.generate", "--load", lora, "--prompt-ids", os.path.join(a.workdir, "prompt.npy"),
        "--max-new-tokens", "8")

    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()
        with model.disable_adapter():
            plain = model(torch.from_numpy(tokens)).logits.numpy()
    ours = np.load(os.path.join(a.workdir, "megatron_logits.npy"))
    diff, moved = float(np.abs(ours - ref).max()), float(np.abs(ref - plain).max())
    print(f"peft adapter files: {sorted(os.listdir(adapter))}")
    print(f"the trained adapters move the logits by {moved:.3e}; max |megatron + LoRA - peft| = {diff:.3e}")
    if not (moved > 10 * TOLERANCE and diff <= TOLERANCE):
        print("FAILED: the PEFT adapter does not reproduce the Megatron model's logits")
        return 1
    print(f"done: same logits (tolerance {TOLERANCE}); the adapter is in {adapter}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
