from megatron_csbp.objectives.base import NoisedBatch, Objective, sample_generator
from megatron_csbp.objectives.ar import AutoregressiveObjective
from megatron_csbp.objectives.bd3lm import BD3LMObjective

__all__ = ["NoisedBatch", "Objective", "sample_generator", "BD3LMObjective", "AutoregressiveObjective"]
