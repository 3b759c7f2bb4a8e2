from megatron_csbp.objectives.base import NoisedBatch, Objective, sample_generator
from megatron_csbp.objectives.ar import AutoregressiveObjective
from megatron_csbp.objectives.bd3lm import BD3LMObjective
from megatron_csbp.objectives.fast_dllm_v2 import FastDLLMv2Objective

__all__ = ["NoisedBatch", "Objective", "sample_generator", "BD3LMObjective", "AutoregressiveObjective",
           "FastDLLMv2Objective"]
