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
    """Allowed query-key pairs of one sample (one view): the objective's FLOPs term
    (`Objective.attention_pairs`), e.g. L*(L+B) for block-causal BD3-LM."""
    from megatron_csbp.objectives import objective_class

    return objective_class(objective).attention_pairs(seq_length, block_size, clean_attention)


def flops_per_sample(args) -> float:
    """Forward + backward FLOPs of one sample, counting the logical (not replicated) work. A dense
    estimate: MoE models (DiffusionGemma) count their dense MLP only; the rows and attention pairs
    are the objective's (`Objective.rows_per_sample`, `views`, `attention_pairs`): diffusiongemma-sft
    counts a canvas over the whole sequence (an upper bound: prompt blocks have no canvas)."""
    from megatron_csbp.objectives import objective_class

    objective = objective_class(args.objective)
    L, h, ffn, layers = args.seq_length, args.hidden_size, args.ffn_hidden_size, args.num_layers
    heads, groups = args.num_attention_heads, args.num_query_groups
    d = getattr(args, "kv_channels", None) or h // heads
    views = objective.views  # fast-dllm-v2 doubles the batch (two complementary views), each view 2L rows
    rows = objective.rows_per_sample(L)
    per_row = 2 * h * (heads * d + 2 * groups * d) + 2 * heads * d * h
    per_row += (6 if args.swiglu else 4) * h * ffn
    linear = rows * per_row * layers
    attn = 4 * views * attention_pairs(L, args.block_size, args.clean_attention, args.objective) * heads * d * layers
    logits = 2 * views * L * h * args.vocab_size
    return 3.0 * (linear + attn + logits)


def eval_objective(args, train_objective):
    """The objective evaluation uses: `train_objective.for_evaluation()` (BD3-LM: always the NELBO,
    t ~ U[1e-3, 1] with 1/t weights, whatever schedule training draws from, so held-out losses of
    runs with different training schedules compare; other objectives: the training objective)."""
    return train_objective.for_evaluation()


def build_datasets(args):
    """(train, valid) datasets of the objective's kind (`Objective.build_datasets`)."""
    from megatron_csbp.objectives import objective_class

    return objective_class(args.objective).build_datasets(args)


def objective_of(argv: List[str]) -> Optional[str]:
    """The value of --objective in argv (either spelling), or None."""
    for i, a in enumerate(argv):
        if a == "--objective" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--objective="):
            return a.split("=", 1)[1]
    return None


def own_trainer(argv: List[str]):
    """The entry point `run(argv)` of the trainer of the objective argv names, when that objective
    trains in a loop of its own (`Objective.own_trainer`, e.g. dflash on captured verifier features);
    None when this trainer trains it (or argv names no registered objective: the parser says so)."""
    from megatron_csbp.objectives.registry import registered_objectives

    cls = registered_objectives().get(objective_of(argv) or "")
    return cls.run_trainer if cls is not None and cls.own_trainer is not None else None


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
    run = own_trainer(argv)
    if run is not None:  # e.g. dflash: a drafter trains on captured verifier features, in its own loop
        return run(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    args = parse_args(argv)
    with Trainer(TrainerConfig.from_args(args)) as trainer:
        _log0(trainer.describe())
        result = trainer.train()
    if demo:
        from megatron_csbp.training.demo import finish_demo
        finish_demo(args, result, time.time() - start)
    return result
