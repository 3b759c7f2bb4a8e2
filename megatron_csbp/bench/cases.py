"""What the benchmark runs: the model, the layouts and the traffic each layout should move."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple, Union

from megatron_csbp.layout.sizes import layout_kind, shard_group_size

BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
#: the sizes both benchmark models hand the trainer as flags of the same name (and `python -m
#: megatron_csbp.bench` takes as flags overriding them)
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
               "block_size", "micro_batch_size")


def trainer_argv(values: Dict[str, Any]) -> List[str]:
    """The trainer's argv of `values` (flags by dest) on mock tokens of the NullTokenizer, its last id
    the mask token (unless `values` say otherwise), each flag written as the option table declares it."""
    from megatron_csbp.config.options import flag_text

    values = {"mock_data": True, "no_progress_bar": True, "tokenizer_type": "NullTokenizer",
              "mask_token_id": values["vocab_size"] - 1, "make_vocab_size_divisible_by": 1, **values}
    return " ".join(flag_text(k, v) for k, v in values.items()).split()


def _check_fp32(dtype: str) -> None:
    if dtype != "fp32":
        raise ValueError("the CPU benchmark runs in fp32 (gloo, CPU kernels)")


@dataclass(frozen=True)
class BenchModel:
    """A small Megatron GPT (local spec, RoPE, GQA) trained with the BD3-LM objective."""

    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 512
    vocab_size: int = 512
    block_size: int = 16
    micro_batch_size: int = 1
    dtype: str = "fp32"
    attention_kernel: str = "auto"  # --attention-kernel of the block attention (auto: tiled on CPU)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def kv_layers(self) -> List[Tuple[int, int, bool, bool]]:
        """(K/V groups G, head size d, K = V, sliding window) of each layer."""
        return [(self.num_query_groups, self.head_dim, False, False)] * self.num_layers

    def flags(self) -> Dict[str, Any]:
        """The model as flags by dest: what the trainer builds (Megatron's TransformerConfig defaults:
        LayerNorm, GeLU, biases) and the planner reads (`planner.model_config.from_flags`)."""
        return dict({k: getattr(self, k) for k in MODEL_FLAGS}, attention_kernel=self.attention_kernel,
                    normalization="LayerNorm", swiglu=False, add_bias_linear=True)

    def check(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} must be divisible by --num-attention-heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} must be divisible by "
                             f"--num-query-groups {self.num_query_groups}")
        _check_fp32(self.dtype)


@dataclass(frozen=True)
class Case:
    """One layout of a shard group of `size` ranks."""

    name: str
    cp: int
    bp: int
    transport: str = "allgather"
    schedule: str = "mirrored"
    # DiffusionGemma bench only: "hybrid" (sliding windows as configured) or "full" (every layer
    # full attention, same weights); None for the GPT bench
    attention: Optional[str] = None

    @property
    def shard_group_size(self) -> int:
        return shard_group_size(self.cp, self.bp)

    @property
    def kind(self) -> str:
        return layout_kind(self.cp, self.bp)

    def baseline_name(self) -> Optional[str]:
        """The CP case this one is compared with: CP over the same ranks, same transport."""
        return None if self.kind == "single" else f"cp-{self.attention or (self.transport if self.kind in ('cp', 'csbp') else 'allgather')}"


ALL_LAYOUTS = ("cp-allgather", "cp-ring", "bp", "csbp-allgather", "csbp-ring", "csbp-allgather-contiguous",
               "csbp-2rings")


def cases_for(size: int, layouts=ALL_LAYOUTS) -> List[Case]:
    """The cases of one shard-group size. 'csbp-2rings' is CP = P/2, BP = P (two clean rings)."""
    unknown = set(layouts) - set(ALL_LAYOUTS)
    if unknown:
        raise ValueError(f"--layouts: unknown {sorted(unknown)}; choose from {list(ALL_LAYOUTS)}")
    if size == 1:
        return [Case("single", 1, 1)]
    shapes = {"cp-allgather": (size, 1, "allgather"), "cp-ring": (size, 1, "ring"), "bp": (1, size),
              "csbp-allgather": (size, size, "allgather", "mirrored"), "csbp-ring": (size, size, "ring", "mirrored"),
              "csbp-allgather-contiguous": (size, size, "allgather", "contiguous")}
    if size >= 4 and size % 2 == 0:
        shapes["csbp-2rings"] = (size // 2, size, "allgather", "mirrored")
    table = {name: Case(name, *shape) for name, shape in shapes.items()}
    out = [table[name] for name in layouts if name in table]
    # the CP baselines must run for the ratios
    for need in ("cp-allgather", "cp-ring"):
        if any(c.baseline_name() == need for c in out) and need not in [c.name for c in out]:
            out.insert(0, table[need])
    return out


def formula_bytes_sent(case: Case, model: "AnyModel", seq_length: int) -> Optional[int]:
    """Attention bytes each rank sends per step (forward + backward), all layers (design brief 2):
    the sum of `formula_bytes_per_layer`, None where a layer has no formula."""
    per = formula_bytes_per_layer(case, model, seq_length).values()
    return None if None in per else sum(per)


@dataclass(frozen=True)
class DiffusionGemmaBenchModel:
    """A tiny DiffusionGemma (megatron-core, MoE MLP, `diffusion_gemma_model`) with the hybrid
    layout of the 26B-A4B model: `full_every - 1` sliding-window layers, then one full layer.
    Sliding layers carry more K/V bytes per row than the full one, whose K = V (one KV head of
    `full_kv_channels`; CSBP moves raw k alone there): defaults 4 KV heads x 8 (64 K+V values
    per row) vs 1 KV head x 16 (32 K+V values, 16 raw k), the real model's 2:1."""

    arch: str = "diffusiongemma-hybrid"
    num_layers: int = 6
    full_every: int = 6
    sliding_window: int = 3
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 4
    kv_channels: int = 8
    full_num_query_groups: int = 1
    full_kv_channels: int = 16
    ffn_hidden_size: int = 48
    num_moe_experts: int = 4
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 12
    vocab_size: int = 96
    block_size: int = 4
    micro_batch_size: int = 1
    dtype: str = "fp32"

    def flags(self) -> Dict[str, Any]:
        """The trainer's model flags (the model itself comes from the benchmark's provider)."""
        return {k: getattr(self, k) for k in MODEL_FLAGS}

    @property
    def layer_types(self) -> List[str]:
        return ["full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention"
                for i in range(self.num_layers)]

    def kv_layers(self) -> List[Tuple[int, int, bool, bool]]:
        """(K/V groups G, head size d, K = V, sliding window) of each layer: the full layers' one
        K = V head, the sliding layers' own."""
        full = (self.full_num_query_groups, self.full_kv_channels, True, False)
        sliding = (self.num_query_groups, self.kv_channels, False, True)
        return [full if kind == "full_attention" else sliding for kind in self.layer_types]

    def check(self) -> None:
        if self.num_attention_heads % self.num_query_groups or self.num_attention_heads % self.full_num_query_groups:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} must be divisible by the KV groups "
                             f"({self.num_query_groups} sliding, {self.full_num_query_groups} full)")
        if self.sliding_window < 1 or self.full_every < 1:
            raise ValueError(f"--sliding-window ({self.sliding_window}) and full_every must be >= 1")
        _check_fp32(self.dtype)


