"""LoRA in the cost model (`plan --lora-rank`): the adapters' parameters, compute, kept activations
and tensor-parallel reductions, per rank. Torch-free closed formulas; every term and its derivation:
docs/lora.md, "Memory, time and the planner".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Tuple

from megatron_csbp.planner.model_config import LayerShape, ModelConfig

#: megatron-core's module names, the trainer's `--lora-target-modules` default (experts included)
TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # A [r, in] replicated over TP, B [out / TP, r]


@dataclass(frozen=True)
class LoRAPlan:
    rank: int
    target_modules: Tuple[str, ...] = TARGET_MODULES
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"--lora-rank {self.rank} must be >= 1 (0: full fine-tuning)")
        unknown = [m for m in self.target_modules if m.rsplit(".", 1)[-1] not in TARGET_MODULES]
        if unknown or not self.target_modules:
            raise ValueError(f"--lora-target-modules {' '.join(unknown) or '(none)'}: choose from "
                             f"{' '.join(TARGET_MODULES)} (or experts.NAME, mlp.NAME, ...: under that parent only)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout {self.dropout} must be in [0, 1)")


@dataclass(frozen=True)
class Linear:
    """One base linear of a layer: megatron-core name, full (unsharded) fan-in and fan-out."""

    name: str
    fan_in: int
    fan_out: int
    expert: bool = False  # one expert's (a layer has `num_experts` of them)

    def matches(self, target: str) -> bool:
        """The trainer's rule (`lora.spec.matches`): NAME every linear of that name, PARENT.NAME those
        under PARENT (`experts`: the experts' only; any other parent: the others)."""
        parent, _, name = target.rpartition(".")
        return name == self.name and (not parent or (parent.rsplit(".", 1)[-1] == "experts") == self.expert)

    def rank_widths(self, tp: int) -> Tuple[float, float]:
        """(A's input width, B's output width) one TP rank holds: column-parallel: A whole, B's rows
        / TP; row-parallel: A's columns / TP, B whole."""
        if self.name in COLUMN_PARALLEL:
            return self.fan_in, self.fan_out / tp
        return self.fan_in / tp, self.fan_out


def layer_linears(model: ModelConfig, layer: LayerShape) -> List[Linear]:
    """The linears LoRA can adapt (a Gated DeltaNet layer's in/out projections are not among them)."""
    h, m = model.hidden_size, model.mlp_matrices - 1  # m: fc1's output multiple (2: gated)
    out: List[Linear] = []
    if not layer.is_gdn:
        q = layer.num_heads * layer.head_dim
        kv = layer.num_kv_heads * layer.head_dim * (1 if layer.kv_shared else 2)
        out += [Linear("linear_qkv", h, q * (2 if layer.q_gate else 1) + kv), Linear("linear_proj", q, h)]
    if layer.mlp_ffn:
        out += [Linear("linear_fc1", h, m * layer.mlp_ffn), Linear("linear_fc2", layer.mlp_ffn, h)]
    if layer.num_experts:
        out += [Linear("linear_fc1", h, m * layer.expert_ffn, True), Linear("linear_fc2", layer.expert_ffn, h, True)]
    return out


def _adapted(model: ModelConfig, layer: LayerShape, lora: LoRAPlan) -> List[Linear]:
    return [x for x in layer_linears(model, layer) if any(x.matches(t) for t in lora.target_modules)]


def adapter_params(model: ModelConfig, lora: LoRAPlan, layers: Iterable[LayerShape] = None, tp: int = 1,
                   ep: int = 1) -> Tuple[float, float]:
    """(dense, expert) adapter parameters one rank holds for `layers` (all by default): r (in + out)
    per adapted linear, sharded as its base (`Linear.rank_widths`), experts / EP of each layer's."""
    dense = expert = 0.0
    for layer in model.layers if layers is None else layers:
        for x in _adapted(model, layer, lora):
            a, b = x.rank_widths(tp)
            if x.expert:
                expert += lora.rank * (a + b) * layer.num_experts / ep
            else:
                dense += lora.rank * (a + b)
    return dense, expert


def adapter_count(model: ModelConfig, lora: LoRAPlan) -> int:
    """Every adapter parameter of the model (full shapes): the count of its `is_adapter` tensors."""
    return int(sum(adapter_params(model, lora)))


def layer_forward_cost(model: ModelConfig, layer: LayerShape, lora: LoRAPlan, tp: int, s: int) -> Tuple[float, float]:
    """(FLOPs, HBM bytes) per row of one forward of the layer's adapters on one TP rank: per adapted
    linear z = x A^T (2 r a FLOPs, reads x: a elements) and y += z B^T (2 r b FLOPs, reads and writes
    y: 2 b elements), a and b its rank widths; expert linears once per routed copy (top-k)."""
    flops = hbm = 0.0
    for x in _adapted(model, layer, lora):
        a, b = x.rank_widths(tp)
        copies = layer.topk if x.expert else 1
        flops += copies * 2 * lora.rank * (a + b)
        hbm += copies * s * (a + 2 * b + 2 * lora.rank)
    return flops, hbm


def layer_kept_bytes(model: ModelConfig, layer: LayerShape, lora: LoRAPlan, tp: int, s: int) -> float:
    """Bytes per row LoRA changes in what the layer keeps for backward, against the trained layer
    of `cost.activation_bytes_per_row` (which counts each linear's input once): per adapted linear
    the rank-r intermediate z B's gradient needs (a column layer's gathered over TP, a row layer's
    reduce-scattered: / TP; an expert's whole, per routed copy) and, with dropout, its
    1-byte mask (A keeps the dropped copy of x in x's place); a frozen linear without adapter keeps
    no input (megatron-core's `linear_with_frozen_weight`), so qkv's and fc1's inputs (the norms'
    outputs, h) and fc2's (the activation's output) go unless something else keeps them (proj's
    input is the attention output, which the attention keeps)."""
    delta = 0.0
    adapted = {(x.name, x.expert) for x in _adapted(model, layer, lora)}
    for x in layer_linears(model, layer):
        copies = layer.topk if x.expert else 1
        if (x.name, x.expert) in adapted:
            z = lora.rank / (tp if x.name not in COLUMN_PARALLEL and not x.expert else 1)
            delta += copies * (s * z + (x.fan_in / tp if lora.dropout else 0.0))
        elif x.name != "linear_proj":
            delta -= copies * s * x.fan_in / tp
    return delta


def layer_tp_reduced_bytes(model: ModelConfig, layer: LayerShape, lora: LoRAPlan, s: int) -> float:
    """Bytes per row of the rank-r tensors that cross the TP group in one pass (sequence parallel):
    one [rows, r] tensor per adapted linear (column: z gathered in forward, dz reduce-scattered in
    backward; row: z reduce-scattered, dz gathered), per routed copy for experts."""
    return sum((layer.topk if x.expert else 1) * s * lora.rank for x in _adapted(model, layer, lora))
