"""LoRA adapters through the layer spec on one rank (docs/lora.md): the flags, the frozen base, the
adapters' math against PEFT's formula, and one clear line for bad targets."""
import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import TINY

LORA = ["--lora-rank", "4", "--lora-init", "random"]


def _train_two_steps(rank, world_size, argv):
    from megatron_csbp.lora import adapter_names
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    s = Trainer(TrainerConfig.from_args(parse_args(list(argv)))).build()
    before = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    in_optimizer = {id(p) for g in s.optimizer.param_groups for p in g["params"]}
    s.train_step(0)
    s.train_step(4)  # the first step runs at warm-up lr 0
    return dict(adapters=sorted(adapter_names(s.model)),
                changed=sorted(n for n, p in s.model.named_parameters() if not torch.equal(before[n], p.detach())),
                trainable=sorted(n for n, p in s.model.named_parameters() if p.requires_grad),
                optimized=sorted(n for n, p in s.model.named_parameters() if id(p) in in_optimizer))


def test_training_steps_change_only_the_adapters():
    out = run_distributed(_train_two_steps, 1, TINY + ["--train-iters", "2"] + LORA)[0]
    layers = [f"bdlm.gpt.decoder.layers.{i}.{m}.lora_{x}" for i in range(2) for x in "AB"
              for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert out["adapters"] == sorted(layers)
    assert out["trainable"] == out["adapters"] and out["changed"] == out["adapters"]
    assert out["optimized"] == out["adapters"]
