"""Training objectives, registered by name (`registry.register_objective`).

Registration lines: one import per objective module, in the order of `--objective`'s choices.
"""
from megatron_csbp.objectives.base import NoisedBatch, Objective, sample_generator
from megatron_csbp.objectives.registry import (build_objective, objective_class, objective_names,
                                               register_objective)
from megatron_csbp.objectives.bd3lm import BD3LMObjective
from megatron_csbp.objectives.ar import AutoregressiveObjective
from megatron_csbp.objectives.fast_dllm_v2 import FastDLLMv2Objective
from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective
from megatron_csbp.objectives.dflash import DFlashObjective

__all__ = ["NoisedBatch", "Objective", "sample_generator", "BD3LMObjective", "AutoregressiveObjective",
           "FastDLLMv2Objective", "DiffusionGemmaSFTObjective", "DFlashObjective", "build_objective",
           "objective_class", "objective_names", "register_objective"]
