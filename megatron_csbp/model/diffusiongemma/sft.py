"""The training forward of `diffusiongemma-sft` under every layout (single, CP, BP, CSBP).

`DiffusionGemmaSFTModel` is a `BlockDiffusionModel` with the checks DiffusionGemma's SFT needs
(token-causal clean stream, the objective's block size). The work itself is the generic
machinery of `BlockDiffusionModel` driven by the objective's `NoisedBatch`:
- rows [canvas noisy rows ; clean rows]: only blocks from the micro-batch's first response block
  on get a noisy copy (a noisy block is attended by nobody but itself, so dropping the prompt
  blocks' copies changes no loss term, it only removes their work); under BP/CSBP the canvas
  blocks are owned in mirrored pairs (`SequenceLayout.canvas_layout`);
- the optional self-conditioning first pass (no grad, canvas logits only), then the second pass;
- one loss over the canvas rows and the clean rows with an AR target, each clean row counted by
  exactly one rank of the shard group, over the same denominator.
"""
from __future__ import annotations

from megatron_csbp.model.bdlm import BlockDiffusionModel, register_wrapper
from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective


@register_wrapper(DiffusionGemmaSFTObjective)
class DiffusionGemmaSFTModel(BlockDiffusionModel):
    def __init__(self, gpt, objective: DiffusionGemmaSFTObjective, layout, **kwargs):
        if layout.geometry.clean_attention != "token_causal":
            raise ValueError("DiffusionGemma's clean stream is token-causal (--clean-attention token_causal)")
        if objective.block_size != layout.geometry.block_size:
            raise ValueError(f"objective block size {objective.block_size} != layout block size {layout.geometry.block_size}")
        super().__init__(gpt, objective, layout, **kwargs)

    def _run(self, mode, objective, tokens, loss_mask, *args):
        if loss_mask is None:
            raise ValueError("diffusiongemma-sft needs a loss mask (1 on response tokens)")
        return super()._run(mode, objective, tokens, loss_mask, *args)
