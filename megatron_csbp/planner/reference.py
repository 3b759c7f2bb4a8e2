"""Which context-parallel baseline the cost model charges: this project's (`ours`, the default) or
the paper's (`reference`, read from ScalingIntelligence/Turbo-dLLM), and the paper's recipe
workload (`recipe_workload`, `recipe_layout_options`, `recipe_fixed_step_s`).

Torch-free closed formulas. The four differences (kernels, transport, hybrid backbone, DFlash),
what was read where, and the fitted constants: docs/planner.md#the-paper-explained---baseline-reference-issue-24.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

# ---- FITTED constants (docs/planner.md names them; a GPU measurement in
# tests/gpu/check_reference_kernels.py would replace them) ----------------------------------------
# Rate of the compiled FlexAttention forward on the block-diffusion mask relative to the sparse FA4
# kernel CSBP runs, head dim 128 (backward runs FA4 there, rate 1). Fitted to the three Nemotron rows
# (predicted 1.21 / 1.20 / 1.21x against the paper's 1.19 / 1.18 / 1.18x; 1.23x for the 3B row when
# the planner picked the ring for its CSBP side, before the recipe's all-gather transport was modelled).
FLEX_FORWARD_RATE_128 = 0.68
# Rate of the compiled-Flex fallback (forward and backward) relative to FA4 at head dim 256. Fitted
# to the two hybrid Qwen rows, which need no kernel penalty at all (1.0: their gap is the exposed
# inter-node all-gather, the contiguous-slice imbalance and the GDN all-to-all); the DiffusionGemma
# rows hardly depend on it (its head-256 layers are sliding).
FLEX_RATE_256 = 1.0
# Time per optimizer step of the paper's DiffusionGemma runs that no counted term explains, added
# to the CP and the CSBP step alike (L-independent). FITTED to the paper's two DiffusionGemma 256K
# step times (DP1/EP2/CP8 2 x 262144 / 10557 tok/s = 49.66 s; +BP8 2 x 262144 / 15359 = 34.14 s):
# with T_cp, T_csbp the predicted steps without it (`--baseline reference`, the recipe workload,
# the MoE at the profile's assumed `grouped_gemm_efficiency` 0.30: 42.25 and 24.51 s), the
# least-squares constant is the mean residual ((49.66 - T_cp) + (34.14 - T_csbp)) / 2 = 8.519 s,
# rounded to 8.52 (steps 50.77 -> 33.03 s, residuals +1.11 and -1.11 s, 1.537x vs the paper's
# 1.45x; tests/test_planner_reference.py pins it). One parameter, and it also gives the three
# out-of-sample DiffusionGemma rows (64K, 128K, 512K) within 3 % (docs/planner.md). Not explained by
# the code read: candidates are the recipe's DeepSpeed ZeRO-2 optimizer step and its gradient
# reduce-scatter / parameter all-gather across the 2 nodes (`optimizer.backend: deepspeed_zero2`,
# estimated 1.3-2 s if all exposed), data loading and per-step host overheads. What would confirm
# it: a per-step profile of the reference's 16-GPU run (it cannot be measured on one GPU).
# `validate --paper --baseline reference` applies it to the paper's runs only (`recipe_fixed_step_s`).
REFERENCE_DG_FIXED_STEP_S = 8.52


@dataclass(frozen=True)
class Baseline:
    """How the CP baseline (`Layout.kind == 'cp'`) is charged; CSBP and BP are this project's in both."""

    name: str = "ours"
    flex_kernels: bool = False  # (a) per-head-dim kernel rates of the reference CP path
    cp_across_nodes: bool = False  # (b) CP / CSBP groups striped across nodes (inter_node_cp)
    cp_exposed_allgather: bool = False  # (b) all-gather of 2L rows waited on; reduce-scatter waited on
    contiguous_clean: bool = False  # (c) clean rows in contiguous slices (hybrid Qwen backbone)
    gdn_all_rows: bool = False  # (c) GDN all-to-all over all 2L rows
    replicated_anchors: bool = False  # (d) DFlash: every CP rank drafts every anchor

    @property
    def is_ours(self) -> bool:
        return self == OURS

    def cp_rates(self, head_dim: int):
        """(forward rate, backward rate, work factor) of the CP path's attention relative to the
        sparse kernel, at `head_dim`; (1, 1, 1) for ours."""
        if not self.flex_kernels:
            return 1.0, 1.0, 1.0
        if head_dim <= 128:
            return FLEX_FORWARD_RATE_128, 1.0, 1.0
        if head_dim <= 256:
            return FLEX_RATE_256, FLEX_RATE_256, 1.0
        return 1.0, 1.0, None  # head 512: the contiguous-range work factor, from the mask


