"""The two block-diffusion parallel sizes and what they select. Torch-free, so the planner can use it.

Vocabulary used throughout the package:

- the *shard group*: the max(CP, BP) ranks that together hold one sequence (Megatron's
  context-parallel axis; `shard_group_size`). Distinct from Megatron's *sequence parallelism*, which
  splits activations over the tensor-parallel group.
- the *clean ring*: the CP ranks inside a shard group that share one clean stream and exchange K/V.
"""
from __future__ import annotations

#: --block-ownership: which noisy blocks each BP rank holds (torch-free, for the planner's parser too)
OWNERSHIP_SCHEDULES = ("mirrored", "contiguous")


def check_parallel_sizes(cp: int, bp: int) -> None:
    """The rule for the two sizes, shared by layouts, process groups, the planner and the launcher."""
    if cp < 1 or bp < 1:
        raise ValueError(f"--context-parallel-size ({cp}) and --block-parallel-size ({bp}) must be >= 1")
    if bp > 1 and bp % cp != 0:
        raise ValueError(f"--block-parallel-size {bp} must be a multiple of --context-parallel-size {cp}: "
                         "BP = k * CP runs k clean rings of CP ranks")


def shard_group_size(cp: int, bp: int) -> int:
    """Ranks that hold one sequence between them: max(CP, BP)."""
    return max(cp, bp)


def layout_kind(cp: int, bp: int) -> str:
    """The layout the two sizes select: 'single', 'cp' (the baseline), 'bp' or 'csbp'."""
    if bp > 1:
        return "csbp" if cp > 1 else "bp"
    return "cp" if cp > 1 else "single"


class ShardGroupSizes:
    """`kind`, `shard_group_size` and `ring_of` of a layout class with `cp_size` and `bp_size` fields."""

    cp_size: int
    bp_size: int

    @property
    def kind(self) -> str:
        return layout_kind(self.cp_size, self.bp_size)

    @property
    def shard_group_size(self) -> int:
        """Ranks in the shard group: max(CP, BP) (Megatron's context-parallel axis)."""
        return shard_group_size(self.cp_size, self.bp_size)

    def ring_of(self, rank: int):
        """(ring index j, position i in the ring) of a rank of the shard group."""
        return divmod(rank, self.cp_size)
