"""block_diffusion_attention inside a real megatron-core GPT on one GPU, against float64: a tiny
block-diffusion GPT (BD3-LM objective, one forward + backward) on Megatron's local spec in bf16,
its core attention the plugin's (the default kernel: Flex on CUDA), against the same weights in
float64 (math kernel); and, where TransformerEngine is installed, the TE-spec model path (what
`megatron_csbp.training.megatron_lm.model_provider` builds for `--transformer-impl transformer_engine`).

Three models hold identical weight values (drawn once in bf16; the TE layer-norm weights fused
into `linear_qkv` / `linear_fc1` are renamed by megatron-core's own TE -> local key map,
`mcore_gpt_load_te_state_dict_pre_hook`):

- `ref`: local spec in float64, math kernel (the reference; its own rounding, ~2^-53 relative, and
  RoPE's fp32 tables, ~2^-24, are negligible);
- `local`: local spec in bf16, the default kernel;
- `te`: TE spec in bf16 (TELayerNormColumnParallelLinear, TERowParallelLinear, ...), only where
  TransformerEngine is installed (else reported "not installed": not run, not passed).

Bound for `local` (bf16 against fp64): every activation the bf16 model keeps is rounded to bf16
(relative error <= u/2 each, u = 2^-8), GEMMs and softmax accumulate in fp32; over two layers the
independent roundings add in quadrature to a few u on the loss and on the gradients (the CPU dry run
measures ~1.4u on the gradients). We require loss and gradient (relative 2-norm over all
parameters) errors <= 8u = 3.1e-2. A kernel that drops or adds keys (a wrong mask, a wrong lse
merge) changes the attention output by O(1) and the gradients by O(1) relative.

Error model (the bound): bf16 keeps 8 significant bits, unit roundoff u = 2^-8. Both bf16 paths
round the same quantities (projections, attention output, activations, residual sums) to bf16
and accumulate GEMMs in fp32; TE fuses layer norm into the following GEMM and runs its own GEMM
and norm kernels, which changes *where* the roundings fall, not how many or how large. So TE's
deviation from the fp64 reference is the same size as the local spec's: we require, for the loss
and for the gradients as one vector (relative 2-norm),

    err(te) <= 2 * err(local) + 8 u        (err = |x - ref| / |ref|)

the 2x covering the roundings landing elsewhere, 8u (3%) the few roundings TE adds or removes
per layer (fused norm output, TE's bias/residual epilogues) over two layers. A TE path that
computes something else (its own causal attention instead of the block-diffusion mask, a norm
weight not loaded, a missing bias) deviates by O(1) relative and fails by an order of magnitude.

    python tests/gpu/check_te_spec.py --out te_spec.json                 (CUDA; TE part where installed)
    python tests/gpu/check_te_spec.py --device cpu --out te_spec.json    (dry run: local bf16 vs fp64 only)

On CPU (or without TransformerEngine, whose classes megatron-core replaces by mock stand-ins)
only `local` vs `ref` runs and the JSON says the TE model did not ("te": "not installed ..." or
"not run: no CUDA device"). Exit status: 0 when every check that ran passed, 1 on a failed bound,
2 when CUDA was asked for and is absent.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

U_BF16 = 2.0 ** -8


def _init(device: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from megatron_csbp.parallel.spawn import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    from megatron_csbp.parallel import state as bps

    if device == "cpu":
        from megatron_csbp.compat.cpu import install_cpu_compat

        install_cpu_compat()
    bps.initialize_block_parallel(1, 1, 1, 1, 1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)


def _config(args, dtype: torch.dtype, device: str):
    from megatron_csbp.model import builder

    return builder.transformer_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
        num_query_groups=args.groups, ffn_hidden_size=4 * args.hidden_size, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False,
        bias_activation_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=device == "cpu")


def _gpt(args, spec, dtype, device):
    from megatron_csbp.model import builder

    gpt = builder.gpt_model(_config(args, dtype, device), spec, vocab_size=args.vocab_size,
                            max_sequence_length=args.seq_length, position_embedding_type="rope")
    return gpt.to(device)


def _local_names(state: dict) -> dict:
    """A TE-spec state dict under the local spec's keys (megatron-core's map); TE's `_extra_state`
    (FP8 metadata, empty in bf16) dropped."""
    from megatron.core.post_training.modelopt.gpt.state_dict_hooks import mcore_gpt_load_te_state_dict_pre_hook

    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    mcore_gpt_load_te_state_dict_pre_hook(state, "", {}, True, [], [], [])
    return state


def _run(gpt, args, tokens):
    """Loss and {local parameter name: gradient} of one BD3-LM forward + backward, single rank."""
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives.bd3lm import BD3LMObjective

    layout = SequenceLayout(BlockGeometry(args.seq_length, args.block_size), 1, 1, "mirrored")
    model = BlockDiffusionModel(gpt, BD3LMObjective(args.block_size, args.vocab_size - 1, seed=1234), layout,
                                bps.get_shard_rank(), bps.get_clean_ring_group(), "allgather")
    out = model(tokens, sample_index=torch.arange(tokens.shape[0]))
    out.loss.backward()
    grads = {n: p.grad.detach().double() for n, p in gpt.named_parameters() if p.grad is not None}
    return float(out.loss.detach().double()), grads


def _rel(x, ref) -> float:
    if isinstance(x, float):
        return abs(x - ref) / abs(ref)
    num = sum(float((x[k] - ref[k]).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].pow(2).sum()) for k in ref)
    return (num / den) ** 0.5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--kernel", default="auto",
                   help="the bf16 model's --attention-kernel (auto: the capability table's)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_te_spec: --device cuda but no CUDA device (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    t0 = time.time()
    _init(args.device)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_csbp.model import builder
    from megatron_csbp.model.spec import count_block_attention

    try:
        import transformer_engine  # noqa: F401
        have_te = True
    except ImportError:
        have_te = False
    record = {"device": args.device, "kernel": args.kernel, "seq_length": args.seq_length,
              "num_layers": args.num_layers, "hidden_size": args.hidden_size, "heads": args.heads,
              "groups": args.groups, "u_bf16": U_BF16,
              "reference": "local spec, float64, math kernel", "bound_local": "err(local) <= 8u",
              "bound": "err(te) <= 2 err(local) + 8u", "transformer_engine": have_te}

    torch.manual_seed(1234)
    local = _gpt(args, builder.local_layer_spec(kernel=args.kernel), torch.bfloat16, args.device)
    te = None
    if have_te and args.device == "cuda":
        te = _gpt(args, builder.with_block_diffusion(get_gpt_layer_with_transformer_engine_spec()), torch.bfloat16,
                  args.device)
        assert count_block_attention(te) == args.num_layers, "the TE spec lost the block-diffusion core attention"
        record["te_modules"] = sorted({type(m).__name__ for m in te.modules() if type(m).__name__.startswith("TE")})
        # the TE model's weights are the ones every model gets
        state = _local_names(te.state_dict())
        local.load_state_dict(state, strict=True)
    else:
        state = {k: v for k, v in local.state_dict().items() if not k.endswith("_extra_state")}
    # .double(): megatron-core's torch norms keep fp32 weights whatever params_dtype says
    ref = _gpt(args, builder.local_layer_spec(kernel="math"), torch.float64, args.device).double()
    ref.load_state_dict({k: v.double() for k, v in state.items()}, strict=True)

    gen = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, args.vocab_size - 1, (1, args.seq_length), generator=gen).to(args.device)
    loss_ref, g_ref = _run(ref, args, tokens)
    loss_local, g_local = _run(local, args, tokens)
    record.update(loss_ref=loss_ref, loss_local=loss_local, loss_err_local=_rel(loss_local, loss_ref),
                  grad_err_local=_rel(g_local, g_ref))
    record["local_bound"] = 8 * U_BF16
    record["local_ok"] = record["loss_err_local"] <= 8 * U_BF16 and record["grad_err_local"] <= 8 * U_BF16
    ok = record["local_ok"]
    if te is not None:
        loss_te, g_te = _run(te, args, tokens)
        g_te = _local_names(g_te)
        missing = sorted(set(g_ref) - set(g_te))
        if missing:
            raise RuntimeError(f"TE model has no gradient for {missing[:4]}")
        record.update(loss_te=loss_te, loss_err_te=_rel(loss_te, loss_ref), grad_err_te=_rel(g_te, g_ref))
        for what in ("loss", "grad"):
            bound = 2 * record[f"{what}_err_local"] + 8 * U_BF16
            record[f"{what}_bound"] = bound
            record[f"{what}_ok"] = record[f"{what}_err_te"] <= bound
            ok = ok and record[f"{what}_ok"]
    else:
        record["te"] = ("not run: no CUDA device (dry run)" if args.device != "cuda"
                        else "not installed: transformer_engine does not import (not run, not passed)")
    record["ok"], record["seconds"] = bool(ok), time.time() - t0
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record))
    from megatron_csbp.parallel import state as bps

    bps.destroy_block_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
