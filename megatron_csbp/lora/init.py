"""Layout-independent adapter weights: each adapter tensor is drawn in full from a generator seeded by
(--seed, its global name: global layer index, global expert index) and this rank's slice is taken,
by `parallel.global_draw`, as model/assemble.py's `redraw_weights_by_global_name` does for base weights."""
from __future__ import annotations

import functools
import math

import torch

from megatron_csbp.lora import LoRAConfig, is_adapter
from megatron_csbp.parallel.global_draw import GlobalNames, drawn_slice, tensor_parallel_slice


def _fill(master: torch.Tensor, which: str, lora: LoRAConfig) -> None:
    if which == "lora_B" and lora.init != "random":
        master.zero_()
    elif which == "lora_A" and lora.init == "gaussian":
        torch.nn.init.normal_(master, std=1.0 / lora.rank)
    else:  # nn.Linear's own init (PEFT's default for A; both for init_lora_weights=False)
        torch.nn.init.kaiming_uniform_(master, a=math.sqrt(5))


def draw_adapters(model: torch.nn.Module, lora: LoRAConfig, seed: int) -> None:
    """Draw every adapter of `model` (a GPTModel chunk under the current parallel state)."""
    names = GlobalNames(model)
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        parts = names.parts(name)
        fill = functools.partial(_fill, which=parts[-1][:6], lora=lora)  # lora_A / lora_B (a part's lora_A_q too)
        with torch.no_grad():
            p.copy_(drawn_slice(parts, p.shape, fill, seed, *tensor_parallel_slice(p, "local_experts" in parts)))