# ---- the workload of the paper's runs, read from its benchmark recipes (not a baseline property:
# CP and CSBP both run it; `validate --paper --baseline reference` applies it) -------------------
# benchmarks/recipes/diffusiongemma_26b_sft_256k.yaml: objective `diffusiongemma_native_sft` with
# `self_conditioning_probability: 0.5` and `encoder_loss_weight: 1.0`. objectives/diffusiongemma.py
# and objectives/training.py: each sample draws self-conditioning with that probability; the
# detached decoder pass runs for the EP group's max count (`_synchronize_self_conditioning_
# execution_count`, a MAX all-reduce over EP), on the decoder (noisy) rows, reusing the clean
# stream's detached K/V (`_DiffusionGemmaCleanStream.detached`), with the vocabulary logits
# streamed into soft embeddings (work counts `detached_decoder_rows`, `self_conditioning_
# vocabulary_rows`); the clean encoder rows carry their own AR loss (`encoder_ar_vocabulary_rows`).
#
# benchmarks/recipes/dflash2_muse_glimmer_30b_1m.yaml (8 H100, the paper's DFlash2 rows): `dtype:
# bf16`, `optimizer.backend: torch_fused_adamw`, `activation_checkpointing: false`,
# `target_features: offline`. What the trainer then holds per GPU, for CP and CSBP alike (read in
# the reference, docs/planner.md "DFlash at 512K and 1M"):
#   - `DFlashBackboneExecutor.build_model` (backbones/dflash/executor.py) casts the whole drafter to
#     the recipe dtype (`model.to(device=device, dtype=dtype)`): bf16 parameters and gradients;
#   - `build_optimizer` (core/optim/zero.py) makes `torch_fused_adamw` a plain
#     `torch.optim.AdamW(..., fused=True)`: no ZeRO / FSDP sharding, m and v in the parameters'
#     dtype (bf16) on every rank: 2 + 2 + 4 = 8 bytes per trained parameter, replicated;
#   - `DFlashFeatureDataRuntime.next_batch` / `_advance_prefetch` (backbones/dflash/data.py): as
#     soon as a step takes its sample's features (the rank's CP intervals, `_target_intervals`), the
#     next sample's are copied to the device on a side stream: two feature buffers per step.


