"""A DFlash speculative drafter in megatron-core, the `muse_glimmer_assistant` architecture of
transformers 5.24 (`MuseGlimmerAssistantModel`).

Context rows (projected verifier features) and draft blocks through pre-norm layers with the
block-aware core attention on an anchored plan. Architecture: docs/dflash.md#the-model-megatron_csbpmodeldflashpy.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.utils import sharded_state_dict_default

from megatron_csbp.attention.core_attention import BlockDiffusionAttention
from megatron_csbp.attention.plan_handles import plan_mask
from megatron_csbp.config.options import BY_NAME
from megatron_csbp.model.core import PORTABLE_CONFIG, dimensions, transformer_config
from megatron_csbp.model.loss import LossOutput
from megatron_csbp.objectives.dflash import (
    SLIDING_WINDOW, acceptance_counts, acceptance_from_counts, document_starts, streamed_cross_entropy, streamed_top2,
)

HF_MODEL_TYPE = "muse_glimmer_assistant"
SHAPE_FILE = "megatron_csbp_drafter.json"
#: an imported drafter's weights (`convert hf-to-megatron`; older `dflash train --save` folders too)
WEIGHTS_FILE = "drafter.pt"
#: the verifier the drafter was trained against (its tokenizer is the drafter's)
VERIFIER_FILE = "megatron_csbp_drafter_verifier.json"
LAYER_TYPES = ("full_attention", "sliding_attention")
#: `DrafterShape` field -> its Hugging Face config key (`rope_parameters` and `hf_extra` aside)
HF_KEYS = {"ffn_hidden_size": "intermediate_size", "num_layers": "num_hidden_layers",
           "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim", "norm_epsilon": "rms_norm_eps",
           **{name: name for name in ("hidden_size", "num_attention_heads", "max_position_embeddings", "sliding_window",
                                      "layer_types", "block_size", "mask_token_id", "target_layer_ids")}}


#: metadata of the `DrafterShape` fields that the trainer flag of the same name sets: what a --load
#: drafter decides (objectives/dflash.py refuses another value given for them)
FLAG = {"flag": True}


@dataclass
class DrafterShape:
    """Everything that defines a drafter (and its Hugging Face config)."""

    hidden_size: int = field(metadata=FLAG)
    num_layers: int = field(metadata=FLAG)
    num_attention_heads: int = field(metadata=FLAG)
    num_query_groups: int = field(metadata=FLAG)
    kv_channels: int = field(metadata=FLAG)
    ffn_hidden_size: int = field(metadata=FLAG)
    target_layer_ids: List[int] = field(metadata=FLAG)
    block_size: int = field(metadata=FLAG)
    mask_token_id: int = field(metadata=FLAG)
    norm_epsilon: float = BY_NAME["norm_epsilon"].default
    rotary_base: float = field(default=500000.0, metadata=FLAG)  # Hugging Face's default, not the trainer's
    max_position_embeddings: int = 131072
    #: per layer 'full_attention' or 'sliding_attention' (Hugging Face's default: all sliding)
    layer_types: Optional[List[str]] = None
    #: Hugging Face `sliding_window`: a draft row at p sees context positions >= p - sliding_window
    sliding_window: int = field(default=SLIDING_WINDOW.default, metadata=FLAG)
    hf_extra: Dict = field(default_factory=dict)  # ids (bos/eos/pad) passed through to the export
    #: Hugging Face `rope_parameters` of a scaled rotary (rope_type linear / llama3 / ...), verbatim;
    #: empty: the default rotary with `rotary_base`
    rope_parameters: Dict = field(default_factory=dict)

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["sliding_attention"] * self.num_layers
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types must list {self.num_layers} entries from {LAYER_TYPES}, got {self.layer_types}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_query_groups}")
        if not self.target_layer_ids:
            raise ValueError("--target-layer-ids must name at least one verifier layer")
        if self.rope_parameters.get("rope_type", "default") != "default":
            self.scaled_inv_freq()  # refuses what the drafter cannot reproduce, before any weight moves

    def scaled_inv_freq(self) -> Optional[torch.Tensor]:
        """The rotary inverse frequencies of a scaled `rope_type`, from transformers' own
        `ROPE_INIT_FUNCTIONS` (None for the default rotary). Refused: types whose frequencies
        change with the sequence length (`dynamic`) or that scale attention (YaRN / LongRoPE with
        an attention factor other than 1), which the drafter's rotary does not apply."""
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            return None
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported for the drafter (default, "
                             "linear, llama3, or another static scaling without attention factor)")
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config(), None)
        if float(attention_factor) != 1.0:
            raise ValueError(f"rope_parameters.rope_type {rope_type!r} scales attention by {float(attention_factor)}: "
                             "not supported for the drafter (attention factor 1 only)")
        return inv_freq.float()

    @property
    def context_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def window(self, layer: int) -> Optional[int]:
        """The project's window W (keys k > p - W) of layer `layer` (0-based), or None (full)."""
        return self.sliding_window + 1 if self.layer_types[layer] == "sliding_attention" else None

    # ---- Hugging Face config ------------------------------------------------------------------
    @staticmethod
    def from_hf_config(cfg: Dict) -> "DrafterShape":
        if cfg.get("model_type") != HF_MODEL_TYPE:
            raise ValueError(f"not a {HF_MODEL_TYPE} config (model_type {cfg.get('model_type')!r})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        rope = dict(cfg.get("rope_parameters") or {})
        # the keys given (copied: the shape owns its lists); an absent or null key keeps the field's default
        given = {name: copy.copy(cfg[key]) for name, key in HF_KEYS.items() if cfg.get(key) is not None}
        heads = given["num_attention_heads"]
        return DrafterShape(**{"num_query_groups": heads, "kv_channels": given["hidden_size"] // heads, **given},
                            rotary_base=float(rope.get("rope_theta", DrafterShape.rotary_base)),
                            hf_extra={k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg},
                            rope_parameters=rope if rope.get("rope_type", "default") != "default" else {})

    def hf_config(self):
        from transformers import MuseGlimmerAssistantConfig

        return MuseGlimmerAssistantConfig(
            **{key: copy.copy(getattr(self, name)) for name, key in HF_KEYS.items()}, **self.hf_extra,
            rope_parameters=dict(self.rope_parameters) or {"rope_type": "default", "rope_theta": self.rotary_base})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> "DrafterShape":
        return DrafterShape(**json.loads(text))


def drafter_transformer_config(shape: DrafterShape, params_dtype: torch.dtype = torch.float32, **overrides):
    fields = dict(dimensions(shape), normalization="RMSNorm", layernorm_epsilon=shape.norm_epsilon,
                  gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True,
                  params_dtype=params_dtype, **PORTABLE_CONFIG)
    return transformer_config(**(fields | overrides))


class DrafterLayer(torch.nn.Module):
    """One pre-norm drafter layer: context-conditioned attention, then a SwiGLU MLP."""

    def __init__(self, config, shape: DrafterShape, layer: int):
        super().__init__()
        h, d = shape.hidden_size, shape.kv_channels
        H, G = shape.num_attention_heads, shape.num_query_groups
        init = config.init_method
        self.heads, self.groups, self.head_dim = H, G, d
        self.input_layernorm = WrappedTorchNorm(config, h, eps=shape.norm_epsilon)
        self.linear_q = ColumnParallelLinear(h, H * d, config=config, init_method=init, bias=False, gather_output=False)
        # Megatron's cross-attention layout: per query group [k | v] of d rows each.
        self.linear_kv = ColumnParallelLinear(h, 2 * G * d, config=config, init_method=init, bias=False,
                                              gather_output=False)
        self.q_layernorm = WrappedTorchNorm(config, d, eps=shape.norm_epsilon)
        self.k_layernorm = WrappedTorchNorm(config, d, eps=shape.norm_epsilon)
        self.core_attention = BlockDiffusionAttention(config, layer_number=layer + 1)
        self.core_attention.window = shape.window(layer)
        self.linear_proj = RowParallelLinear(H * d, h, config=config, init_method=config.output_layer_init_method,
                                             bias=False, input_is_parallel=True, skip_bias_add=False)
        self.pre_mlp_layernorm = WrappedTorchNorm(config, h, eps=shape.norm_epsilon)
        self.mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
        self.config = config

    def forward(self, hidden, context, q_freqs, kv_freqs, mask):
        """hidden [n, b, h] draft rows, context [c, b, h] projected context rows; freqs of the
        draft rows and of [draft ; context] rows; `mask` the plan handle."""
        n, b, _ = hidden.shape
        x = self.input_layernorm(hidden)
        q, _ = self.linear_q(x)
        q = self.q_layernorm(q.view(n, b, self.heads, self.head_dim))
        kv, _ = self.linear_kv(torch.cat([x, context]))
        kv = kv.view(kv.shape[0], b, self.groups, 2 * self.head_dim)
        k, v = self.k_layernorm(kv[..., : self.head_dim]), kv[..., self.head_dim :]
        q = apply_rotary_pos_emb(q, q_freqs, self.config)
        k = apply_rotary_pos_emb(k, kv_freqs, self.config)
        out = self.core_attention(q, k, v.contiguous(), mask)
        out, _ = self.linear_proj(out)
        hidden = hidden + out
        mlp_out, _ = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + mlp_out


class DFlashDrafter(torch.nn.Module):
    """The drafter's trainable weights and forward (no embeddings, no LM head: the verifier's).

    A pipeline stage holds `layers` (global indices, also the state dict's: `layers.{i}.`), the
    context projection if `pre_process`, the final norm if `post_process`; it draws the weights one
    rank draws (the earlier modules are built and dropped)."""

    def __init__(self, shape: DrafterShape, config=None, layers: Optional[range] = None, pre_process: bool = True,
                 post_process: bool = True):
        super().__init__()
        self.shape = shape
        self.config = config = config or drafter_transformer_config(shape)
        if config.tensor_model_parallel_size != 1:
            raise ValueError("the DFlash drafter runs at --tensor-model-parallel-size 1")
        layers = range(shape.num_layers) if layers is None else layers
        self.pre_process, self.post_process = pre_process, post_process
        self.encoder = torch.nn.Module()
        self.encoder.fc = ColumnParallelLinear(shape.context_width, shape.hidden_size, config=config,
                                               init_method=config.init_method, bias=False, gather_output=True)
        self.encoder.norm = WrappedTorchNorm(config, shape.hidden_size, eps=shape.norm_epsilon)
        if not pre_process:
            del self.encoder
        self.layers = torch.nn.ModuleDict()
        for i in range(layers.stop):  # an earlier stage's layers built and dropped, for their draws
            layer = DrafterLayer(config, shape, i)
            if i in layers:
                self.layers[str(i)] = layer
        if post_process:
            self.final_norm = WrappedTorchNorm(config, shape.hidden_size, eps=shape.norm_epsilon)
        self.rotary = RotaryEmbedding(shape.kv_channels, rotary_percent=1.0, rotary_base=shape.rotary_base,
                                      use_cpu_initialization=True)
        scaled = shape.scaled_inv_freq()
        if scaled is not None:  # a scaled rope_type: transformers' frequencies in Megatron's table
            self.rotary.inv_freq = scaled.to(self.rotary.inv_freq.device)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [c, b, len(target_layer_ids) * h] -> projected context [c, b, h]."""
        out, _ = self.encoder.fc(features)
        return self.encoder.norm(out)

    def freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """Megatron's rotary table indexed by row position: [rows, 1, 1, d]."""
        inv = self.rotary.inv_freq
        if inv.device != positions.device:
            self.rotary.inv_freq = inv = inv.to(positions.device)
        freqs = torch.outer(positions.to(inv.dtype), inv)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def forward(self, draft_embeds: torch.Tensor, features: torch.Tensor, plan) -> torch.Tensor:
        """draft_embeds [n, b, h] (the plan's draft rows, in its order), features [c, b, width] of
        the plan's context rows; returns the final-normed hidden states of the draft rows [n, b, h]."""
        n = plan.num_noisy
        if draft_embeds.shape[0] != n or features.shape[0] != len(plan.local) - n:
            raise ValueError(f"draft rows {draft_embeds.shape[0]} / context rows {features.shape[0]} do not match "
                             f"the plan ({n} / {len(plan.local) - n})")
        return self.final_norm(self.run_layers(draft_embeds, self.project_context(features), plan))

    def run_layers(self, hidden: torch.Tensor, context: torch.Tensor, plan) -> torch.Tensor:
        """This stage's layers over the draft rows `hidden` [n, b, h], attending to the projected
        `context` [c, b, h] (which no layer updates)."""
        positions = plan.positions(("drafter",), plan.local, hidden.device)
        kv_freqs = self.freqs(positions)
        q_freqs = kv_freqs[: plan.num_noisy]
        mask = plan_mask(plan)
        for layer in self.layers.values():
            hidden = layer(hidden, context, q_freqs, kv_freqs, mask)
        return hidden


# ---- Hugging Face <-> Megatron ------------------------------------------------------------------

#: Megatron <-> Hugging Face (`MuseGlimmerAssistantModel`) names of the drafter's tensors renamed as
#: they are (per layer: `layers.{i}.` + a `_LAYER_NAMES` pair)
_TOP_NAMES = (("encoder.fc.weight", "encoder.fc.weight"), ("encoder.norm.weight", "encoder.output_norm_enc.weight"),
              ("final_norm.weight", "norm.weight"))
_LAYER_NAMES = (("input_layernorm.weight", "input_layernorm.weight"), ("linear_q.weight", "self_attn.q_proj.weight"),
                ("q_layernorm.weight", "self_attn.q_norm.weight"), ("k_layernorm.weight", "self_attn.k_norm.weight"),
                ("linear_proj.weight", "self_attn.o_proj.weight"),
                ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
                ("mlp.linear_fc2.weight", "mlp.down_proj.weight"))


def tensor_map(shape: DrafterShape) -> list:
    """Every drafter tensor with the Hugging Face tensors it joins (`gpt_weights.Tensors`): the renamed
    ones, and per layer the fused [k | v] per query group (d rows each, Megatron's cross-attention
    layout) and the MLP's [gate ; up]."""
    from megatron_csbp.model.families.gpt_weights import Tensors, grouped

    out = [Tensors(meg, [hf]) for meg, hf in _TOP_NAMES]
    for i in range(shape.num_layers):
        p = f"layers.{i}."  # both sides' prefix
        out += [Tensors(p + meg, [p + hf]) for meg, hf in _LAYER_NAMES]
        out += [grouped(p + "linear_kv.weight", [p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
                        shape.num_query_groups, [shape.kv_channels] * 2),
                grouped(p + "mlp.linear_fc1.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], 1,
                        [shape.ffn_hidden_size] * 2)]
    return out


def hf_tensor_names(shape: DrafterShape) -> set:
    """Every tensor name of the Hugging Face drafter of `shape`."""
    return {hf for t in tensor_map(shape) for hf in t.hf}


def hf_to_megatron_state(shape: DrafterShape, hf: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`MuseGlimmerAssistantModel` state dict -> `DFlashDrafter` state dict."""
    return {t.megatron: t.join(*(hf[name] for name in t.hf)) for t in tensor_map(shape)}


def megatron_to_hf_state(shape: DrafterShape, meg: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`DFlashDrafter` state dict -> `MuseGlimmerAssistantModel` state dict (inverse of the above)."""
    return {hf: part.contiguous().clone() for t in tensor_map(shape)
            for hf, part in zip(t.hf, t.split(meg[t.megatron]))}


def drafter_state(model: DFlashDrafter) -> Dict[str, torch.Tensor]:
    """The drafter's weights without Megatron's extra state entries."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_drafter_state(model: DFlashDrafter, state: Dict[str, torch.Tensor], source: str) -> DFlashDrafter:
    """`model` with `state` loaded (its `_extra_state` entries may be missing, nothing else);
    `source` names where the state came from in the refusal."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"{source}: missing {missing}, unexpected {unexpected}")
    return model


def load_hf_drafter(model: DFlashDrafter, hf_model) -> None:
    load_drafter_state(model, hf_to_megatron_state(model.shape, hf_model.state_dict()), "drafter conversion")


def export_hf_drafter(model: DFlashDrafter, output_dir: Optional[str] = None, dtype: torch.dtype = torch.float32):
    """A `MuseGlimmerAssistantModel` with the drafter's weights (saved to `output_dir` if given)."""
    from transformers import MuseGlimmerAssistantModel

    hf = MuseGlimmerAssistantModel(model.shape.hf_config()).to(dtype)
    state = megatron_to_hf_state(model.shape, drafter_state(model))
    load_drafter_state(hf, {k: v.to(dtype) for k, v in state.items()}, "drafter export")
    if output_dir is not None:
        hf.save_pretrained(output_dir)
    return hf


# ---- training ------------------------------------------------------------------------------------

@dataclass
class DFlashLoss:
    loss: torch.Tensor  # this rank's partial loss (over the shard group's weight sum)
    numerator: torch.Tensor  # detached sum of weighted token losses on this rank
    metrics: Dict  # weight_sum, acceptance (mean target probability), supervised slots (group-wide)


class DFlashTrainingModel(torch.nn.Module):
    """The drafter plus the verifier's frozen input embeddings and LM head, one sequence per
    forward, under any `DFlashLayout`. The returned losses sum over the shard group to the
    loss of one rank holding everything; gradients likewise."""

    def __init__(self, drafter: DFlashDrafter, embedding: torch.Tensor, lm_head: torch.Tensor, objective, layout,
                 shard_rank: int = 0, shard_group=None, ring_group=None, transport: str = "allgather"):
        super().__init__()
        if embedding.shape[1] != drafter.shape.hidden_size or lm_head.shape[1] != drafter.shape.hidden_size:
            raise ValueError(f"verifier embeddings {tuple(embedding.shape)} / LM head {tuple(lm_head.shape)} do not "
                             f"match the drafter's hidden size {drafter.shape.hidden_size}")
        if objective.block_size != drafter.shape.block_size or layout.block_size != drafter.shape.block_size:
            raise ValueError(f"--block-size {objective.block_size} differs from the drafter's {drafter.shape.block_size}")
        self.drafter = drafter
        self.register_buffer("embedding", embedding.detach().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().clone(), persistent=False)
        self.objective, self.layout = objective, layout
        self.shard_rank, self.shard_group, self.ring_group, self.transport = shard_rank, shard_group, ring_group, transport

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout.shard_group_size == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, group=self.shard_group)
        return t

    def draft_blocks(self, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                     doc_ids: Optional[torch.Tensor] = None, sample_index: int = 0, objective=None):
        """(this rank's draft blocks, its attention plan) of one sequence (tokens / loss_mask /
        doc_ids [L]) under `objective` (None: the model's): a pure function of the sequence and its
        sample index, which every pipeline stage rebuilds."""
        L = tokens.numel()
        if L != self.layout.seq_length:
            raise ValueError(f"sequence of {L} tokens, the layout was built for --seq-length {self.layout.seq_length}")
        loss_mask = torch.ones(L, dtype=torch.long) if loss_mask is None else loss_mask
        doc_ids = torch.zeros(L, dtype=torch.long) if doc_ids is None else doc_ids
        sample = (objective or self.objective).sample(tokens, loss_mask, doc_ids, sample_index)
        starts = document_starts(doc_ids.cpu().long())
        plan = self.layout.plan(self.shard_rank, sample.anchors, sample.doc_starts, starts, self.ring_group,
                                self.transport)
        return sample.select(self.layout.owned(sample.anchors, sample.doc_starts)[self.shard_rank]), plan

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                doc_ids: Optional[torch.Tensor] = None, sample_index: int = 0,
                with_acceptance: bool = False, rows: Optional[torch.Tensor] = None, blocks=None, objective=None):
        """features [L, len(target_layer_ids) * h] (a memory map is fine: only this rank's context
        rows are read), tokens / loss_mask / doc_ids [L]; `blocks` their `draft_blocks` if already built.

        Under pipeline parallelism the drafter holds this stage's layers: the first stage embeds the
        draft tokens and projects the context, a later one takes `rows`, the previous stage's output
        for this sequence ([draft rows ; projected context rows], [n + c, 1, h]); a stage before the
        last returns its rows, the last the `DFlashLoss`. `objective`: the one it runs (None: the model's)."""
        objective = objective or self.objective
        mine, plan = blocks or self.draft_blocks(tokens, loss_mask, doc_ids, sample_index, objective)
        device = self.embedding.device
        B, n, drafter = objective.block_size, plan.num_noisy, self.drafter
        if rows is None:
            L, width = tokens.numel(), drafter.shape.context_width
            if features.shape[0] != L or features.shape[1] != width:
                raise ValueError(f"features {tuple(features.shape)} must be [{L}, {width}] (len(--target-layer-ids) x "
                                 "hidden)")
            draft_tokens = torch.full((n // B, B), objective.mask_token_id, dtype=torch.long)
            draft_tokens[: len(mine.anchors)] = mine.draft_tokens
            draft = self.embedding[draft_tokens.flatten().to(device)][:, None]
            ctx_pos = plan.local.position[n:]
            feats = torch.as_tensor(features[ctx_pos.numpy()]).to(device=device, dtype=self.embedding.dtype)[:, None]
            context = drafter.project_context(feats)
        else:
            draft, context = rows[:n], rows[n:]
        hidden = drafter.run_layers(draft, context, plan)
        if not drafter.post_process:
            return torch.cat([hidden, context])
        hidden = drafter.final_norm(hidden)[: len(mine.anchors) * B, 0]
        targets = mine.targets.flatten().to(device)
        sup = targets >= 0
        idx = sup.nonzero().flatten()
        ce_sel = streamed_cross_entropy(hidden.index_select(0, idx), self.lm_head, targets[idx], objective.vocab_chunk)
        ce = torch.zeros(len(targets), dtype=ce_sel.dtype, device=device).index_put((idx,), ce_sel)
        num, den, metrics = objective.token_loss(ce.view(-1, B), mine.position_weights.to(device),
                                                      sup.view(-1, B), reduce=self._reduce)
        if with_acceptance:  # this rank's blocks: metrics["acceptance_counts"], summed over blocks
            # and, per block of this rank, metrics["acceptance_blocks"]: anchors [A], right / supervised
            # [A, B] and the top-2 logit margin and logit scale [A, B] of each slot (0 where unsupervised)
            pred = torch.full_like(targets, -1)
            margin = torch.zeros(len(targets), dtype=torch.float32, device=device)
            scale = torch.zeros_like(margin)
            if len(idx):
                pred[idx], margin[idx], scale[idx] = streamed_top2(hidden.index_select(0, idx).detach(), self.lm_head,
                                                                   objective.vocab_chunk)
            right, supervised = (pred == targets).view(-1, B).cpu(), sup.view(-1, B).cpu()
            metrics = dict(metrics, acceptance_counts=acceptance_counts(right, supervised),
                           acceptance_blocks={"anchors": mine.anchors.cpu(), "right": right & supervised,
                                              "supervised": supervised, "margin": margin.view(-1, B).cpu(),
                                              "scale": scale.view(-1, B).cpu()})
        # A rank without supervised slots still returns a loss attached to every parameter.
        loss = num / den.clamp_min(torch.finfo(torch.float32).tiny) + 0.0 * hidden.sum()
        return DFlashLoss(loss, num.detach(), metrics)


def record_verifier(save: str, verifier: str) -> None:
    """Write `VERIFIER_FILE` into the drafter checkpoint `save` (rank 0)."""
    from megatron_csbp.data.tokenizer import tokenizer_record

    record = {"verifier": os.path.abspath(verifier), **tokenizer_record("HuggingFaceTokenizer", verifier)}
    with open(os.path.join(save, VERIFIER_FILE), "w") as f:
        json.dump(record, f, indent=1)


# ---- the trainer's model ---------------------------------------------------------------------------

def drafter_shape_from_args(a, hidden: int) -> DrafterShape:
    """The drafter the flags describe (`a`: ModelArgs carrying the dflash objective's flags)."""
    heads = a.num_attention_heads
    return DrafterShape(hidden_size=hidden, num_layers=a.num_layers, num_attention_heads=heads,
                        num_query_groups=a.num_query_groups or heads, kv_channels=a.kv_channels or hidden // heads,
                        ffn_hidden_size=a.ffn_hidden_size or 2 * hidden, target_layer_ids=list(a.target_layer_ids),
                        block_size=a.block_size, mask_token_id=a.mask_token_id, rotary_base=float(a.rotary_base),
                        layer_types=[a.layer_type] * a.num_layers, sliding_window=a.sliding_window,
                        max_position_embeddings=max(a.seq_length, 4096))


class TrainableDrafter(torch.nn.Module):
    """A `DFlashTrainingModel` as the trainer's `model.contract.ModelChunk`: a micro-batch [b, L]
    (each sequence's features read from the captured features at its split's index: the held-out
    split under a held-out objective, `DFlashObjective.for_evaluation`); the loss is the
    micro-batch's share of the global loss (each sequence's weighted mean over the global count of
    sequences). Checkpoints hold the drafter's weights under their own names (`sharded_state_dict`),
    replicated over every rank of a pipeline stage.

    Under pipeline parallelism a stage sends the micro-batch's rows: each sequence's [draft rows ;
    projected context rows], one after the other ([rows, 1, h]; P2P exchanges shapes first)."""

    share_embeddings_and_output_weights = False  # megatron-core's finalize_model_grads asks
    plan = None  # the rows that cross a stage vary

    def __init__(self, config, training_model: "DFlashTrainingModel", splits):
        super().__init__()
        self.config, self.model, self.splits = config, training_model, splits
        self.model_type = ModelType.encoder_or_decoder
        self.input_tensor = None  # the previous pipeline stage's rows (megatron-core's schedules set it)

    objective = property(lambda self: self.model.objective)
    # this stage's part (megatron-core's schedules ask for pre_process / post_process)
    pre_process = property(lambda self: self.model.drafter.pre_process)
    post_process = last_stage = property(lambda self: self.model.drafter.post_process)

    # the module whose state a checkpoint holds (the trainer's checkpointing loads `chunk.gpt`)
    gpt = property(lambda self: self.model.drafter)

    def supervised(self, tokens, loss_mask):
        return loss_mask

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def training_loss(self, tokens, loss_mask, sample_index, denominator, document_ids=None, self_conditioning=None,
                      objective=None) -> LossOutput:
        return self._run(objective or self.objective, tokens, loss_mask, sample_index, denominator, document_ids)[0]

    stage_output = training_loss  # on a stage before the last, `_run` gives its rows

    def evaluation_loss(self, tokens, loss_mask, sample_index, denominator, document_ids=None, *, objective,
                        metrics: Dict) -> Tuple[LossOutput, Dict]:
        """The held-out loss and `metrics` with this micro-batch's acceptance counts added."""
        out, counts = self._run(objective, tokens, loss_mask, sample_index, denominator, document_ids, True)
        return out, dict(metrics, acceptance_counts=metrics.get("acceptance_counts", 0) + counts)

    def _run(self, objective, tokens, loss_mask, sample_index, denominator, document_ids, with_acceptance=False):
        """(the loss, or on a stage before the last its rows; the summed acceptance counts)."""
        split = self.splits[1 if objective.held_out else 0]
        outputs, start = [], 0
        for i in range(tokens.shape[0]):
            index = split.data_index(int(sample_index[i]))
            seq = (tokens[i].cpu(), loss_mask[i].cpu(), None if document_ids is None else document_ids[i].cpu())
            blocks = self.model.draft_blocks(*seq, sample_index=index, objective=objective)
            rows = None if self.pre_process else self.input_tensor[start:start + len(blocks[1].local)]
            start += len(blocks[1].local)
            outputs.append(self.model(split.data[index]["features"], *seq, sample_index=index, rows=rows, blocks=blocks,
                                      with_acceptance=with_acceptance, objective=objective))
        if not self.last_stage:
            return torch.cat(outputs), 0
        counts = sum(out.metrics["acceptance_counts"] for out in outputs) if with_acceptance else 0
        loss = sum(out.loss for out in outputs) / denominator
        return LossOutput(loss, torch.tensor(tokens.shape[0]), loss.detach()), counts

    def eval_record(self, metrics: Dict, log=print) -> Dict:
        """Collective on every rank, after an evaluation: the per-offset accuracy and expected
        acceptance length (`objectives.dflash.acceptance_from_counts`) of the held-out blocks in
        `metrics`, counts summed over the shard group, data-parallel replicas and pipeline stages;
        rank 0 `log`s them."""
        counts = metrics.get("acceptance_counts", 0) + torch.zeros(2, self.objective.block_size - 1, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            counts = counts.to(self.model.embedding.device)
            dist.all_reduce(counts, group=mpu.get_data_parallel_group(with_context_parallel=True))
            if mpu.get_pipeline_model_parallel_world_size() > 1:  # counted on the last stage
                dist.all_reduce(counts, group=mpu.get_pipeline_model_parallel_group())
        acc, tau = acceptance_from_counts(counts.cpu())
        if log is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            log(f" held-out acceptance | per-offset accuracy {' '.join(f'{x:.3f}' for x in acc)} | expected "
                f"acceptance length {tau:.3f}")
        return {"eval_acceptance_per_offset": acc, "eval_expected_acceptance_length": tau}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return sharded_state_dict_default(self.model.drafter, prefix, sharded_offsets, metadata)