AnyModel = Union[BenchModel, DiffusionGemmaBenchModel]


def dg_cases_for(size: int) -> List[Case]:
    """Single, CP and CSBP (CP = BP = P, all-gather transport) on the hybrid model and on the same
    weights with every layer full attention."""
    shapes = {"single": (1, 1)} if size == 1 else {"cp": (size, 1), "csbp": (size, size)}  # (CP, BP)
    return [Case(f"{kind}-{att}", cp, bp, attention=att)
            for att in ("hybrid", "full") for kind, (cp, bp) in shapes.items()]


def formula_bytes_per_layer(case: Case, model: AnyModel, seq_length: int) -> Dict[int, Optional[int]]:
    """Bytes each rank sends per layer (forward + backward), layers numbered from 1, times the
    micro-batch size.

    CP: 8*L*G*d*s*(P-1)/P on every layer with the layer's G and d (K and V on every layer, the K=V
    layer too; windows only mask). CSBP: 4*L*G*d*s*(C-1)/C (C = ring size, half of CP when C = P),
    and half of it on a K=V layer (raw k only). BP: 0. CSBP on a sliding layer with its window:
    the windowed all-to-all's bytes depend on which clean rows the windows reach across ranks: no
    closed formula here (None).
    """
    s = BYTES_PER_ELEMENT[model.dtype] * model.micro_batch_size
    ranks = case.shard_group_size if case.kind == "cp" else case.cp  # CSBP: the ring's
    out: Dict[int, Optional[int]] = {}
    for i, (G, d, k_is_v, sliding) in enumerate(model.kv_layers(), start=1):
        factor = {"cp": 8, "csbp": 2 if k_is_v else 4}.get(case.kind, 0)
        windowed = case.kind == "csbp" and sliding and case.attention != "full"
        out[i] = None if windowed else factor * seq_length * G * d * s * (ranks - 1) // ranks
    return out