@dataclass(frozen=True)
class DFlash2Drafter:
    """What the paper's DFlash2 drafter adds to a plain DFlash drafter of the same shape, per rank:
    the grouped convolutions (parameters, kept tensors, kernel-projection GEMMs), the candidate
    selector, and the native vocabulary objective's GEMMs and whole-vocabulary fp32 workspace of one
    row block. Sizes: `DFLASH2_MUSE_GLIMMER`. What each counts, read from the reference code:
    docs/planner.md, row (h). Torch-free; every method a closed formula.
    """

    conv_kernel_size: int  # taps
    conv_group_size: int  # channels per dynamic-kernel group
    selector_rank: int
    selector_top_k: int
    logit_softcap: bool  # final_logit_softcapping set: the soft-cap branch of the top-k forward
    objective_row_block: int = 4096  # `_NativeFrozenLinearCETopK._ROW_BLOCK_SIZE`

    def groups(self, hidden: int) -> int:
        if hidden % self.conv_group_size:
            raise ValueError(f"DFlash2 conv_group_size {self.conv_group_size} must divide hidden size {hidden}")
        return hidden // self.conv_group_size

    def extra_params(self, hidden: int, num_layers: int, vocab: int) -> int:
        """Trained parameters beyond the plain drafter: per layer two convs (base kernel 2 x taps x
        h, projection h x 2 taps G), and the selector (two V x rank codebooks, h x rank)."""
        k, G = self.conv_kernel_size, self.groups(hidden)
        conv = 2 * k * hidden + hidden * 2 * k * G
        return num_layers * 2 * conv + 2 * vocab * self.selector_rank + hidden * self.selector_rank

    def conv_elements_per_draft_row(self, hidden: int) -> int:
        """Elements one draft row keeps per layer for the two convolutions: 4 h + 4 taps G."""
        return 4 * hidden + 2 * 2 * self.conv_kernel_size * self.groups(hidden)

    def conv_flops_per_draft_row(self, hidden: int) -> int:
        """Forward FLOPs per draft row and layer of the two kernel projections (h -> 2 taps G)."""
        return 2 * 2 * hidden * 2 * self.conv_kernel_size * self.groups(hidden)

    def objective_bytes_per_row(self, hidden: int, s: int) -> int:
        """Bytes one supervised row keeps for backward in the objective: the hidden copy (s h),
        lse and probability (fp32), top-k ids (int64) and values (fp32); the selector's
        predecessor, projection and context (rank each), successor (top_k x rank) and its fp32
        logits (top_k)."""
        k, r = self.selector_top_k, self.selector_rank
        return s * hidden + 2 * 4 + k * (8 + 4) + s * (3 * r + k * r) + 4 * k

    def objective_hbm_bytes(self, rows: int, vocab: int, s: int) -> int:
        """HBM bytes the objective's elementwise kernels move over the rows x V logits, per
        element: forward, the GEMM's fp32 write (4), the statistics kernel's two reads (max, then
        sum: 8), the soft-cap expression's four ops (read + write 4 each: 32), `topk` (one read
        counted: 4); backward, the recomputing GEMM's write (4), the gradient kernel (read +
        write: 8), the bf16 cast (read 4, write s), the input-gradient GEMM's read (s)."""
        per_element = 4 + 8 + (32 if self.logit_softcap else 0) + 4 + 4 + 8 + 4 + s + s
        return rows * vocab * per_element

    def objective_workspace_bytes(self, rows: int, hidden: int, vocab: int, s: int) -> int:
        """Peak transient bytes of the vocabulary objective over `rows` supervised rows."""
        if rows <= 0:
            return 0
        block = min(self.objective_row_block, rows)
        forward = block * vocab * 4 * (5 if self.logit_softcap else 1)
        backward = block * vocab * (4 + 4 + s) + rows * hidden * 4
        return max(forward, backward)


# The paper's drafter: the recipe's `model.id: incoai/Muse-Glimmer-30B-DFlash2` (revision 8336acb8)
# with `target_layer_ids: [2, 14, 26, 38, 50]`. Its `dflash_config` (public copies of
# z-lab/Muse-Glimmer-30B-DFlash2's config.json, docs/planner.md): conv_kernel_size 2,
# conv_group_size 16, selector_rank 256, selector_top_k 16, final_logit_softcapping 20.0, block 16,
# target_layer_ids [1, 13, 25, 37, 49] (the reference adds 1 to a native checkpoint's ids:
# `dflash_target_layer_ids`, which gives the recipe's list), hidden 6656, 5 sliding layers, 32 / 8
# heads of 128, intermediate 19968, vocab 202048: the `dflash-drafter-muse-glimmer` preset's shape
# plus these additions (its 2,772,159,744 parameters are within 4,468 of the 81-tensor,
# 5,544,328,424-byte bf16 payload published for the recipe's revision).
DFLASH2_MUSE_GLIMMER = DFlash2Drafter(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
                                      logit_softcap=True)

