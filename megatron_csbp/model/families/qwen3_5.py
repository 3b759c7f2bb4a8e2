"""Qwen3.5 (text): a hybrid decoder of Gated DeltaNet (linear attention) and gated softmax attention
layers (`megatron_csbp.model.hybrid`), with partial rotary embeddings and (1 + w) RMSNorms.

Text positions are the same on the three M-RoPE axes, so M-RoPE is plain RoPE here. The weight
mapping is the GPT one (`model/families/gpt_weights.py`), which reads the shape's `gated_delta` pattern and
`attention_output_gate`.
"""
from __future__ import annotations

from typing import Any, Dict, List

from megatron_csbp.model.families import register_family
from megatron_csbp.model.families.base import ModelShape, UnsupportedModelError, refuse_if
from megatron_csbp.model.families.gpt import GPTFamily


class Qwen35Family(GPTFamily):
    has_megatron_lm_flags = False
    layer_types = ("full_attention", "linear_attention")
    partial_rotary = True

    def _complete(self, shape: ModelShape, cfg: Dict[str, Any], partial_rotary) -> None:
        from megatron_csbp.model.hybrid import linear_attention_pattern

        shape.gated_delta = dict(
            pattern=linear_attention_pattern(shape.num_layers, layer_types=cfg["layer_types"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            key_head_dim=int(cfg["linear_key_head_dim"]), value_head_dim=int(cfg["linear_value_head_dim"]),
            num_key_heads=int(cfg["linear_num_key_heads"]), num_value_heads=int(cfg["linear_num_value_heads"]))
        refuse_if(shape.gated_delta["num_value_heads"] % shape.gated_delta["num_key_heads"] != 0,
                  "linear_num_value_heads must be a multiple of linear_num_key_heads")
        shape.attention_output_gate = True
        shape.rotary_percent = float(partial_rotary or 1.0)
        shape.zero_centered_norms = True

    def config_fields(self, shape: ModelShape, dtype) -> Dict[str, Any]:
        kwargs = super().config_fields(shape, dtype)
        gd = shape.gated_delta
        kwargs.update(linear_conv_kernel_dim=gd["conv_kernel"], linear_key_head_dim=gd["key_head_dim"],
                      linear_value_head_dim=gd["value_head_dim"], linear_num_key_heads=gd["num_key_heads"],
                      linear_num_value_heads=gd["num_value_heads"],
                      # megatron's own hybrid pattern knob: also makes dist_checkpointing store the
                      # layers one by one (non-homogeneous), as their parameters differ
                      linear_attention_freq=list(gd["pattern"]))
        if shape.attention_output_gate:
            kwargs.update(attention_output_gate=True)
        return kwargs

    def layer_spec(self, shape: ModelShape, config=None, block_diffusion: bool = True, kernel: str = "auto"):
        """The hybrid decoder block spec (`hybrid_block_spec`). Note: its attention layers use the
        "auto" kernel, as before the family registry (`kernel` is not passed on)."""
        if shape.is_moe:
            raise UnsupportedModelError("hybrid Gated DeltaNet models with MoE layers are not supported")
        from megatron_csbp.model.hybrid import hybrid_block_spec

        spec = hybrid_block_spec(shape.gated_delta["pattern"], qk_layernorm=shape.qk_layernorm,
                                 zero_centered_norms=shape.zero_centered_norms)
        if not block_diffusion:
            raise UnsupportedModelError("hybrid Gated DeltaNet models are built with block-diffusion layers only")
        return spec

    def megatron_flags(self, shape: ModelShape) -> List[str]:
        raise UnsupportedModelError(
            "hybrid Gated DeltaNet models have no Megatron-LM flag set here (Megatron-LM builds its GDN "
            "decoder with TransformerEngine only): train with python -m megatron_csbp.train --load CHECKPOINT")


register_family(Qwen35Family("qwen3_5", "qwen3_5_text", "Qwen3_5ForCausalLM", qk_layernorm=True))