@dataclass
class BenchConfig:
    model: AnyModel = field(default_factory=BenchModel)
    seq_lengths: Tuple[int, ...] = (256, 512, 1024)
    sizes: Tuple[int, ...] = (2, 4)
    layouts: Tuple[str, ...] = ALL_LAYOUTS
    warmup: int = 2
    steps: int = 5
    seed: int = 1234
    measure_memory: bool = True
    # one more step under torch.profiler: aten op calls per step (`bench.alternate --count-ops`)
    count_ops: bool = False

    def check(self) -> None:
        self.model.check()
        if self.warmup < 0 or self.steps < 1:
            raise ValueError(f"--warmup ({self.warmup}) must be >= 0 and --steps ({self.steps}) >= 1")
        for P in self.sizes:
            if P < 2:
                raise ValueError(f"--sizes must be >= 2 (the single-rank run is always included), got {P}")
        for L in self.seq_lengths:
            for P in self.sizes:
                if L % (2 * P * self.model.block_size):
                    raise ValueError(f"--seq-lengths {L} must be a multiple of 2 x P x --block-size = "
                                     f"{2 * P * self.model.block_size} for P = {P} "
                                     "(zigzag chunks and balanced mirrored block pairs)")


def quick_config() -> BenchConfig:
    """CI-sized: one layer, short sequences, P = 2 only (about half a minute on two cores)."""
    return BenchConfig(model=BenchModel(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                        ffn_hidden_size=128, vocab_size=128, block_size=8),
                       seq_lengths=(64, 128), sizes=(2,), warmup=1, steps=2,
                       layouts=tuple(name for name in ALL_LAYOUTS if name != "csbp-2rings"))


def dg_config() -> BenchConfig:
    """`--model diffusiongemma-hybrid`: the tests/test_hybrid_traffic.py shape (5 sliding : 1 full,
    window 3, block size 4), P = 2, L = 128, 256, 512."""
    return BenchConfig(model=DiffusionGemmaBenchModel(), seq_lengths=(128, 256, 512), sizes=(2,),
                       layouts=(), warmup=2, steps=5)


def dg_quick_config() -> BenchConfig:
    """`--model diffusiongemma-hybrid --quick`: L = 128 only, one warm-up and two timed steps."""
    return replace(dg_config(), seq_lengths=(128,), warmup=1, steps=2)
