"""What the benchmark runs: the model, the layouts and the traffic each layout should move."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def check(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} must be divisible by --num-attention-heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} must be divisible by "
                             f"--num-query-groups {self.num_query_groups}")
        if self.dtype != "fp32":
            raise ValueError("the CPU benchmark runs in fp32 (gloo, CPU kernels)")


@dataclass(frozen=True)
class Case:
    """One layout of a sequence group of `size` ranks."""

    name: str
    cp: int
    bp: int
    transport: str = "allgather"
    schedule: str = "mirrored"

    @property
    def size(self) -> int:
        return max(self.cp, self.bp)

    @property
    def kind(self) -> str:
        if self.bp > 1:
            return "csbp" if self.cp > 1 else "bp"
        return "cp" if self.cp > 1 else "single"

    @property
    def ring_size(self) -> int:
        return self.cp

    def baseline_name(self) -> Optional[str]:
        """The CP case this one is compared with: CP over the same ranks, same transport."""
        if self.kind == "single":
            return None
        transport = self.transport if self.kind in ("cp", "csbp") else "allgather"
        return f"cp-{transport}"


ALL_LAYOUTS = ("cp-allgather", "cp-ring", "bp", "csbp-allgather", "csbp-ring", "csbp-allgather-contiguous",
               "csbp-2rings")


def cases_for(size: int, layouts=ALL_LAYOUTS) -> List[Case]:
    """The cases of one sequence-group size. 'csbp-2rings' is CP = P/2, BP = P (two clean rings)."""
    unknown = set(layouts) - set(ALL_LAYOUTS)
    if unknown:
        raise ValueError(f"--layouts: unknown {sorted(unknown)}; choose from {list(ALL_LAYOUTS)}")
    if size == 1:
        return [Case("single", 1, 1)]
    table = {
        "cp-allgather": Case("cp-allgather", size, 1, "allgather"),
        "cp-ring": Case("cp-ring", size, 1, "ring"),
        "bp": Case("bp", 1, size),
        "csbp-allgather": Case("csbp-allgather", size, size, "allgather", "mirrored"),
        "csbp-ring": Case("csbp-ring", size, size, "ring", "mirrored"),
        "csbp-allgather-contiguous": Case("csbp-allgather-contiguous", size, size, "allgather", "contiguous"),
    }
    if size >= 4 and size % 2 == 0:
        table["csbp-2rings"] = Case("csbp-2rings", size // 2, size, "allgather", "mirrored")
    out = [table[name] for name in layouts if name in table]
    # the CP baselines must run for the ratios
    for need in ("cp-allgather", "cp-ring"):
        if any(c.baseline_name() == need for c in out) and need not in [c.name for c in out]:
            out.insert(0, table[need])
    return out


def formula_bytes_sent(case: Case, model: BenchModel, seq_length: int) -> int:
    """Attention bytes each rank sends per step (forward + backward), all layers (design brief 2).

    CP: 8*L*G*d*s*(P-1)/P per layer; CSBP: 4*L*G*d*s*(C-1)/C (C = ring size, half of CP when
    C = P); BP: 0. Times the micro-batch size.
    """
    L, G, d = seq_length, model.num_query_groups, model.head_dim
    s = BYTES_PER_ELEMENT[model.dtype] * model.micro_batch_size
    if case.kind == "cp":
        P = case.size
        per_layer = 8 * L * G * d * s * (P - 1) // P
    elif case.kind == "csbp":
        C = case.ring_size
        per_layer = 4 * L * G * d * s * (C - 1) // C
    else:
        per_layer = 0
    return per_layer * model.num_layers


@dataclass
class BenchConfig:
    model: BenchModel = field(default_factory=BenchModel)
    seq_lengths: Tuple[int, ...] = (256, 512, 1024)
    sizes: Tuple[int, ...] = (2, 4)
    layouts: Tuple[str, ...] = ALL_LAYOUTS
    warmup: int = 2
    steps: int = 5
    seed: int = 1234
    measure_memory: bool = True

    def check(self) -> None:
        self.model.check()
        if self.warmup < 0 or self.steps < 1:
            raise ValueError(f"--warmup ({self.warmup}) must be >= 0 and --steps ({self.steps}) >= 1")
        for P in self.sizes:
            if P < 2:
                raise ValueError(f"--sizes must be >= 2 (the single-rank run is always included), got {P}")
        B = self.model.block_size
        for L in self.seq_lengths:
            for P in self.sizes:
                if L % (2 * P * B):
                    raise ValueError(
                        f"--seq-lengths {L} must be a multiple of 2 x P x --block-size = {2 * P * B} for P = {P} "
                        "(zigzag chunks and balanced mirrored block pairs)"
                    )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["seq_lengths"], d["sizes"], d["layouts"] = list(self.seq_lengths), list(self.sizes), list(self.layouts)
        return d


def quick_config() -> BenchConfig:
    """CI-sized: one layer, short sequences, P = 2 only (about half a minute on two cores)."""
    return BenchConfig(
        model=BenchModel(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=128, vocab_size=128, block_size=8),
        seq_lengths=(64, 128), sizes=(2,), warmup=1, steps=2,
        layouts=("cp-allgather", "cp-ring", "bp", "csbp-allgather", "csbp-ring", "csbp-allgather-contiguous"),
    )
