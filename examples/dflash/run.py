"""DFlash drafter end to end on CPU: verifier, features, CSBP drafter training, Hugging Face export,
transformers' own DFlash decoding.

    python examples/dflash/run.py [--workdir runs/dflash] [--verifier-steps 300] [--drafter-steps 1000]

1. The shipped corpus (megatron_csbp/data) -> a Megatron indexed dataset (`megatron_csbp.data.preprocess`).
2. A tiny Qwen3 verifier (config made here: 4 layers, hidden 64, the shipped 1024-piece tokenizer)
   trained briefly as a causal LM with torch AdamW on the packed corpus (its last 10% held out),
   saved as a Hugging Face checkpoint.
3. Distillation data, as DFlash drafters are trained: every document's first --prompt-length
   tokens (except the last --eval-sequences documents, kept for evaluation) continued greedily by
   the verifier to --seq-length tokens; `python -m megatron_csbp.dflash prepare-features` on it
   with --target-layer-ids 1 3 (sharded memmaps).
4. `python -m megatron_csbp.dflash train` on 2 gloo ranks with CSBP (--context-parallel-size 2
   --block-parallel-size 2), block size 8, mask token `<mask>` (id 4).
5. `python -m megatron_csbp.dflash export` -> MuseGlimmerAssistantModel.
6. `python -m megatron_csbp.dflash evaluate`: prompts from the last --eval-sequences corpus
   documents (held out from the drafter's data) decoded greedily by the verifier
   alone and with `generate(..., assistant_model=drafter)` (speculation_type "dflash"); prints
   whether the outputs are identical and the mean tokens per verifier step, beside the training-time
   estimate (expected acceptance length) on the last --eval-sequences captured sequences, which
   the drafter's training held out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def run(*args, world: int = 1):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
               str(_free_port()), "-m", *args]
    else:
        cmd = [sys.executable, "-m", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, env=env)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_verifier(path: str, prefix: str, steps: int, seq: int = 128, batch: int = 16, seed: int = 0) -> dict:
    """A tiny Qwen3 causal LM trained on the packed training documents (the held-out tail excluded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_csbp.data.tokenizer import SentencePieceTokenizer
    from megatron_csbp.data.features import pack_documents

    tok = SentencePieceTokenizer()
    tokens, _ = pack_documents(prefix, seq, tok.eod)
    n_train = int(len(tokens) * 0.9)
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eod, pad_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = np.random.RandomState(seed)
    t0 = time.time()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        ids = torch.from_numpy(tokens[g.randint(0, n_train, size=batch)]).long()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"verifier step {step + 1} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    with torch.no_grad():
        held = torch.from_numpy(tokens[n_train:n_train + 16]).long()
        eval_loss = float(model(input_ids=held, labels=held).loss)
    model.save_pretrained(path)
    return {"train_loss": float(loss), "heldout_loss": eval_loss, "sequences": len(tokens), "train_sequences": n_train}


@torch.no_grad()
def regenerate(verifier_path: str, prefix: str, out_prefix: str, prompt_length: int, new_tokens: int,
               held_out: int, batch: int = 64, max_prompts=None) -> dict:
    """Distillation data: prompts of `prompt_length` tokens taken every prompt + continuation tokens
    of each training document, each followed by the verifier's greedy continuation of `new_tokens`
    tokens (the last `held_out` documents are left out: their prompts are the evaluation's).
    Written as an indexed dataset, one document per prompt."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
    from transformers import AutoModelForCausalLM, GenerationConfig

    verifier = AutoModelForCausalLM.from_pretrained(verifier_path).eval()
    docs = IndexedDataset(prefix)
    prompts = []
    for i in range(len(docs) - held_out):  # a prompt every (prompt + continuation) tokens of the document
        ids = np.asarray(docs[i], dtype=np.int64)
        step = prompt_length + new_tokens
        prompts += [ids[s:s + prompt_length] for s in range(0, len(ids) - prompt_length + 1, step)]
    prompts = prompts[:max_prompts]
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=None)
    builder = IndexedDatasetBuilder(out_prefix + ".bin", dtype=DType.optimal_dtype(verifier.config.vocab_size))
    t0 = time.time()
    for start in range(0, len(prompts), batch):
        ids = torch.as_tensor(np.stack(prompts[start:start + batch]))
        out = verifier.generate(ids, generation_config=cfg)
        for row in out:
            builder.add_document(row, [len(row)])
        print(f"regenerated {min(start + batch, len(prompts))}/{len(prompts)} ({time.time() - t0:.0f}s)", flush=True)
    builder.finalize(out_prefix + ".idx")
    return {"documents": len(prompts), "prompt_length": prompt_length, "new_tokens": new_tokens}


def main(argv=None):
    from megatron_csbp.utils.cli import filter_warnings

    filter_warnings()  # hide the library warnings a user cannot act on
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="runs/dflash")
    p.add_argument("--verifier-steps", type=int, default=300)
    p.add_argument("--drafter-steps", type=int, default=1000)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--max-sequences", type=int, default=None, help="capture only this many sequences")
    p.add_argument("--max-prompts", type=int, default=None, help="regenerate only this many prompts")
    p.add_argument("--eval-sequences", type=int, default=12, help="held-out corpus documents whose prompts are decoded")
    p.add_argument("--prompt-length", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=48)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    w = os.path.abspath(a.workdir)
    os.makedirs(w, exist_ok=True)
    prefix = os.path.join(w, "corpus_text_document")
    if not os.path.exists(prefix + ".idx"):
        run("megatron_csbp.data.preprocess", "--input", "shipped", "--output-prefix", os.path.join(w, "corpus"),
            "--append-eod")
    verifier = os.path.join(w, "verifier")
    report = {}
    if not os.path.exists(os.path.join(verifier, "config.json")):
        report["verifier"] = train_verifier(verifier, prefix, a.verifier_steps, a.seq_length)
    regen = os.path.join(w, "regenerated_text_document")
    if not os.path.exists(regen + ".idx"):
        report["regenerated"] = regenerate(verifier, prefix, regen, a.prompt_length, a.seq_length - a.prompt_length - 1,
                                           a.eval_sequences, max_prompts=a.max_prompts)
    features = os.path.join(w, "features")
    cap = ["megatron_csbp.dflash", "prepare-features", "--hf-path", verifier, "--data-path", regen,
           "--seq-length", str(a.seq_length), "--target-layer-ids", "1", "3", "--output", features,
           "--shard-size", "64", "--eod-token-id", "3"]
    if a.max_sequences:
        cap += ["--max-sequences", str(a.max_sequences)]
    run(*cap)
    drafter = os.path.join(w, "drafter")
    run("megatron_csbp.dflash", "train", "--features-path", features, "--verifier", verifier,
        "--num-layers", "2", "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
        "--ffn-hidden-size", "192", "--block-size", "8", "--mask-token-id", "4",
        "--context-parallel-size", "2", "--block-parallel-size", "2", "--train-iters", str(a.drafter_steps),
        "--micro-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "20", "--dflash-max-anchors", "64",
        "--log-interval", "10", "--eval-sequences", str(a.eval_sequences), "--save", drafter,
        "--log-json", os.path.join(drafter, "log.jsonl"), world=2)
    hf_drafter = os.path.join(w, "drafter_hf")
    run("megatron_csbp.dflash", "export", "--load", drafter, "--output", hf_drafter)
    out = os.path.join(w, "evaluate.json")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megatron_csbp.dflash", "evaluate", "--verifier", verifier, "--drafter", hf_drafter,
           "--prompts-data-path", prefix, "--features-path", features, "--eval-sequences", str(a.eval_sequences),
           "--prompt-length",
           str(a.prompt_length), "--max-new-tokens",
           str(a.max_new_tokens)]
    print("$", " ".join(cmd[1:]), flush=True)
    result = json.loads(subprocess.run(cmd, check=True, env=env, capture_output=True, text=True).stdout)
    report["evaluate"] = result
    last = [json.loads(line) for line in open(os.path.join(drafter, "log.jsonl"))][-1]  # the trainer's --log-json
    report["drafter_history"] = dict(last, step=last["iteration"])
    json.dump(report, open(out, "w"), indent=1)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
