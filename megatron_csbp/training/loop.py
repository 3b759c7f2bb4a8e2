"""`python -m megatron_csbp.train`: the trainer CLI. Parses and validates the flags, builds the typed
`TrainerConfig`, and runs a `Trainer` (training/trainer.py) under torch.distributed; with no flags it
runs the embedded default (training/demo.py). Also here: what the objective decides about a run that
is not the model (its datasets, its evaluation objective, the FLOPs model of its mask).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Dict, List, Optional

import torch


# ----------------------------------------------------------------------------------------------
# FLOPs on the block-diffusion mask's real work
# ----------------------------------------------------------------------------------------------
def attention_pairs(seq_length: int, block_size: int, clean_attention: str, objective: str) -> int:
    """Allowed query-key pairs of one sample: L*(L+B) for block-causal BD3-LM."""
    from megatron_csbp.layout.masks import BlockGeometry, clean_key_interval, logical_rows

    if objective == "ar":
        return seq_length * (seq_length + 1) // 2
    g = BlockGeometry(seq_length, block_size, clean_attention)
    rows = logical_rows(seq_length)
    lo, hi = clean_key_interval(rows, g)
    clean = int((hi - lo).clamp_min(0).sum())
    noisy_in_block = seq_length * block_size  # each noisy query sees its own block
    return clean + noisy_in_block


def flops_per_sample(args) -> float:
    """Forward + backward FLOPs of one sample, counting the logical (not replicated) work. A dense
    estimate: MoE models (DiffusionGemma) count their dense MLP only; diffusiongemma-sft counts a
    canvas over the whole sequence (an upper bound: prompt blocks have no canvas)."""
    L, h, ffn, layers = args.seq_length, args.hidden_size, args.ffn_hidden_size, args.num_layers
    heads, groups = args.num_attention_heads, args.num_query_groups
    d = getattr(args, "kv_channels", None) or h // heads
    # fast-dllm-v2 doubles the batch (two complementary views), each view 2L rows
    views = 2 if args.objective == "fast-dllm-v2" else 1
    rows = views * 2 * L if args.objective in ("bd3lm", "fast-dllm-v2", "diffusiongemma-sft") else L
    per_row = 2 * h * (heads * d + 2 * groups * d) + 2 * heads * d * h
    per_row += (6 if args.swiglu else 4) * h * ffn
    linear = rows * per_row * layers
    attn = 4 * views * attention_pairs(L, args.block_size, args.clean_attention, args.objective) * heads * d * layers
    logits = 2 * views * L * h * args.vocab_size
    return 3.0 * (linear + attn + logits)


def eval_objective(args, train_objective):
    """The objective evaluation uses. BD3-LM: always the NELBO (t ~ U[1e-3, 1], 1/t weights), an
    upper bound on the model's NLL in nats/token, whatever schedule training draws from
    (`--noise-eps-min/max`, `--loss-weighting`): so held-out losses of runs with different training
    schedules compare. Other objectives: the training objective."""
    if args.objective != "bd3lm":
        return train_objective
    from megatron_csbp.objectives import BD3LMObjective
    return BD3LMObjective(args.block_size, args.mask_token_id, seed=args.seed)


def build_datasets(args):
    from megatron_csbp.data.megatron_data import MockDataset, build_gpt_datasets, build_tokenizer

    if args.mock_data:
        num_ids = args.vocab_size - 2  # below the mask and EOD ids
        return (MockDataset(args.seq_length, num_ids, args.seed, "train"),
                MockDataset(args.seq_length, num_ids, args.seed, "valid"))
    tok = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    if args.sft_data_path:
        from megatron_csbp.data.sft import SFTDataset
        align = args.block_size if args.objective == "diffusiongemma-sft" else None
        ds = SFTDataset(args.sft_data_path, tok, args.seq_length, align_response_to=align)
        return ds, ds
    G = args.global_batch_size
    n_eval = args.eval_iters * G  # every evaluation reads the same held-out batches
    train, valid, _ = build_gpt_datasets(args.data_path, args.split, args.seq_length, args.seed, tok,
                                         [args.train_iters * G, max(n_eval, 1), 1], args.data_cache_path)
    if train is None:
        raise ValueError(f"--split {args.split} leaves no training documents")
    return train, valid if valid is not None else train


def objective_of(argv: List[str]) -> Optional[str]:
    """The value of --objective in argv (either spelling), or None."""
    for i, a in enumerate(argv):
        if a == "--objective" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--objective="):
            return a.split("=", 1)[1]
    return None


def main(argv: Optional[List[str]] = None) -> Dict:
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer, _log0

    argv = list(sys.argv[1:] if argv is None else argv)
    demo = not argv
    start = time.time()
    if demo:
        from megatron_csbp.training.demo import prepare_demo
        argv = prepare_demo(int(os.environ.get("WORLD_SIZE", "1")))
    if objective_of(argv) == "dflash":
        # The drafter trains on captured verifier features, not on token datasets: its own loop.
        from megatron_csbp import dflash
        return dflash.main(["train"] + argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    args = parse_args(argv)
    with Trainer(TrainerConfig.from_args(args)) as trainer:
        _log0(trainer.describe())
        result = trainer.train()
    if demo:
        from megatron_csbp.training.demo import finish_demo
        finish_demo(args, result, time.time() - start)
    return result
