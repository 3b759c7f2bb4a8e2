"""Layout-independent adapter weights: each adapter tensor is drawn in full from a generator seeded by
(--seed, its global name: global layer index, global expert index) and this rank's slice is taken,
like model/assemble.py's `redraw_weights_by_global_name` does for base weights."""
from __future__ import annotations

import math
import zlib

import torch

from megatron_csbp.lora import LoRAConfig, is_adapter
from megatron_csbp.parallel import pipeline


def global_name(name: str, layer_offset: int, first_expert: int) -> str:
    """`name` with this chunk's layer index and this EP rank's local expert index made global."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(layer_offset + int(parts[2]))
    if "local_experts" in parts:
        k = parts.index("local_experts") + 1
        parts[k] = str(first_expert + int(parts[k]))
    return ".".join(parts)


def _fill(master: torch.Tensor, which: str, lora: LoRAConfig) -> None:
    if which == "lora_B" and lora.init != "random":
        master.zero_()
    elif which == "lora_A" and lora.init == "gaussian":
        torch.nn.init.normal_(master, std=1.0 / lora.rank)
    else:  # nn.Linear's own init (PEFT's default for A; both for init_lora_weights=False)
        torch.nn.init.kaiming_uniform_(master, a=math.sqrt(5))


def draw_adapters(model: torch.nn.Module, lora: LoRAConfig, seed: int) -> int:
    """Draw every adapter of `model` (a GPTModel chunk under the current parallel state); returns the count."""
    from megatron.core import parallel_state as mpu

    config = model.config
    experts = getattr(config, "num_moe_experts", None) or 0
    first_expert = mpu.get_expert_model_parallel_rank() * (experts // mpu.get_expert_model_parallel_world_size()) \
        if experts else 0
    offset = pipeline.first_layer(config, getattr(model, "vp_stage", None))
    drawn = 0
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        full_name = global_name(name, offset, first_expert)
        expert = "local_experts" in name.split(".")
        if getattr(p, "tensor_model_parallel", False):
            dim, stride = p.partition_dim, p.partition_stride
            rank, world = ((mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size())
                           if expert else (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()))
        else:
            dim, stride, rank, world = 0, 1, 0, 1
        full = list(p.shape)
        full[dim] *= world
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(full_name.encode()))
            master = torch.empty(full, dtype=torch.float32)
            _fill(master, full_name.rsplit(".", 1)[1][:6], lora)  # lora_A / lora_B (a part's lora_A_q too)
        pieces = torch.split(master, p.shape[dim] // stride, dim=dim)
        with torch.no_grad():
            p.copy_(torch.cat(pieces[rank::world], dim=dim).to(p.dtype))
        drawn += 1
    return drawn