# ---- what the paper's trainer holds per GPU on its block-diffusion runs (docs/planner.md, row (i)):
# its optimizer and its loss, not Megatron's. Read in the reference code (commit ae1eb3b):
#
# Optimizer: both 256K recipes (`benchmarks/recipes/diffusiongemma_26b_sft_256k.yaml`,
# `qwen3_8_27b_fast_dllm_v2_256k.yaml`) set `optimizer.backend: deepspeed_zero2`; the Nemotron runs
# have no recipe in the repository and take the run spec's defaults (`OptimizerRunSpec.backend`
# "auto", which `core/optim/zero.py: resolve_optimizer_backend` makes "deepspeed_zero2" in any
# distributed launch; `TrainingRunSpec.activation_checkpointing` True, scope "full"; model dtype
# bf16). `initialize_deepspeed_zero2` hands DeepSpeed (ZeRO stage 2, `bf16.enabled`) an MPU whose
# data-parallel group is `optimizer_data_parallel_group_ranks` (`core/parallel/groups.py`): every
# rank of the same TP, EP and PP rank, i.e. the DP x CP/BP ranks ("ZeRO should partition over DP x
# fused(CP, BP) for each TP rank", `core/parallel/deepspeed.py`). DeepSpeed's stage-2 optimizer
# (`runtime/zero/stage_1_and_2.py`) then keeps per GPU: the bf16 parameters (2 bytes each,
# replicated), and over the group of N ranks the bf16 gradient partition (2 / N), the fp32 master
# partition (4 / N) and Adam's fp32 m and v (8 / N); in backward, with `contiguous_gradients` (the
# run spec's default, turned off when EP > 1) one bf16 bucket of `reduce_bucket_size` elements,
# two with `overlap_comm` (default on); without contiguous gradients the parameters' own gradients
# fill one bucket before it is reduced. `zero_reduce_bucket_size` defaults to 0, which
# `_resolve_zero_reduce_bucket_size` makes the largest trainable tensor (the embedding / output
# layer, V x h / TP, in every preset). Megatron instead keeps fp32 main gradients of every
# parameter (4 bytes each, not sharded) beside the sharded 12: 6 + 12 / N against 2 + 14 / N.
#
# Loss: the Nemotron backbone (`models/backbones/nemotron/model.py`, which the DiffusionGemma and
# Qwen3.8 backbones reuse) computes the loss with `tiled_linear_cross_entropy` (TP 1) or the
# vocab-parallel output head's `parallel_cross_entropy` (TP > 1), both on CUDA the native kernels of
# `csrc/fused_linear_ce/fused_linear_ce_cuda.cu` ("avoiding full sequence logits
# materialization"): the rows run in blocks of `native_ce_block_size` rows (row_block_size 0): the
# resident rows of the GPU, SMs x (2048 / kThreads) = 132 x 8 = 1056 on H100 / H200 SXM, rounded
# down to a multiple of kThreads / 2 = 128: 1024 (the memory bound, free bytes / (V x 10), is
# larger); forward keeps one fp32 [block, V] logits buffer; backward recomputes it and writes fp32
# gradient logits and their bf16 copy for the GEMMs ([block, V] x (4 + 4 + 2) bytes), an fp32
# [rows, h] input gradient and an fp32 [V, h] weight gradient, each cast to bf16 at the end. Kept
# for backward: the rows' hidden states and fp32 lse and loss. Megatron instead materialises the
# bf16 logits of every loss row and their fp32 copy (6 bytes x rows x V).
NATIVE_CE_THREADS = 256  # kThreads, csrc/fused_linear_ce/fused_linear_ce_cuda.cu
HOPPER_SMS = 132  # H100 / H200 SXM streaming multiprocessors
HOPPER_MAX_THREADS_PER_SM = 2048  # sm_90


