"""`DiffusionGemmaModel`: a megatron-core `GPTModel` with DiffusionGemma's embedding, rotary tables,
self-conditioning and logit soft-cap; `BlockDiffusionModel(model, objective, layout)` trains it on
[noisy ; clean] rows (clean rows: the HF encoder stream, noisy rows: the decoder stream). Each
piece, and how self-conditioning inputs are passed: docs/diffusiongemma.md (the table of
"What is Megatron's and what is the plugin's").
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_csbp.attention.plan_handles import local_is_clean, physical_is_clean, plan_or_none
from megatron_csbp.model.diffusiongemma.layer import diffusion_gemma_block_spec
from megatron_csbp.model.diffusiongemma.norms import GemmaRMSNorm, rms_normalize
from megatron_csbp.model.diffusiongemma.rotary import GemmaRotaryTables
from megatron_csbp.utils.precision import at_least_fp32


def vocab_parallel_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax in at least fp32 over a vocabulary split across TP ranks (the local shard of the result)."""
    logits = at_least_fp32(logits)
    m = logits.max(dim=-1, keepdim=True)[0]
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    if tp > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
    e = torch.exp(logits - m)
    s = e.sum(dim=-1, keepdim=True)
    if tp > 1:
        torch.distributed.all_reduce(s, group=parallel_state.get_tensor_model_parallel_group())
    return e / s


class _SoftCap(torch.autograd.Function):
    """cap * tanh(x / cap) in at least fp32. Backward recomputes tanh from the saved input, so the returned
    logits may be modified in place by the consumer, as Megatron's vocab-parallel cross entropy
    does (torch.tanh would save its output and fail, or silently go wrong, afterwards)."""

    @staticmethod
    def forward(ctx, x, cap: float):
        ctx.save_for_backward(x)
        ctx.cap = cap
        return torch.tanh(at_least_fp32(x) / cap) * cap

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(at_least_fp32(x) / ctx.cap)
        return (grad * (1 - t * t)).to(x.dtype), None


