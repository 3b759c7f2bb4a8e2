"""The trainer's model: `ModelArgs` (the typed model config), `TrainableBDLM` (a
`BlockDiffusionModel` as a MegatronModule for Megatron's DDP) and this rank's model chunks, assembled
by `model/assemble.py`.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_csbp.model.assemble import ModelArgs, assemble  # noqa: F401  (ModelArgs re-exported)
from megatron_csbp.model.bdlm import BlockDiffusionModel
from megatron_csbp import objectives
from megatron_csbp.parallel import pipeline


class TrainableBDLM(MegatronModule):
    """A `BlockDiffusionModel` as a MegatronModule for DDP and the trainer's `model.contract.ModelChunk`;
    checkpoints are plain GPT state (the same keys as Megatron-LM's GPT checkpoints: core attention
    has no parameters)."""

    def __init__(self, config: TransformerConfig, bdlm: BlockDiffusionModel):
        super().__init__(config=config)
        self.bdlm = bdlm
        self.model_type = bdlm.gpt.model_type
        for mode in ("supervised", "training_loss", "stage_output", "first_pass", "evaluation_loss", "eval_record"):
            setattr(self, mode, getattr(bdlm, mode))

    objective = property(lambda self: self.bdlm.objective)
    last_stage = property(lambda self: self.bdlm.last_stage)
    plan = property(lambda self: self.bdlm.plan)
    gpt = property(lambda self: self.bdlm.gpt)

    @property
    def module(self) -> GPTModel:
        """The wrapped GPTModel, as DDP/Float16Module expose theirs: Megatron's
        `get_attr_wrapped_model` (e.g. Megatron-LM's `train()` asking for `pg_collection`) walks
        `.module` until it finds the attribute. A property, so no second state-dict entry."""
        return self.bdlm.gpt

    def forward(self, tokens, loss_mask=None, sample_index=None, denominator=None, document_ids=None,
                self_conditioning=None):
        """What megatron-core's schedules call (`BlockDiffusionModel.forward`)."""
        return self.bdlm(tokens, loss_mask, sample_index, denominator, document_ids, self_conditioning)

    def set_input_tensor(self, input_tensor):
        self.bdlm.gpt.set_input_tensor(input_tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return self.bdlm.gpt.sharded_state_dict(prefix, sharded_offsets, metadata)


#: objective class -> the function building this rank's model chunks from ModelArgs, for an objective
#: that trains another model than the GPT of `build_model` (`register_chunk_builder`)
CHUNK_BUILDERS: Dict[type, Callable] = {}


def register_chunk_builder(objective: type):
    """Decorator: `fn(a, device, finalize_model_grads_func)` builds the chunks `objective` trains."""
    def register(fn: Callable) -> Callable:
        CHUNK_BUILDERS[objective] = fn
        return fn
    return register


def build_model_chunks(a, device: Optional[torch.device] = None, finalize_model_grads_func=None) -> list:
    """This rank's model chunks, one `TrainableBDLM` per virtual pipeline stage (one chunk without
    interleaving; the whole model without pipeline parallelism); an objective's own model when one is
    registered for it (`CHUNK_BUILDERS`, e.g. the DFlash drafter)."""
    from megatron_csbp.training import drafter  # noqa: F401  (registers --objective dflash's drafter)

    builder = CHUNK_BUILDERS.get(objectives.objective_class(a.objective))
    if builder is not None:
        return builder(a, device, finalize_model_grads_func)
    return pipeline.build_chunks(lambda pre, post, vp: build_model(a, device, finalize_model_grads_func, pre, post, vp))


def build_model(a, device: Optional[torch.device] = None, finalize_model_grads_func=None,
                pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None) -> TrainableBDLM:
    """Pipeline chunk (`pre_process`, `post_process`, `vp_stage`) of `a` (`model.assemble.assemble`)."""
    return TrainableBDLM(*assemble(a, device, finalize_model_grads_func,
                                   pipeline.Stage(pre_process, post_process, vp_stage)))