def native_ce_block_rows(sms: int = HOPPER_SMS, max_threads_per_sm: int = HOPPER_MAX_THREADS_PER_SM,
                         threads: int = NATIVE_CE_THREADS) -> int:
    """Rows per block of the reference's native linear cross entropy (`native_ce_block_size` with
    row_block_size 0, when memory does not bind): the resident thread blocks of the GPU rounded down
    to a multiple of threads / 2. 1024 on H100 / H200."""
    resident = sms * max(1, max_threads_per_sm // threads)
    granule = max(1, threads // 2)
    return resident // granule * granule if resident >= granule else resident


NATIVE_CE_BLOCK_ROWS = native_ce_block_rows()


def native_ce_kept_bytes(rows: int, hidden: int, s: int) -> int:
    """What the native linear CE keeps for backward over `rows` loss rows: their hidden states (s
    bytes each) and fp32 lse and loss."""
    return rows * (s * hidden + 4 + 4)


def native_ce_workspace_bytes(rows: int, hidden: int, vocab: float, s: int, block: int = NATIVE_CE_BLOCK_ROWS,
                              weight_grad: bool = True) -> float:
    """Peak transient bytes of one native linear-CE call over `rows` rows and `vocab` vocabulary
    columns (V / TP under the vocab-parallel head): the larger of forward (fp32 [b, V] logits) and
    backward (fp32 logits and gradient logits and, below fp32, their s-byte copy, per [b, V]; the
    fp32 [rows, h] input gradient and, when the head is trained, the fp32 [V, h] weight gradient,
    each with its s-byte cast), b = min(block, rows)."""
    if rows <= 0:
        return 0.0
    b = min(block, rows)
    cast = s if s < 4 else 0
    forward = b * vocab * 4
    backward = b * vocab * (8 + cast) + rows * hidden * (4 + s)
    if weight_grad:
        backward += vocab * hidden * (4 + s)
    return max(forward, backward)


def zero2_static_bytes(params: float, group: int, largest_param: float, s: int, buckets: int) -> float:
    """DeepSpeed ZeRO-2 (bf16) per GPU for `params` trained parameters on this rank, partitioned
    over `group` ranks: s-byte parameters (replicated), the s-byte gradient partition, the fp32
    master partition and Adam's fp32 m and v, plus `buckets` gradient buckets of `largest_param`
    elements (s bytes each): 2 + 14 / N bytes per parameter at bf16."""
    return s * params + (s + 12) * params / max(1, group) + buckets * largest_param * s


_BD3LM_RECIPE = {"optimizer": "zero2", "loss_kernel": "native_ce"}

RECIPE_WORKLOADS = {
    **{name: dict(_BD3LM_RECIPE) for name in ("nemotron-diffusion-3b", "nemotron-diffusion-8b", "nemotron-diffusion-14b",
                                              "qwen3-27b-like", "qwen3.5-27b-like", "qwen3.8-27b-like")},
    "diffusiongemma-26b-a4b": {"self_conditioning_prob": 0.5, "encoder_ar_loss": True, **_BD3LM_RECIPE},
    "dflash-drafter-muse-glimmer": {"grad_bytes": 2, "optimizer_state_bytes": 4, "feature_buffers": 2,
                                    "dflash2": DFLASH2_MUSE_GLIMMER},
}
# the layout options the recipe fixes: no activation checkpointing (`benchmarks/profile_parallel_
# modes.sh` changes only the CP and BP sizes between its `cp` and `fused` runs), and the replicated
# optimizer (not Megatron's distributed one)
RECIPE_LAYOUT_OPTIONS = {
    "dflash-drafter-muse-glimmer": {"recompute": ("none",), "distributed_optimizer": False},
    # the block-diffusion runs: full activation checkpointing (`activation_checkpointing: true`,
    # `activation_checkpointing_scope: full` in both 256K recipes; the run spec's defaults for
    # Nemotron) and CSBP's clean K/V by the collective transport, an all-gather, not the streamed
    # ring (`kernel.cp_bp_clean_kv_transport: collective` in the Qwen recipe; `KernelRunSpec`'s
    # default, which the others take)
    **{name: {"recompute": ("full",), "transports": ("allgather",)}
       for name in RECIPE_WORKLOADS if name != "dflash-drafter-muse-glimmer"},
}


def recipe_workload(model_name: str) -> dict:
    """`Workload` fields of the paper's recipe for the model preset `model_name` ({} if none)."""
    return dict(RECIPE_WORKLOADS.get(model_name, {}))


def recipe_layout_options(model_name: str) -> dict:
    """`search.candidate_layouts` keyword arguments the paper's recipe fixes for `model_name`
    ({} if none): its recompute choice, its K/V transport and whether the optimizer state is
    sharded."""
    return dict(RECIPE_LAYOUT_OPTIONS.get(model_name, {}))


# the FITTED unexplained time per step of each model's paper runs (docs/planner.md, row (f))
RECIPE_FIXED_STEP_S = {"diffusiongemma-26b-a4b": REFERENCE_DG_FIXED_STEP_S}


def recipe_fixed_step_s(model_name: str) -> float:
    """Seconds added to every step (CP and CSBP alike) of the paper's runs of the model preset
    `model_name` (0 if none); `validate --paper --baseline reference` applies it."""
    return RECIPE_FIXED_STEP_S.get(model_name, 0.0)


OURS = Baseline()
REFERENCE = Baseline("reference", flex_kernels=True, cp_across_nodes=True, cp_exposed_allgather=True,
                     replicated_anchors=True)
# the reference code's hybrid Qwen backbone (qwen3_8) serves Qwen3.5- and Qwen3.8-27B alike
REFERENCE_HYBRID_QWEN = replace(REFERENCE, contiguous_clean=True, gdn_all_rows=True)

BASELINES = ("ours", "reference")


def baseline_for(name: str, model_name: str = "") -> Baseline:
    """The baseline called `name` ('ours' or 'reference') for the model preset `model_name`."""
    if name == "ours":
        return OURS
    if name == "reference":
        return REFERENCE_HYBRID_QWEN if model_name.startswith("qwen") else REFERENCE
    raise ValueError(f"--baseline {name!r}: must be one of {', '.join(BASELINES)}")


def contiguous_range_factor(seq_length: int, block_size: int, window: Optional[int] = None) -> float:
    """Computed pairs / allowed pairs when every query tile runs one contiguous key-tile range over
    [noisy ; clean] keys instead of a sparse tile list (the reference CP path at head dim 512).

    Noisy block b (b >= 1) needs its own block [bB, bB + B) and the clean prefix [L, L + bB): the
    range covers L keys per query instead of (b + 1) B; block 0 its B keys. Clean queries attend a
    contiguous clean range already (block- or token-causal). Allowed: L (L + B) / 2 noisy +
    L (L + B) / 2 clean (block-causal; token-causal clean differs by L (B - 1) / 2, ignored here).
    Tends to 1.5 as L / B grows. Sliding layers (a window) have their own path: factor 1."""
    if window is not None:
        return 1.0
    L, B = seq_length, block_size
    n = L // B
    noisy_range = B * B + (n - 1) * B * L
    clean = L * (L + B) // 2  # allowed pairs of the clean queries, and of the noisy ones
    return (noisy_range + clean) / (clean + clean)


def contiguous_clean_imbalance(seq_length: int, block_size: int, ranks: int) -> float:
    """Busiest rank's attention pairs / mean when the noisy rows are balanced over `ranks` and the
    clean rows are dealt in contiguous slices (the reference hybrid Qwen CP path), block-causal clean.

    Noisy pairs L (L + B) / 2 split evenly; clean query in block c sees (c + 1) B keys, so the last
    slice (blocks [(P-1) n / P, n)) holds the most: sum over its blocks of B (c + 1) B. At P = 8,
    L >> B: (1/P + (2P - 1) / P^2) / (2 / P) = 1.4375."""
    L, B, P = seq_length, block_size, ranks
    n = L // B
    if P <= 1:
        return 1.0
    noisy_each = L * (L + B) / 2 / P
    lo = (P - 1) * n // P
    clean_last = sum(B * (c + 1) * B for c in range(lo, n))
    mean = L * (L + B) / P
    return (noisy_each + clean_last) / mean