class DiffusionGemmaModel(GPTModel):
    def __init__(self, config, transformer_layer_spec, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, post_process: bool = True, **kwargs):
        # kwargs: GPTModel's other arguments (parallel_output, pg_collection, vp_stage), handed on as they are
        super().__init__(config, transformer_layer_spec, vocab_size, max_sequence_length, pre_process=pre_process,
                         post_process=post_process, share_embeddings_and_output_weights=True,
                         position_embedding_type="rope", rotary_percent=1.0, rotary_base=config.rotary_base, **kwargs)
        self.rotary_pos_emb = GemmaRotaryTables(config, cp_group=self.pg_collection.cp)
        self._pending_sc = None
        #: None: soft-cap in at least fp32 (training); a dtype: cast the logits to it, then cap, in
        #: Hugging Face's order (decoding an fp64 model reproduces transformers' fp32 logits)
        self.softcap_dtype: Optional[torch.dtype] = None
        if pre_process and config.self_conditioning:
            self.self_conditioning_norm = GemmaRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
            self.self_conditioning_mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                   linear_fc2=RowParallelLinear),
                                             tp_group=self.pg_collection.tp)
        if post_process and config.final_logit_softcapping:
            self.output_layer.register_forward_hook(self._softcap_hook)

    # ---- logits ----------------------------------------------------------------------------------
    def _softcap_hook(self, module, args, output):
        logits, bias = output
        cap = float(self.config.final_logit_softcapping)
        if self.softcap_dtype is not None:
            return torch.tanh(logits.to(self.softcap_dtype) / cap) * cap, bias
        return _SoftCap.apply(logits, cap), bias

    # ---- embedding -------------------------------------------------------------------------------
    @property
    def embed_scale(self) -> torch.Tensor:
        weight = self.embedding.word_embeddings.weight
        return torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(weight.dtype)

    @contextlib.contextmanager
    def self_conditioning_inputs(self, logits: Optional[torch.Tensor], mask: Optional[torch.Tensor] = None):
        """Self-conditioning inputs for the forwards run inside the block."""
        previous = self._pending_sc
        self._pending_sc = None if logits is None else (logits, mask)
        try:
            yield
        finally:
            self._pending_sc = previous

    def soft_embeddings(self, sc_logits: torch.Tensor, sc_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax_fp32(logits) @ E * scale: [b, rows, V/TP] -> [rows, b, h] (summed over TP)."""
        weight = self.embedding.word_embeddings.weight  # [V/TP, h]
        probs = vocab_parallel_softmax(sc_logits.detach()).to(weight.dtype)
        soft = torch.matmul(probs, weight)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            soft = reduce_from_tensor_model_parallel_region(soft)
        soft = soft * self.embed_scale
        if sc_mask is not None:
            soft = soft * sc_mask.to(soft.dtype)[:, None, None]
        return soft.transpose(0, 1)

    def self_conditioning_logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Detached logits [b, rows, V/TP] of the output-layer input `hidden` [rows (/TP under
        sequence parallelism), b, h] with this stage's tied word embeddings: the output layer's own
        computation (all-gather under SP, matmul with E^T, soft-cap), for the first pipeline stage,
        which has no output layer. E is the same tensor as the last stage's copy (megatron-core
        keeps the two in sync), so these are the logits one stage computes."""
        with torch.no_grad():
            if self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
                hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            logits = torch.matmul(hidden, self.shared_embedding_or_output_weight().t())
            if self.config.final_logit_softcapping:
                logits, _ = self._softcap_hook(None, None, (logits, None))
            return logits.transpose(0, 1).contiguous()

    def embed(self, input_ids, position_ids, attention_mask, sc_logits=None, sc_mask=None) -> torch.Tensor:
        """[s (/TP with sequence parallelism), b, h] input of the transformer block."""
        emb = self.embedding(input_ids=input_ids, position_ids=position_ids)  # [s, b, h], SP-scattered
        pad = self.config.embedding_padding_idx
        sp = self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1
        if pad is not None and torch.is_grad_enabled():
            # nn.Embedding(padding_idx): the lookup of the padding id passes no gradient to E.
            is_pad = (input_ids == pad).transpose(0, 1).contiguous()
            if sp:
                is_pad = tensor_parallel.scatter_to_sequence_parallel_region(is_pad.contiguous())
            emb = torch.where(is_pad[..., None], emb.detach(), emb).contiguous()
        emb = emb * self.embed_scale
        is_clean = local_is_clean(attention_mask, emb.shape[0], self.config.sequence_parallel)
        if is_clean is None or not self.config.self_conditioning or bool(is_clean.all()):
            if sc_logits is not None:
                raise ValueError("self-conditioning logits given but the batch has no noisy rows")
            return emb
        is_clean = is_clean.to(emb.device)
        noisy_idx = torch.nonzero(~is_clean).squeeze(1)
        if sc_logits is not None:
            plan = plan_or_none(attention_mask)
            plan_noisy = int((~plan.local.is_clean).sum())
            if sc_logits.shape[1] != plan_noisy:
                raise ValueError(f"self-conditioning logits cover {sc_logits.shape[1]} rows, the plan has {plan_noisy} noisy rows")
            soft = self.soft_embeddings(sc_logits, sc_mask)  # [noisy rows, b, h]
            if sp:  # this rank's rows of the soft embeddings, zero on the clean rows
                full = soft.new_zeros((emb.shape[0] * parallel_state.get_tensor_model_parallel_world_size(),) + soft.shape[1:])
                full = full.index_copy(0, torch.nonzero(~physical_is_clean(plan).to(emb.device)).squeeze(1), soft)
                soft = tensor_parallel.scatter_to_sequence_parallel_region(full)
            signal, _ = self.self_conditioning_mlp(self.self_conditioning_norm(soft))
            canvas = emb + signal if sp else emb.index_add(0, noisy_idx, signal)
        else:
            canvas = emb
        normed = rms_normalize(canvas, self.config.layernorm_epsilon).type_as(canvas)
        return torch.where(is_clean[:, None, None], emb, normed)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                self_conditioning_logits=None, self_conditioning_mask=None, self_conditioning_hidden=None, **kwargs):
        """GPTModel's forward (`args` / `kwargs`: its other arguments, handed on as they are) on the
        embedding with self-conditioning (`embed`)."""
        if self_conditioning_logits is None and self._pending_sc is not None:
            self_conditioning_logits, self_conditioning_mask = self._pending_sc
        if self_conditioning_hidden is not None and self.pre_process:
            self_conditioning_logits = self.self_conditioning_logits_of(self_conditioning_hidden)
        if decoder_input is None and self.pre_process:
            decoder_input = self.embed(input_ids, position_ids, attention_mask,
                                       self_conditioning_logits, self_conditioning_mask)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)


def diffusion_gemma_model(config, vocab_size: int, max_sequence_length: int, block_diffusion: bool = True,
                          kernel: str = "auto", stage=None) -> DiffusionGemmaModel:
    """Model provider (parallel state must be initialised). `stage`: the pipeline chunk
    (`megatron_csbp.parallel.pipeline.Stage`; None: the whole model): the embedding and self-conditioning
    MLP on the first stage, the soft-capped tied output layer on the last; layers keep their global
    numbers, so the sliding/full pattern and K=V rule follow the layer wherever it sits."""
    from megatron_csbp.parallel.pipeline import WHOLE

    stage = stage or WHOLE
    spec = diffusion_gemma_block_spec(config, block_diffusion=block_diffusion, kernel=kernel, vp_stage=stage.vp_stage)
    return DiffusionGemmaModel(config, spec, vocab_size, max_sequence_length, **stage.kwargs())
