"""The cost model: step time and peak memory per rank of one parallel layout.

Per micro-batch of one sample of L clean tokens, on the slowest rank of the shard group: GEMMs,
attention pairs of the real mask, attention and GDN traffic with its overlap, TP / MoE / DP
communication, the optimizer step; memory of weights, optimizer state, activations, received K/V,
logits and a reserve. Every term: docs/planner.md#the-cost-model-megatron_csbpplannercostpy.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from megatron_csbp.layout.sizes import layout_kind, shard_group_size
from megatron_csbp.planner.hardware import GiB, HardwareProfile
from megatron_csbp.planner.lora import (LoRAPlan, adapter_params, layer_forward_cost, layer_kept_bytes,
                                        layer_tp_reduced_bytes)
from megatron_csbp.planner.model_config import LayerShape, ModelConfig
from megatron_csbp.planner.reference import (OURS, Baseline, DFlash2Drafter, contiguous_clean_imbalance,
                                             contiguous_range_factor, native_ce_kept_bytes,
                                             native_ce_workspace_bytes, zero2_static_bytes)
from megatron_csbp.planner.work import (GDNRankWork, drafter_rank_work, gdn_bytes_sent, gdn_rank_work,
                                        rank_work)

ATTN_FWD_BWD = 3.5  # backward of attention ~2.5x its forward (5 vs 2 matmuls)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    cp: int = 1
    bp: int = 1
    ep: int = 1
    dp: int = 1
    recompute: str = "none"  # 'none' | 'full'
    transport: str = "allgather"
    schedule: str = "mirrored"
    distributed_optimizer: bool = True
    pp: int = 1  # pipeline stages (`estimate_pipelined` below)
    vp: int = 1  # virtual stages (model chunks) per pipeline rank: interleaved 1F1B when > 1

    @property
    def shard_group_size(self) -> int:
        return shard_group_size(self.cp, self.bp)

    @property
    def gpus(self) -> int:
        return self.tp * self.shard_group_size * self.dp * self.pp

    @property
    def kind(self) -> str:
        return layout_kind(self.cp, self.bp)

    def label(self) -> str:
        parts = [f"DP{self.dp}"] + ([f"PP{self.pp}" + (f"xVP{self.vp}" if self.vp > 1 else "")] if self.pp > 1 else [])
        parts += [f"{name}{n}" for name, n in (("TP", self.tp), ("EP", self.ep), ("CP", self.cp), ("BP", self.bp))
                  if n > 1]
        extra = [word for word, shown in (("recompute", self.recompute != "none"), (self.transport, self.cp > 1),
                                          (self.schedule, self.bp > 1 and self.schedule != "mirrored")) if shown]
        return "/".join(parts) + (f" ({', '.join(extra)})" if extra else "")


@dataclass(frozen=True)
class Workload:
    seq_length: int
    block_size: int
    global_batch_size: Optional[int] = None  # samples per step; None = one per DP replica
    window_exchange: str = "window"  # CSBP sliding layers: 'window' plan or 'all' clean rows
    grad_bytes: int = 4  # main-gradient bytes per parameter (Megatron: fp32; --grad-reduce-in-bf16: 2)
    logits_bytes: int = 6  # per logit element at the loss: bf16 logits + fp32 copy
    loss_chunk_rows: int = 0  # 0: logits of all noisy rows at once (Megatron); N: chunked linear-CE
    # 'bd3lm' (block diffusion, every objective of this project but the drafter) or 'dflash' (a
    # DFlash drafter on verifier features: `anchors` draft blocks per sequence, documents of
    # `doc_length` tokens, the frozen LM head streamed in `vocab_chunk` columns)
    objective: str = "bd3lm"
    anchors: int = 512
    doc_length: Optional[int] = None
    vocab_chunk: int = 8192
    # packed samples (bd3lm): the first position of every document of the sample the planner
    # counts (`planner.packing.pack_starts`); None: one document per sample
    documents: Optional[Tuple[int, ...]] = None
    # a DiffusionGemma-native-SFT-style objective (the paper's recipe, `reference.recipe_workload`):
    # with this probability per sample a detached (no-grad) forward of the noisy rows, whose
    # logits make soft input embeddings, runs before the trained pass; the EP ranks run it when any
    # of their samples needs it. 0: none (this project's objectives)
    self_conditioning_prob: float = 0.0
    # the clean rows' own autoregressive loss through the output layer (forward and backward)
    encoder_ar_loss: bool = False
    # optimizer-state bytes per trained parameter (None: fp32 master weights + Adam m and v, 12).
    # The paper's DFlash recipe (`reference.recipe_workload`): torch's fused AdamW on bf16
    # parameters keeps m and v in bf16, 4 (with `Layout.distributed_optimizer` False: not sharded)
    optimizer_state_bytes: Optional[int] = None
    # device copies of a DFlash rank's verifier features during a step: 1 (this project's reader);
    # the paper's offline feature reader copies the next sample's features to the device while
    # the step runs, 2 (`reference.recipe_workload`)
    feature_buffers: int = 1
    # the DFlash2 variant of the drafter (`reference.DFlash2Drafter`: block-local dynamic
    # convolutions, the candidate selector, the native vocabulary objective), as the paper's recipe
    # trains it (`reference.recipe_workload`); None: the plain DFlash drafter (this project's)
    dflash2: Optional[DFlash2Drafter] = None
    # what holds the optimizer state: 'megatron' (this project's trainer: bf16 weights, main
    # gradients of `grad_bytes` for every parameter, fp32 master + Adam sharded over DP x CP with
    # the distributed optimizer) or 'zero2' (the paper's trainer on its block-diffusion runs:
    # DeepSpeed ZeRO-2 over the DP x CP/BP ranks of one TP and EP rank, `reference.zero2_static_bytes`)
    optimizer: str = "megatron"
    # how the loss meets the vocabulary: 'logits' (Megatron: the logits of every loss row,
    # `logits_bytes` each, or `loss_chunk_rows` at a time) or 'native_ce' (the paper's trainer: the
    # native linear cross entropy in 1024-row blocks, `reference.native_ce_workspace_bytes`)
    loss_kernel: str = "logits"
    # LoRA (`plan --lora-rank`, `planner.lora`): the base frozen, only the adapters train; None: full
    lora: Optional[LoRAPlan] = None

    def __post_init__(self):
        if self.optimizer not in ("megatron", "zero2"):
            raise ValueError(f"Workload.optimizer must be megatron or zero2, got {self.optimizer!r}")
        if self.lora is not None and (self.objective != "bd3lm" or self.optimizer != "megatron"):
            raise ValueError("--lora-rank: LoRA is planned for block diffusion training (not --objective dflash) "
                             "with Megatron's optimizer")
        if self.loss_kernel not in ("logits", "native_ce"):
            raise ValueError(f"Workload.loss_kernel must be logits or native_ce, got {self.loss_kernel!r}")

    @property
    def packed(self) -> bool:
        return self.documents is not None and len(self.documents) > 1

    def samples_per_replica(self, dp: int) -> int:
        gb = self.global_batch_size or dp
        if gb % dp:
            raise ValueError(f"--global-batch-size {gb} is not divisible by data-parallel size {dp}")
        return gb // dp


@dataclass
class Estimate:
    layout: Layout
    step_time_s: float
    tokens_per_s: float
    peak_memory_gib: float
    attn_bytes_per_gpu: int  # sent per GPU per step in attention collectives
    feasible: bool
    time: Dict[str, float] = field(default_factory=dict)
    memory_gib: Dict[str, float] = field(default_factory=dict)
    why_infeasible: str = ""
    pipeline: Dict = field(default_factory=dict)  # PP > 1: schedule, bubble, stage peaks, P2P bytes

    def to_dict(self, flags: List[str]) -> Dict:
        sizes = ("tp", "pp", "vp", "cp", "bp", "ep", "dp", "recompute", "transport", "schedule")
        results = ("step_time_s", "tokens_per_s", "peak_memory_gib", "attn_bytes_per_gpu", "feasible", "why_infeasible")
        return {
            **{k: getattr(self.layout, k) for k in sizes}, "label": self.layout.label(),
            **{k: getattr(self, k) for k in results},
            "time_breakdown_s": self.time, "memory_breakdown_gib": self.memory_gib, "flags": flags,
            **({"pipeline": self.pipeline} if self.pipeline else {}),
        }


def _link(hw: HardwareProfile, span: int, gpus_per_node: int) -> float:
    """Bytes per second of a collective over `span` ranks (the inter-node link when they span nodes)."""
    return hw.link_gbps(span > gpus_per_node) * 1e9


def _kv_row(layer: LayerShape, tp: int, s: int) -> int:
    """Bytes of one row's K and V on one TP rank."""
    return 2 * max(1, -(-layer.num_kv_heads // tp)) * layer.head_dim * s


def _ring_exposed(t_pass: float, attn_fwd: float, ring: int, passes_fwd: int) -> float:
    """Exposed seconds of one layer's streamed ring: each shift hides behind the attention on the
    chunk before it (the forward passes', then the backward's, 2.5 x the forward work)."""
    hidden = attn_fwd * (ring - 1) / ring
    return passes_fwd * max(0.0, t_pass - hidden) + max(0.0, t_pass - 2.5 * hidden)


def _windows(model: ModelConfig) -> list:
    """The model's distinct attention windows, full attention (None) first."""
    return sorted({l.window for l in model.layers}, key=lambda w: -1 if w is None else w)


def _planned_exchange(layer: LayerShape, wl: "Workload") -> bool:
    """Whether CSBP moves this layer's clean K/V by a static plan (one variable all-to-all of the
    rows inside windows, or of the packed documents' rows) instead of the whole clean stream."""
    return (layer.window is not None and wl.window_exchange == "window") or wl.packed


def _ring_link(lay: "Layout", hw: HardwareProfile, gpus_per_node: int, baseline: Baseline) -> Tuple[int, float]:
    """(ranks sharing the clean stream, bytes per second of their attention collectives); the
    reference recipes stripe each CP / CP x BP group across nodes (`inter_node_cp`)."""
    ring = lay.cp if lay.kind in ("cp", "csbp") else 1
    spans = lay.tp * (lay.shard_group_size if lay.kind == "cp" else ring) > gpus_per_node
    return ring, hw.link_gbps(spans or (baseline.cp_across_nodes and ring > 1 and lay.gpus > gpus_per_node)) * 1e9


def activation_bytes_per_row(model: ModelConfig, layer: LayerShape, tp: int, s: int) -> float:
    """Bytes one row keeps for backward in one layer (sequence parallel: everything / TP)."""
    h, d = model.hidden_size, layer.head_dim
    m = 2 if model.gated_mlp else 1
    attn = 4 * h + (2 * layer.num_heads + 2 * layer.num_kv_heads) * d  # LN in/out x2, q, k, v, core out
    mlp = (m + 1) * layer.mlp_ffn
    moe = layer.topk * (h + (m + 1) * layer.expert_ffn) if layer.num_experts else 0
    lse = layer.num_heads * 4 / s  # fp32 log-sum-exp per head
    return s * (attn + mlp + moe + lse) / tp


def _state_bytes(s: int) -> int:
    """Element size of GDN states and transfer maps: fp32 (fp64 in fp64 runs), whatever the activations."""
    return 8 if s == 8 else 4


def gdn_recurrence_flops(w: GDNRankWork, layer: LayerShape, tp: int, block_size: int) -> float:
    """Forward FLOPs of one GDN layer's chunked delta rule and short convolution on one rank.
    Per chunk of T tokens and value head: K S, Q S and K^T U (2 T d_k d_v each), K K^T and Q K^T
    (2 T^2 d_k each), the unit-triangular solve (T^2 d_v) and (D o QK^T) U (2 T^2 d_v): every term
    linear in the tokens for T <= B. The clean stream runs once more with values [0 | v] (width
    d_k + d_v) to build the transfer maps when a ring shares it."""
    H = max(1, layer.gdn_value_heads // tp)
    dk, dv = layer.gdn_key_dim, layer.gdn_value_dim

    def rule(tokens, sq, width):
        return H * (6 * dk * width * tokens + (4 * dk + 3 * width) * sq)

    flops = rule(w.clean_tokens, w.clean_sq, dv) + rule(w.noisy_tokens, w.noisy_tokens * block_size, dv)
    if w.ring > 1:
        flops += rule(w.clean_tokens, w.clean_sq, dk + dv)
    return flops + 2 * layer.gdn_conv_kernel * layer.gdn_conv_dim / tp * (w.clean_tokens + w.noisy_tokens)  # + conv


def gdn_layer_bytes(model: ModelConfig, layer: LayerShape, w: GDNRankWork, rows: int, tp: int, s: int,
                    block_size: int, kernel: str) -> float:
    """What one GDN layer keeps for backward on one rank: per row the norms' inputs/outputs, the
    in_proj output (conv channels, gate, beta, alpha), the conv output, fp32 q/k/v features (q, k
    repeated to the value heads), the fp32 core output and the gated norm; per chunk its fp32 start
    state (H x d_k x d_v); the boundary states received and the gathered transfer maps. The
    project's pure-torch rule (CPU kernels) also keeps about five fp32 T x T matrices per chunk and
    head (decays, A, the solve, Q K^T); a fused GPU kernel (`sparse` profiles) recomputes them."""
    H = max(1, layer.gdn_value_heads // tp)
    dk, dv = layer.gdn_key_dim, layer.gdn_value_dim
    conv, v = layer.gdn_conv_dim / tp, H * dv
    per_row = s * (4 * model.hidden_size / tp + conv + v + 2 * H + conv + v) + 4 * (H * (2 * dk + dv) + v)
    chunks = -(-w.clean_tokens // block_size) + w.max_runs + w.noisy_tokens // block_size
    state = _state_bytes(s) * H * dk * dv
    held = chunks * state + w.boundary_received * state
    if w.ring > 1:
        held += w.ring * w.max_runs * H * dk * (dk + dv) * _state_bytes(s) + chunks * H * dk * dk * 4
    tt = 5 * 4 * H * (w.clean_sq + w.noisy_tokens * block_size) if kernel != "sparse" else 0
    mlp = (3 if model.gated_mlp else 2) * layer.mlp_ffn * s / tp
    return rows * (per_row + mlp) + held + tt


def _clean_partials(lay: Layout, ring: int) -> int:
    """Partials over clean keys (CP: over all keys) a rank runs per layer: one after an all-gather,
    one per ring member when streamed (`ring`: 1 without CP)."""
    return ring if lay.transport == "ring" else 1


def partials_in_flight_bytes(w, layer: LayerShape, tp: int, s: int, lay: Layout, ring: int) -> float:
    """What the tiled kernel and the streamed merge keep for backward per layer
    beyond Megatron's per-row activations: per partial, its output in the kernel's fp32 (fp32
    inputs: the returned output shares it; else a second copy of `s` bytes) and fp32 lse, and the
    merge's two fp32 weights per query and head. The block-diagonal partial covers the noisy rows,
    each clean partial (one after an all-gather, one per ring chunk) all rows; CP runs its
    partials over all keys."""
    heads = max(1, layer.num_heads // tp)
    kv_heads = max(1, -(-layer.num_kv_heads // tp))
    out_row = heads * (layer.head_dim * (4 if s == 4 else 4 + s) + 4 + 8)
    if lay.kind == "cp":  # one partial (or one per ring chunk) over all keys
        return w.rows * _clean_partials(lay, ring) * out_row
    # Noisy rows run block-diagonally, folded into the batch: the kernel saves its folded copies
    # of q, k, v, and the output is unfolded into one more copy.
    fold_row = (2 * heads + 2 * kv_heads) * layer.head_dim * s
    return w.noisy_rows * (out_row + fold_row) + w.rows * _clean_partials(lay, ring) * out_row


def attention_transient_bytes(w, layer: LayerShape, tp: int, q_tile: int = 256, run_keys: int = 2048) -> float:
    """Working set of one tiled-kernel backward (live once, at the peak, not per layer): fp32
    grouped copies of q, k, v and their gradients, plus three [heads x q tile x run] fp32 chunk
    buffers (probabilities, dP, dS)."""
    heads = max(1, layer.num_heads // tp)
    kv_heads = max(1, -(-layer.num_kv_heads // tp))
    keys = w.clean_rows + w.kv_rows_gathered
    copies = 2 * 4 * layer.head_dim * (w.rows * heads + 2 * keys * kv_heads)
    return copies + 3 * 4 * heads * q_tile * min(run_keys, max(1, keys))  # + the chunk buffers


def mask_bytes(w, lay: Layout, ring: int, tile: int = 256) -> float:
    """Masks a plan keeps per attention window: row vectors (13 bytes a query, 9 a key) and
    tile tables (2 bytes a 256 x 256 tile) of each partial: linear in the rows (the tables in the
    tiles). At L = 256K on 16 ranks (CSBP): 2.7 MiB of vectors and 0.3 MiB of tables."""
    keys = w.clean_rows + w.kv_rows_gathered
    vectors = 13 * w.rows * _clean_partials(lay, ring) + 9 * keys
    return vectors + 2 * (-(-w.rows // tile)) * (-(-keys // tile))  # + the tables


def _step_terms(model: ModelConfig, lay: Layout, wl: "Workload", hw: HardwareProfile, gpus_per_node: int,
                dense_total: float, frozen: float = 0.0):
    """Gradient reduction, optimizer step and static memory of one layout (shared by both objectives):
    (t_grad, t_opt, static bytes)."""
    tp, S = lay.tp, lay.shard_group_size
    # (weight, grad, optimizer-state) bytes per parameter: fp32 training keeps fp32 weights, grads, Adam m
    # and v; bf16 main gradients of `grad_bytes`, fp32 master + m + v (or as the workload says)
    bf16_state = 12 if wl.optimizer_state_bytes is None else wl.optimizer_state_bytes
    wb, gb, ob = (4, 4, 8) if hw.dtype_bytes >= 4 else (2, wl.grad_bytes, bf16_state)
    dense_rank = dense_total / tp
    expert_rank = model.expert_params / (tp * lay.ep) if model.expert_params else 0.0
    if wl.lora is not None:  # the base is frozen (its weights only); the adapters train
        frozen += dense_total + expert_rank * tp
        dense_rank, expert_rank = adapter_params(model, wl.lora, model.layers, tp, lay.ep)
    D = lay.dp * S
    De = max(1, D // lay.ep)
    reduced = dense_rank * (D - 1) / D + expert_rank * (De - 1) / De
    grad_bytes = ((gb + wb) if lay.distributed_optimizer else 2 * gb) * reduced
    opt_params = dense_rank / D + expert_rank / De if lay.distributed_optimizer else dense_rank + expert_rank
    t_grad = (grad_bytes / _link(hw, lay.gpus, gpus_per_node)) * (1 - hw.grad_reduce_overlap) if D > 1 else 0.0
    t_opt = opt_params * (2 * ob + 2 * wb + gb) / (hw.hbm_gbps * 1e9)
    if wl.optimizer == "zero2":
        # the paper's trainer (`reference.zero2_static_bytes`): partitioned over the ranks of one
        # TP, EP and PP rank (DP x S / EP); buckets of the largest tensor, the embedding / output
        # layer (V h / TP): two with contiguous gradients and overlap, one when EP > 1 turns
        # contiguous gradients off. (The time terms stay the ones above.)
        static = zero2_static_bytes(dense_rank + expert_rank, De,
                                    model.vocab_size * model.hidden_size / tp, wb, 1 if lay.ep > 1 else 2)
    else:
        static = (wb + gb) * (dense_rank + expert_rank) + ob * opt_params
    return t_grad, t_opt, static + wb * frozen / tp


def _estimate(lay, wl, hw, micro, step, static, peak_bytes, sent_per_micro, time, parts, **extra) -> Estimate:
    """The estimate of a step; `static`: weights, gradients and optimizer state, `parts`: the other
    bytes of the peak by kind (the breakdown shows each in GiB, and the reserve)."""
    feasible = peak_bytes <= hw.memory_gib * GiB
    mem = {"weights_grads_optimizer": static / GiB, **{k: v / GiB for k, v in parts.items()},
           "reserved": hw.reserved_gib}
    return Estimate(
        layout=lay, step_time_s=step, tokens_per_s=micro * lay.dp * wl.seq_length / step,
        peak_memory_gib=peak_bytes / GiB, attn_bytes_per_gpu=int(micro * sent_per_micro), feasible=feasible,
        time=time, memory_gib=mem, **extra,
        why_infeasible="" if feasible else f"needs {peak_bytes / GiB:.1f} GiB > {hw.memory_gib:.1f} GiB",
    )


def _step_estimate(model, lay, wl, hw, gpus_per_node, t_sample, t_parts, sent, trained, live, parts, frozen=0.0):
    """The estimate of a PP-1 step: `wl.samples_per_replica` micro-batches of `t_sample` seconds
    each (`t_parts` by kind, `sent` attention bytes), gradient reduction and optimizer; the peak:
    the static bytes, `live` (by kind in `parts`) and the reserve."""
    micro = wl.samples_per_replica(lay.dp)
    t_grad, t_opt, static = _step_terms(model, lay, wl, hw, gpus_per_node, trained, frozen)
    time = {**{k: micro * v for k, v in t_parts.items()}, "grad_reduce_exposed": t_grad, "optimizer": t_opt}
    return _estimate(lay, wl, hw, micro, micro * t_sample + t_grad + t_opt, static,
                     static + live + hw.reserved_gib * GiB, sent, time, parts)


def estimate_drafter(model: ModelConfig, lay: Layout, wl: "Workload", hw: HardwareProfile,
                     gpus_per_node: int, baseline: Baseline = OURS) -> Estimate:
    """One DFlash drafter step (`--objective dflash`), per rank from `work.drafter_rank_work`: context
    and draft rows' GEMMs, the frozen LM head on the draft rows, the anchored mask's pairs, K/V
    traffic, memory; with `wl.dflash2`, the paper's DFlash2 terms (`reference.DFlash2Drafter`).
    Each term: docs/planner.md, the cost model's "DFlash drafter" row.
    """
    L, B, tp, s, h, V = wl.seq_length, wl.block_size, lay.tp, hw.dtype_bytes, model.hidden_size, model.vocab_size
    peak = hw.peak_tflops * 1e12
    gemm_rate, attn_rate, hbm = peak * hw.gemm_efficiency, peak * hw.attention_efficiency, hw.hbm_gbps * 1e9
    recompute = lay.recompute == "full"
    rc = 1 if recompute else 0  # the recompute's second forward
    passes_fwd = 1 + rc
    windows = _windows(model)
    work = {w: drafter_rank_work(L, B, wl.anchors, lay.cp, lay.bp, wl.doc_length, w) for w in windows}
    base = work[windows[0]]
    ring, link = _ring_link(lay, hw, gpus_per_node, baseline)
    lat, tp_link = hw.collective_latency_us * 1e-6, _link(hw, tp, gpus_per_node)
    # the reference CP path (`reference.py` (d)): every CP rank drafts every anchor
    replicated = baseline.replicated_anchors and lay.kind == "cp"
    feat_row = model.target_layers * h
    d2 = wl.dflash2
    if d2 is not None and tp > 1:
        raise ValueError("--tensor-model-parallel-size must be 1 for the DFlash2 drafter "
                         "(the reference's DFlash has no tensor parallelism)")
    trained = model.dense_params + (d2.extra_params(h, model.num_layers, V) if d2 is not None else 0)
    per_rank = []
    for r in range(len(base)):
        ctx = base[r].context_rows
        draft = sum(x.draft_rows for x in base) if replicated else base[r].draft_rows
        t = dict(gemm=0.0, attention=0.0, attn_comm_exposed=0.0, tp_comm=0.0, elementwise=0.0, output_layer=0.0)
        # fc over the context rows: forward and weight gradient (the features need no gradient)
        t["gemm"] += 2 * feat_row * h / tp * ctx * (2 + rc) / gemm_rate
        sent, acts = 0, 0.0
        for layer in model.layers:
            w = work[layer.window][r]
            pairs = sum(x.sparse_pairs for x in work[layer.window]) if replicated else w.sparse_pairs
            kv_params = h * layer.num_kv_heads * layer.head_dim * 2
            flops = 2 * (model.layer_dense_params(layer) - kv_params) / tp * draft + 2 * kv_params / tp * (draft + ctx)
            t["gemm"] += flops * (3 + rc) / gemm_rate
            attn_fwd = pairs * 4 * max(1, layer.num_heads // tp) * layer.head_dim / attn_rate
            t["attention"] += attn_fwd * (ATTN_FWD_BWD + rc)
            kv_row = _kv_row(layer, tp, s)
            per_pass = w.exchange_rows * kv_row
            sent += per_pass * (passes_fwd + 1)
            if per_pass:
                n_coll = 1 if (lay.transport == "allgather" or (lay.kind == "csbp" and layer.window)) else ring - 1
                t_pass = per_pass / link + n_coll * lat
                if (lay.transport == "ring" and not (layer.window is not None and lay.kind == "csbp")
                        and not (lay.kind == "cp" and baseline.cp_exposed_allgather)):
                    t["attn_comm_exposed"] += _ring_exposed(t_pass, attn_fwd, ring, passes_fwd)
                else:
                    t["attn_comm_exposed"] += (passes_fwd + 1) * t_pass
            if tp > 1:
                t["tp_comm"] += (passes_fwd + 1) * (4 * (draft + ctx) * h * s * (tp - 1) / tp / tp_link + 4 * lat)
            t["elementwise"] += ((draft + ctx) * h * s * hw.elementwise_bytes_per_row_layer_per_hidden / tp
                                 * (1.33 if recompute else 1.0) / hbm)
            # kept for backward: the draft rows' activations, the context rows' K/V (computed here
            # and received)
            acts_layer = draft * activation_bytes_per_row(model, layer, tp, s) + (ctx + w.exchange_rows) * kv_row
            if d2 is not None:
                acts_layer += draft * d2.conv_elements_per_draft_row(h) * s
                t["gemm"] += draft * d2.conv_flops_per_draft_row(h) * (3 + rc) / gemm_rate
            acts = max(acts, acts_layer) if recompute else acts + acts_layer
        if recompute:
            acts += (draft + ctx) * h * s / tp * model.num_layers
        # features read (`feature_buffers` device copies of them) and their projection
        features = wl.feature_buffers * ctx * feat_row * s + ctx * h * s
        if d2 is None:
            # frozen LM head on the draft rows: forward + input gradient
            t["output_layer"] = 2 * 2 * draft * h * V / tp / gemm_rate
            logits = draft * min(V, wl.vocab_chunk or V) / tp * (wl.logits_bytes if s < 4 else 2 * s)
        else:
            # the native objective on the supervised rows: logits forward, recomputed in backward,
            # input gradient (three GEMMs); kept state per row and the row block's workspace
            supervised = draft * (B - 1) // B
            t["output_layer"] = 3 * 2 * supervised * h * V / gemm_rate
            t["elementwise"] += d2.objective_hbm_bytes(supervised, V, s) / hbm
            logits = supervised * d2.objective_bytes_per_row(h, s) + d2.objective_workspace_bytes(supervised, h, V, s)
        per_rank.append((sum(t.values()), t, sent, acts + features + logits, (acts, features, logits)))
    t_sample, t_parts, sent_sample, _, _ = max(per_rank, key=lambda x: x[0])
    _, _, _, live, (acts, features, logits) = max(per_rank, key=lambda x: x[3])
    return _step_estimate(model, lay, wl, hw, gpus_per_node, t_sample, t_parts, sent_sample, trained, live,
                          {"activations": acts, "features": features, "logits": logits}, model.frozen_params)


def estimate(model: ModelConfig, lay: Layout, wl: Workload, hw: HardwareProfile, gpus_per_node: int,
             baseline: Baseline = OURS) -> Estimate:
    """Step time and peak memory of `lay`. `baseline`: how a CP layout is charged (`reference.py`:
    this project's CP, the default, or the paper's reference CP path)."""
    if wl.objective == "dflash":
        if not model.is_drafter:
            raise ValueError(f"--objective dflash needs a drafter model (a muse_glimmer_assistant config with "
                             f"target_layer_ids, e.g. --model dflash-drafter-muse-glimmer); {model.name} is not one")
        return estimate_drafter(model, lay, wl, hw, gpus_per_node, baseline)
    if wl.objective != "bd3lm":
        raise ValueError(f"--objective must be bd3lm or dflash, got {wl.objective!r}")
    if model.is_drafter:
        raise ValueError(f"{model.name} is a DFlash drafter: plan it with --objective dflash")
    if wl.packed and model.is_hybrid:  # as the trainer (model/bdlm.py) refuses it
        raise ValueError(f"--doc-length / --doc-length-histogram: {model.name} has Gated DeltaNet layers, which "
                         "--reset-attention-mask does not support (their recurrence would carry state across documents)")
    if lay.pp > 1:
        return estimate_pipelined(model, lay, wl, hw, gpus_per_node, baseline)
    L, B, tp, S = wl.seq_length, wl.block_size, lay.tp, lay.shard_group_size
    s, h, V = hw.dtype_bytes, model.hidden_size, model.vocab_size
    peak = hw.peak_tflops * 1e12
    gemm_rate, attn_rate, hbm = peak * hw.gemm_efficiency, peak * hw.attention_efficiency, hw.hbm_gbps * 1e9
    moe_rate = peak * hw.grouped_gemm_efficiency
    recompute = lay.recompute == "full"
    rc = 1 if recompute else 0  # the recompute's second forward
    passes_fwd = 1 + rc  # forward passes through the layers (recompute replays it)

    # ---- per-rank work of the real mask, for each distinct attention window ------------------
    windows = _windows(model)
    work = {w: rank_work(L, B, lay.cp, lay.bp, lay.schedule, model.clean_attention, w, wl.documents) for w in windows}
    base = work[windows[0]]
    ranks = range(len(base))
    gdn = gdn_rank_work(L, B, lay.cp, lay.bp, lay.schedule, model.clean_attention) if model.is_hybrid else None

    # ---- time of one sample on each rank; the group waits for the slowest ------------------------
    ring, link = _ring_link(lay, hw, gpus_per_node, baseline)
    ref_cp = lay.kind == "cp" and not baseline.is_ours
    lat, tp_link = hw.collective_latency_us * 1e-6, _link(hw, tp, gpus_per_node)
    # expected detached self-conditioning passes per sample: the EP ranks (each its own sample)
    # run it when any of them draws it (the reference's max over the EP group)
    self_cond = 1.0 - (1.0 - wl.self_conditioning_prob) ** lay.ep if wl.self_conditioning_prob else 0.0
    lora = wl.lora
    # GEMMs per linear, in units of its forward: forward, input gradient and (trained) weight
    # gradient, plus the recompute's forward; a frozen base linear (LoRA) skips the weight gradient
    base_gemms = (2 if lora else 3) + rc
    per_rank = []
    for r in ranks:
        rows, noisy = base[r].rows, base[r].noisy_rows
        t = dict(gemm=0.0, moe_gemm=0.0, attention=0.0, attn_comm_exposed=0.0, tp_comm=0.0, moe_comm=0.0,
                 elementwise=0.0, output_layer=0.0)
        sent, sc = 0, 0.0  # sc: one detached self-conditioning forward of this rank's noisy rows
        for layer in model.layers:
            w = work[layer.window][r]
            dense_flops = 2 * model.layer_dense_params(layer) / tp  # per row and forward
            t["gemm"] += dense_flops * rows * base_gemms / gemm_rate
            sc += dense_flops * noisy / gemm_rate
            if layer.num_experts:
                expert_flops = 2 * layer.topk * model.layer_expert_params(layer) / tp
                t["moe_gemm"] += expert_flops * rows * base_gemms / moe_rate
                sc += expert_flops * noisy / moe_rate
            if lora:  # the adapters' thin GEMMs (trained: 3 + recompute), bound by FLOPs or HBM bytes
                flops, hbm_bytes = layer_forward_cost(model, layer, lora, tp, s)
                t["lora"] = t.get("lora", 0.0) + (3 + rc) * rows * max(flops / gemm_rate, hbm_bytes / hbm)
                if tp > 1:  # a [rows, r] gather or reduce-scatter per adapted linear and pass
                    t["tp_comm"] += (passes_fwd + 1) * (
                        rows * layer_tp_reduced_bytes(model, layer, lora, s) * (tp - 1) / tp / tp_link + lat)
            if layer.is_gdn:
                gw = gdn[r]
                rec = gdn_recurrence_flops(gw, layer, tp, B) / attn_rate
                t["linear_attention"] = t.get("linear_attention", 0.0) + rec * (3 + rc)
                fwd_b, bwd_b = gdn_bytes_sent(gw, max(1, layer.gdn_value_heads // tp), layer.gdn_key_dim,
                                              layer.gdn_value_dim, layer.gdn_conv_dim // tp,
                                              layer.gdn_conv_kernel, s, _state_bytes(s))
                if ref_cp and baseline.gdn_all_rows:
                    # reference (c): the layer all-to-alls its in-projections (q, k, v and the value
                    # gate) of every row there and the core outputs back, instead of boundaries
                    width = (layer.gdn_conv_dim + layer.gdn_value_heads * layer.gdn_value_dim) // tp
                    fwd_b = bwd_b = int(rows * width * s * (S - 1) / S)
                    sent += passes_fwd * fwd_b + bwd_b
                    t["attn_comm_exposed"] += (passes_fwd * fwd_b + bwd_b) / link + (passes_fwd + 1) * 2 * lat
                    continue
                sent += passes_fwd * fwd_b + bwd_b
                if gw.ring > 1:  # two all-gathers and the boundary all-to-all, each waited on at once
                    n_coll = 2 + (1 if gw.boundary_sent or gw.boundary_received else 0)
                    t["attn_comm_exposed"] += (passes_fwd * fwd_b + bwd_b) / link + (passes_fwd + 1) * n_coll * lat
            else:
                pairs = w.dense_pairs if hw.attention_kernel == "dense_partials" else w.sparse_pairs
                heads_t = max(1, layer.num_heads // tp)
                attn_fwd = pairs * 4 * heads_t * layer.head_dim / attn_rate
                # (forward rate, backward rate, work factor): the reference CP path's (a) per-path
                # kernel rates and (c) the busiest contiguous clean slice; 1 for every other path
                fr, br, wf = baseline.cp_rates(layer.head_dim) if ref_cp else (1.0, 1.0, 1.0)
                if wf is None:
                    wf = contiguous_range_factor(L, B, layer.window)
                if ref_cp and baseline.contiguous_clean:
                    wf *= contiguous_clean_imbalance(L, B, S)
                t["attention"] += attn_fwd * wf * ((1 + rc) / fr + (ATTN_FWD_BWD - 1) / br)
                if self_cond:
                    # the noisy queries' half of the pairs (noisy and clean queries each see
                    # L (L + B) / 2 pairs of the mask; the layouts balance both over the ranks)
                    sc += 0.5 * (attn_fwd * wf / fr)
                # attention traffic (bytes sent by this rank in one pass)
                kv_row = _kv_row(layer, tp, s)
                if lay.kind == "csbp" and layer.kv_shared:
                    kv_row //= 2  # K=V layers: CSBP moves the raw k only, receivers derive K and V
                if lay.kind == "csbp" and _planned_exchange(layer, wl):
                    per_pass, n_coll = w.exchange_rows * kv_row, 1  # one variable all-to-all, received ~ sent
                elif lay.kind in ("cp", "csbp"):  # every row (CP) or the clean rows (CSBP) to the ring
                    per_pass = (rows if lay.kind == "cp" else w.clean_rows) * kv_row * (ring - 1)
                    n_coll = 1 if lay.transport == "allgather" else ring - 1
                else:
                    per_pass, n_coll = 0, 0
                sent += per_pass * (passes_fwd + 1)
                if per_pass:
                    t_pass = per_pass / link + n_coll * lat
                    if ref_cp and baseline.cp_exposed_allgather:
                        # reference (b): one all-gather of all rows, waited on before any attention;
                        # the dK/dV reduce-scatter waited on
                        t["attn_comm_exposed"] += (passes_fwd + 1) * (per_pass / link + lat)
                    elif lay.transport == "ring" and not (lay.kind == "csbp" and (layer.window is not None
                                                                                   or wl.packed)):
                        # (CSBP sliding or packed layers take the windowed strategy, one all-to-all)
                        t["attn_comm_exposed"] += _ring_exposed(t_pass, attn_fwd, ring, passes_fwd)
                    else:
                        # all-gather: CSBP's clean gather overlaps the noisy block-diagonal part (forward);
                        # CP's gather must finish before any of its attention; reduce-scatter is exposed
                        diag = (w.noisy_rows * B * 4 * heads_t * layer.head_dim / attn_rate
                                if lay.kind == "csbp" else 0.0)
                        t["attn_comm_exposed"] += passes_fwd * max(0.0, t_pass - diag) + t_pass
                if self_cond and lay.kind == "cp":
                    # CP splits every block over its ranks: the detached pass gathers the new noisy
                    # K/V again (the clean K/V of the trained pass are reused), forward only; the
                    # reference CP path waits on it, a ring hides it as in a forward pass
                    sc_pass = noisy * kv_row * (S - 1) / link + lat
                    if ref_cp and baseline.cp_exposed_allgather or lay.transport != "ring":
                        sc += sc_pass
                    else:
                        sc += max(0.0, sc_pass - 0.5 * attn_fwd * (ring - 1) / ring)
            if tp > 1:
                t["tp_comm"] += (passes_fwd + 1) * (4 * rows * h * s * (tp - 1) / tp / tp_link + 4 * lat)
            if layer.num_experts and lay.ep > 1:
                a2a = 2 * rows / tp * layer.topk * h * s * (lay.ep - 1) / lay.ep
                moe_link = _link(hw, tp * lay.ep, gpus_per_node)
                t["moe_comm"] += (passes_fwd + 1) * (a2a / moe_link + 2 * lat)
                if self_cond:
                    sc += a2a * noisy / rows / moe_link + 2 * lat
            t["elementwise"] += (rows * h * s * hw.elementwise_bytes_per_row_layer_per_hidden / tp
                                 * (1.33 if recompute else 1.0) / hbm)
        out_gemms = 2 if lora else 3  # the output layer (embedding) is frozen under LoRA
        t["output_layer"] = out_gemms * 2 * noisy * h * V / tp / gemm_rate
        if wl.encoder_ar_loss:  # the clean rows' AR loss: the output layer forward and backward
            t["output_layer"] += out_gemms * 2 * (rows - noisy) * h * V / tp / gemm_rate
        if self_cond:
            # the detached pass's vocabulary work: logits of the noisy rows and their soft
            # embedding (probabilities x the tied embedding), each 2 x rows x h x V
            sc += 2 * 2 * noisy * h * V / tp / gemm_rate
            t["self_conditioning"] = self_cond * sc
        per_rank.append((sum(t.values()), t, sent))
    t_sample, t_parts, sent_sample = max(per_rank, key=lambda x: x[0])

    # ---- memory of the largest rank ----------------------------------------------------------------
    mems = []
    for r in ranks:
        rows, noisy = base[r].rows, base[r].noisy_rows
        per_layer = []
        for layer in model.layers:
            w = work[layer.window][r]
            kept = rows * layer_kept_bytes(model, layer, lora, tp, s) if lora else 0.0
            if layer.is_gdn:
                per_layer.append(gdn_layer_bytes(model, layer, gdn[r], rows, tp, s, B, hw.attention_kernel) + kept)
                continue
            planned = lay.kind == "csbp" and _planned_exchange(layer, wl)
            kv_held = (w.exchange_rows if planned else w.kv_rows_gathered) * _kv_row(layer, tp, s)
            scores = 0
            if hw.attention_kernel == "dense_partials":
                # the math kernel keeps fp32 scores, their masked copy, the probabilities and
                # their zeroed copy of every partial's rectangle for backward (4 x 4 bytes per
                # computed pair and head), and the partial's dense bool mask (1 byte per pair)
                scores = (16 * max(1, layer.num_heads // tp) + 1) * w.dense_pairs
            elif hw.attention_kernel == "tiled":
                scores = partials_in_flight_bytes(w, layer, tp, s, lay, ring)
            per_layer.append(rows * activation_bytes_per_row(model, layer, tp, s) + kv_held + scores + kept)
        act = rows * h * s / tp * model.num_layers + max(per_layer) if recompute else sum(per_layer)
        # masks the plan keeps: row vectors and tile tables, for every kernel (none is dense)
        act += sum(mask_bytes(work[w][r], lay, ring) for w in windows)
        # the tiled backward's working set is live only once the loss and logits are freed
        transient = max([attention_transient_bytes(work[layer.window][r], layer, tp)
                         for layer in model.layers if not layer.is_gdn and hw.attention_kernel == "tiled"] or [0.0])
        if wl.loss_kernel == "native_ce":
            # the paper's trainer: kept state of every loss row, and one call's workspace (the
            # noisy rows'; with the encoder's AR loss, also the clean rows' call), V / TP columns
            calls = [noisy] + ([rows - noisy] if wl.encoder_ar_loss else [])
            logits = (sum(native_ce_kept_bytes(n, h, s) for n in calls)
                      + max(native_ce_workspace_bytes(n, h, V / tp, s) for n in calls))
        else:
            logit_rows = min(noisy, wl.loss_chunk_rows) if wl.loss_chunk_rows else noisy
            logits = logit_rows * V / tp * (wl.logits_bytes if s < 4 else 2 * s)
        mems.append((act + max(logits, transient), act, logits))
    act_total, act, logits = max(mems, key=lambda m: m[0])
    # per step: micro-batches, gradient reduction, optimizer
    return _step_estimate(model, lay, wl, hw, gpus_per_node, t_sample, t_parts, sent_sample, model.dense_params,
                          act_total, {"activations": act, "logits": logits})


# ---- pipeline parallelism in the cost model: P stages of a layout, each costed by `cost.estimate`.
#
# A layout with `pp` > 1 splits the model's layers evenly into `pp` stages (`--pipeline-model-
# parallel-size`, Megatron's even split); every stage runs the same TP x CP/BP layout on its layers.
# Per micro-batch (one sample) each stage's time is `cost.estimate` of a model holding only its
# layers (the output layer and logits only on the last stage, the embedding only on the first), plus
# its P2P: this rank's rows' hidden states, rows x hidden x bytes (/ TP under sequence parallelism),
# sent forward and their gradient received backward, exposed (Megatron's 1F1B waits on each).
#
# Schedules, m = global batch / DP micro-batches per step, t = the slowest rank's time for one
# micro-batch through all its layers:
#
# - 1F1B (`vp` = 1): step = (m + pp - 1) t + gradient reduction + optimizer; bubble (pp - 1) t,
#   i.e. (pp - 1) / m of the ideal m t (Narayanan et al. 2021, eq. 1).
# - interleaved 1F1B (`vp` = V > 1, `--num-layers-per-virtual-pipeline-stage`): each rank holds V
#   model chunks of layers / (pp V) layers, rank r chunks r, r + pp, ... (megatron-core's layout);
#   a chunk's pass takes t / V, so the bubble shrinks to (pp - 1) t / V, (pp - 1) / (V m) of the
#   ideal time (Megatron's interleaved schedule): step = (m + (pp - 1) / V) t + ... Every chunk
#   boundary is a P2P hop: V x the messages (and exposed seconds) of 1F1B per micro-batch. The
#   trainer's rules (`megatron_csbp/parallel/pipeline.py::check_pipeline_args`): m a multiple of pp, the
#   layers of a stage divisible by V.
#
# Memory of rank s (0-based): its weights, gradients and optimizer state; the activations in flight,
# in model chunks, as megatron-core's schedule warms up (`get_pp_rank_microbatches`): 1F1B
# min(pp - s, m) micro-batches; interleaved min(2 (pp - s - 1) + (V - 1) pp + 1, m V) chunks of 1/V
# of the rank's activations each, so the first rank holds pp + (pp - 1) / V micro-batches' worth,
# Megatron's `1 + (pp - 1) / (pp V)` interleaving penalty (`theoretical_memory_usage.py`); logits on
# the last rank only (one micro-batch at a time). The largest rank sets the layout's peak.


def stage_layers(model: ModelConfig, pp: int, vp: int = 1) -> List[tuple]:
    """The layers each pipeline rank holds: with `vp` virtual stages, rank r holds chunks r, r + pp,
    ..., r + (vp - 1) pp of layers / (pp vp) consecutive layers each (megatron-core's interleaved
    layout); `vp` = 1: one contiguous stage."""
    n = model.num_layers
    if n % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} must divide the model's {n} layers")
    if vp < 1 or (n // pp) % vp:
        raise ValueError(f"--num-virtual-stages-per-pipeline-rank {vp} must divide the {n // pp} layers of a "
                         f"pipeline stage ({n} layers / --pipeline-model-parallel-size {pp})")
    k = n // (pp * vp)
    return [tuple(l for v in range(vp) for l in model.layers[(v * pp + r) * k:(v * pp + r + 1) * k])
            for r in range(pp)]


def in_flight_chunks(rank: int, micro: int, pp: int, vp: int = 1) -> int:
    """Model chunks whose activations rank `rank` holds at its peak: megatron-core's warm-up
    forwards + 1 (`get_pp_rank_microbatches`, micro-batch groups of pp), at most every chunk of
    the step (m vp)."""
    warmup = pp - rank - 1 if vp == 1 else 2 * (pp - rank - 1) + (vp - 1) * pp
    return min(warmup + 1, micro * vp)


def estimate_pipelined(model: ModelConfig, lay, wl, hw: HardwareProfile, gpus_per_node: int, baseline=OURS):
    """A PP layout's step: each stage's layers estimated as a PP-1 layout (charged by `baseline`,
    `cost.estimate`'s), plus the 1F1B bubble, in-flight activations and P2P."""
    pp, vp = lay.pp, lay.vp
    flat = replace(lay, pp=1, vp=1)
    micro = wl.samples_per_replica(lay.dp)
    if vp > 1:  # the trainer's interleaving rules (`megatron_csbp/parallel/pipeline.py::check_pipeline_args`)
        if pp < 2:
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 "
                             f"(got {pp})")
        stage_layers(model, pp, vp)
        if micro % pp:
            raise ValueError(f"interleaved pipelining needs the micro-batches per iteration ({micro}) to be a "
                             f"multiple of --pipeline-model-parallel-size {pp}")
    one = Workload(**{**wl.__dict__, "global_batch_size": lay.dp})  # one micro-batch per replica
    # one stage boundary tensor per micro-batch (one direction): the largest rank's rows
    rows = max(w.rows for w in rank_work(wl.seq_length, wl.block_size, lay.cp, lay.bp, lay.schedule,
                                         model.clean_attention, None))
    p2p = int(rows * model.hidden_size * hw.dtype_bytes / lay.tp)
    # Megatron orders ranks tp-cp-ep-dp-pp: stages are gpus / pp ranks apart
    link, lat = _link(hw, lay.gpus // pp + 1, gpus_per_node), hw.collective_latency_us * 1e-6
    stages = []
    for s, layers in enumerate(stage_layers(model, pp, vp)):
        first, last = s == 0, s == pp - 1
        stage_model = replace(model, layers=layers)
        e = estimate(stage_model, flat, one, hw, gpus_per_node, baseline)
        t = {k: v for k, v in e.time.items() if k not in ("grad_reduce_exposed", "optimizer")}
        if not last:
            t["output_layer"] = 0.0
        # per micro-batch: the activation forward and its gradient backward over each boundary
        # (a middle stage's sends to the next and receives from the previous run together); with
        # virtual stages every one of the rank's vp chunks does so
        sends = vp * 2 - (1 if last else 0) - (1 if first else 0)  # boundary tensors this rank sends
        t["p2p_exposed"] = vp * 2 * (p2p / link + lat)
        # weights of the stage: its layers, the embedding (first) and the output layer (last)
        emb = model.vocab_size * model.hidden_size
        dense = sum(model.layer_dense_params(l) for l in layers) + (emb if first else 0) + (emb if last else 0)
        t_grad, t_opt, static = _step_terms(stage_model, flat, wl, hw, gpus_per_node, dense)
        acts = e.memory_gib["activations"] * GiB
        logits = e.memory_gib["logits"] * GiB if last else 0.0
        chunks = in_flight_chunks(s, micro, pp, vp)
        in_flight = chunks if vp == 1 else chunks / vp  # in micro-batches' worth of the rank's layers
        peak = static + in_flight * acts + logits + hw.reserved_gib * GiB
        stages.append(dict(time=t, t_micro=sum(t.values()), t_grad=t_grad, t_opt=t_opt, static=static, acts=acts,
                           in_flight=in_flight, logits=logits, peak=peak, sent=e.attn_bytes_per_gpu,
                           p2p_bytes=sends * p2p))
    slow = max(stages, key=lambda x: x["t_micro"])
    t_grad, t_opt = (max(x[k] for x in stages) for k in ("t_grad", "t_opt"))
    # the step in units of one rank's micro-batch time t: the m micro-batches plus the bubble,
    # (pp - 1) t for 1F1B, (pp - 1) t / vp for the interleaved schedule
    slots = micro + (pp - 1) / vp
    step = slots * slow["t_micro"] + t_grad + t_opt
    time = {k: slots * v for k, v in slow["time"].items()}
    time.update(grad_reduce_exposed=t_grad, optimizer=t_opt, pipeline_bubble=(slots - micro) * slow["t_micro"])
    worst = max(stages, key=lambda x: x["peak"])
    parts = {"activations": worst["in_flight"] * worst["acts"], "logits": worst["logits"]}
    info = {"schedule": "1F1B" if vp == 1 else "interleaved 1F1B", "virtual_stages": vp, "micro_batches": micro,
            "bubble_fraction": (slots - micro) / slots, "stage_peak_gib": [x["peak"] / GiB for x in stages],
            "in_flight_micro_batches": [x["in_flight"] for x in stages], "p2p_bytes_per_micro_batch": p2p,
            "p2p_bytes_per_gpu": micro * max(x["p2p_bytes"] for x in stages) * 2}
    return _estimate(lay, wl, hw, micro, step, worst["static"], worst["peak"], max(x["sent"] for x in stages), time,
                     parts, pipeline=info)
