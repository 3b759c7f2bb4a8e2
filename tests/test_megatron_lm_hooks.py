"""Megatron-LM hooks. The argv rewrite is tested always; the checks against a real Megatron-LM
checkout (its parse_args/validate_args with our extra_args_provider, its initialize call through
our hook, our model provider and forward step on gloo) run when Megatron-LM's training package is
found (`megatron_csbp.utils.megatron_lm_path`: MEGATRON_LM_PATH, else the cache of the installed
megatron-core's tag: core_v0.16.1 on megatron-core 0.16.1, core_v0.19.0 on 0.19.2; Megatron-LM's
training package imports triton, in the requirements files). The end-to-end pretrain() runs are in
tests/test_megatron_lm_pretrain.py."""
import os
import sys

import pytest
import torch

from megatron_csbp.training.megatron_lm import rewrite_argv
from megatron_csbp.utils.megatron_lm_path import find, missing_message
from tests.distributed import run_distributed

MLM = find()
needs_megatron_lm = pytest.mark.skipif(not MLM, reason=missing_message())


def test_rewrite_argv_puts_bp_inside_cp():
    out = rewrite_argv(["--context-parallel-size", "2", "--block-parallel-size", "8", "--seq-length", "64"])
    assert out[out.index("--context-parallel-size") + 1] == "8"
    assert out[out.index("--bdlm-context-parallel-size") + 1] == "2"
    assert "--calculate-per-token-loss" in out
    assert rewrite_argv(out) == out  # idempotent
    out = rewrite_argv(["--block-parallel-size=2"])
    assert out[out.index("--context-parallel-size") + 1] == "2"
    with pytest.raises(SystemExit, match="multiple of --context-parallel-size"):
        rewrite_argv(["--context-parallel-size", "2", "--block-parallel-size", "3"])


ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 1 --global-batch-size 2 --block-parallel-size 2 --block-size 8 --mask-token-id 5 "
        "--vocab-size 64 --tokenizer-type NullTokenizer --attention-dropout 0 --hidden-dropout 0 --distributed-backend gloo "
        "--transformer-impl local --use-cpu-initialization --position-embedding-type rope --normalization RMSNorm "
        "--disable-bias-linear --no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion "
        "--no-bias-dropout-fusion --no-rope-fusion --lr 1e-3 --train-iters 1 --mock-data").split()


def _with_megatron_lm():
    for p in (os.environ.get("MEGATRON_LM_EXTRA_PATH"), MLM):
        if p and p not in sys.path:
            sys.path.insert(0, p)


def _hook_rank(rank, world_size, extra=(), model_only=False):
    _with_megatron_lm()
    from megatron_csbp.compat.megatron_lm import install_megatron_lm_cpu_compat
    install_megatron_lm_cpu_compat()
    from megatron.core import parallel_state as mpu
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args
    from megatron_csbp.training import megatron_lm
    from megatron_csbp.parallel import state as bps

    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's rule for CP > 1 (no GPU architecture on CPU)
    sys.argv = ["pretrain_bdlm.py"] + rewrite_argv(ARGV + list(extra))
    args = parse_args(megatron_lm.extra_args_provider)
    validate_args(args, {})
    global_vars.build_tokenizer(args)  # sets args.padded_vocab_size (128)
    set_args(args)
    megatron_lm.install_initialize_hook()
    # Megatron-LM's own call (megatron/training/initialize.py, core_v0.16.1 and core_v0.19.0).
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                  args.virtual_pipeline_model_parallel_size,
                                  context_parallel_size=args.context_parallel_size,
                                  expert_model_parallel_size=args.expert_model_parallel_size,
                                  order="tp-cp-ep-dp-pp", create_gloo_process_groups=True)
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    model = megatron_lm.model_provider()
    if model_only:
        return [type(layer.mlp).__name__ for layer in model.bdlm.gpt.decoder.layers]
    g = torch.Generator().manual_seed(3)
    text = torch.randint(6, 60, (1, 33), generator=g)
    labels = text[:, 1:].clone()
    labels[0, [3, 20]] = 5  # the mask id (--allow-mask-token-in-vocab data): never a target
    loss_mask = torch.ones(1, 32)
    loss_mask[0, [7, 8, 20]] = 0  # e.g. --eod-mask-loss or padding
    batch = dict(tokens=text[:, :-1], labels=labels, loss_mask=loss_mask, position_ids=torch.arange(32)[None])
    args.consumed_train_samples = 0
    loss, lf = megatron_lm.forward_step(iter([batch]), model)
    out, num_tokens, report = lf(loss)
    out.backward()
    grads = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
    args.lora_rank, args.lora_init = 4, "random"  # the same chunk with --lora-rank 4 --lora-init random
    lora = megatron_lm.model_provider()
    args.lora_rank = 0
    loss, lf = megatron_lm.forward_step(iter([batch]), lora)
    lf(loss)[0].backward()
    trained = {n for n, p in lora.named_parameters() if p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0}
    return dict(lora_state=sorted(lora.sharded_state_dict()), trained=sorted(trained),
                frozen=sorted(n for n, p in lora.named_parameters() if not p.requires_grad),
                lora_names=sorted(n for n, _ in lora.named_parameters() if "lora_" in n),
                full_state=sorted(model.sharded_state_dict()),
                dp=args.data_parallel_size, seq=mpu.get_context_parallel_world_size(), kind=model.bdlm.layout.kind,
                bp=bps.get_block_parallel_sizes().block_parallel_size, report=report["lm loss"].detach(), grads=grads,
                num_tokens=int(num_tokens))


@needs_megatron_lm
def test_real_megatron_lm_args_initialize_model_forward():
    res = run_distributed(_hook_rank, 2)
    for r in res:
        assert r["dp"] == 1 and r["seq"] == 2 and r["bp"] == 2 and r["kind"] == "bp"
        assert r["grads"] > 0
    # The supervised-token count (loss_mask, less labels equal to the mask id) is counted once per
    # sample over the shard group: 32 - 3 masked by loss_mask - 1 more label equal to the mask id.
    assert sum(r["num_tokens"] for r in res) == 28
    total = sum(r["report"][0] for r in res) / sum(r["report"][1] for r in res)
    assert torch.isfinite(total) and total > 0
    # --lora-rank under pretrain(): only the adapters train, and Megatron-LM's checkpoints of the chunk
    # hold them alone (their base comes from --pretrained-checkpoint: the slow test of
    # tests/test_megatron_lm_pretrain.py saves, checks and resumes one)
    for r in res:
        assert len(r["lora_names"]) == 16 and r["trained"] == r["lora_names"] and r["frozen"]
        assert not set(r["frozen"]) & set(r["lora_names"])
        assert len(r["lora_state"]) == 16 and all(k.endswith((".lora_A", ".lora_B")) for k in r["lora_state"])
        assert "decoder.final_layernorm.weight" in r["full_state"]


@needs_megatron_lm
def test_moe_layer_freq_places_the_moe_layers_under_pretrain():
    """--moe-layer-freq under pretrain(): MoE every 2nd layer (an int) and a 0/1 pattern build MoE
    layers where the flag says and dense ones elsewhere, as the trainer and Megatron-LM's own GPT
    builder do (the model provider took one layer spec for every layer before)."""
    moe = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq"]
    assert run_distributed(_hook_rank, 2, moe + ["2"], True)[0] == ["MoELayer", "MLP", "MoELayer", "MLP"]
    assert run_distributed(_hook_rank, 2, moe + ["([0,1,1,0])"], True)[0] == ["MLP", "MoELayer", "MoELayer", "MLP"]


def _without(argv, flag):
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def _validation_rank(rank, world_size):
    _with_megatron_lm()
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args
    from megatron_csbp.training import megatron_lm

    megatron_lm.install_validation_hook()
    # where the tag validates its arguments (core_v0.16.1: initialize, core_v0.19.0: arguments)
    validate_args = megatron_lm.validation_module().validate_args
    base = _without(_without(ARGV, "--block-parallel-size"), "--mask-token-id")

    def parsed(extra):
        sys.argv = ["pretrain_bdlm.py"] + rewrite_argv(base + extra)
        return parse_args(megatron_lm.extra_args_provider)

    refusals = {}
    # Megatron-LM's defaults (learned_absolute, dropout 0.1), which the plugin cannot honour, and the
    # packed-document flags, which it now accepts.
    for drop, add in [("rope", []), ("--attention-dropout", []), ("--hidden-dropout", []),
                      ("--distributed-backend", []), (None, ["--reset-attention-mask"]),
                      (None, ["--reset-position-ids"]), (None, ["--eod-mask-loss"]), ("--mock-data", [])]:
        argv = list(base)
        if drop == "--mock-data":  # no data flag at all: before, Megatron-LM's 51-line dataset error
            argv.remove(drop)
        elif drop:
            argv = _without(argv, "--position-embedding-type" if drop == "rope" else drop)
        sys.argv = ["pretrain_bdlm.py"] + rewrite_argv(argv + add)
        args = parse_args(megatron_lm.extra_args_provider)
        try:
            validate_args(args, {})  # the plugin's checks, then Megatron-LM's validate_args
        except ValueError as e:
            refusals[drop or add[0]] = str(e)
    # --eval-interval unset (ARGV has none): Megatron-LM 0.16.1's own sample arithmetic divides by it
    from megatron.training.global_vars import set_args
    from megatron.training.training import get_train_valid_test_num_samples

    args = parsed([])
    validate_args(args, {})
    set_args(args)
    eval_interval = (args.eval_interval, get_train_valid_test_num_samples())
    args = parsed([])
    args.train_iters, args.train_samples = None, 64
    try:
        megatron_lm.default_eval_interval(args)
    except ValueError as e:
        eval_interval += (str(e),)
    masks, vocab = {}, None
    for name, extra in [("default", []), ("in_vocab", ["--mask-token-id", "5"]),
                        ("allowed", ["--mask-token-id", "5", "--allow-mask-token-in-vocab"]),
                        ("outside", ["--mask-token-id", "128"]), ("padding", ["--mask-token-id", "100"]),
                        ("no_room", ["--make-vocab-size-divisible-by", None])]:
        args = parsed([str(vocab) if e is None else e for e in extra])  # no_room: padded to the vocabulary
        tokenizer = global_vars.build_tokenizer(args)  # sets args.padded_vocab_size (Megatron pads to 128 here)
        vocab = int(tokenizer.vocab_size)
        try:
            masks[name] = megatron_lm.resolve_mask_token_id(args, tokenizer)
        except ValueError as e:
            masks[name] = str(e)
    return refusals, masks, eval_interval, vocab


@needs_megatron_lm
def test_unsupported_flags_eval_interval_and_mask_id_at_validation():
    refusals, masks, eval_interval, vocab = run_distributed(_validation_rank, 1)[0]
    # unset --eval-interval: --train-iters 1 + 1, so Megatron-LM sizes train 1 x 2 samples and
    # validation/test --eval-iters (default 100) x 2 (its formula: (train_iters // interval + 1) x 100 x 2)
    assert eval_interval[0] == 2 and tuple(eval_interval[1])[:3] == (2, 200, 200)
    assert "--eval-interval is unset: Megatron-LM divides --train-iters by it" in eval_interval[2]
    assert "--position-embedding-type learned_absolute is not supported" in refusals["rope"]
    assert "--attention-dropout 0.1 is not supported" in refusals["--attention-dropout"]
    assert "--hidden-dropout 0.1 is not supported" in refusals["--hidden-dropout"]
    assert refusals["--mock-data"] == ("no training data: pass --data-path PREFIX (a .bin/.idx pair that python -m "
                                       "megatron_csbp.data.preprocess writes) or --mock-data")
    if not torch.cuda.is_available():  # Megatron-LM's default nccl, on a machine without CUDA
        assert refusals["--distributed-backend"].startswith("--distributed-backend nccl needs CUDA GPUs")
        assert "pass --distributed-backend gloo" in refusals["--distributed-backend"]
    # Megatron's packed-document flags are honoured (issue 22: docs/semantics.md "Packed documents")
    assert not {"--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"} & set(refusals)
    # NullTokenizer(64): Megatron-LM core_v0.16.1's produces ids 0..64 (64 = EOD), core_v0.19.0's (megatron-core
    # 0.19's NullTokenizer) 0..63 (63 = EOD); Megatron pads the vocabulary to 128 and the mask id is the first
    # padding id.
    assert vocab in (64, 65) and masks["default"] == vocab
    assert "--mask-token-id 5 is an id the tokenizer can produce" in masks["in_vocab"]
    assert "--allow-mask-token-in-vocab" in masks["in_vocab"]
    assert masks["allowed"] == 5 and masks["padding"] == 100
    assert "--mask-token-id 128 is outside the padded vocabulary [0, 128)" in masks["outside"]
    assert f"no id past the tokenizer's {vocab}" in masks["no_room"]


def _interrupted_lora_save_rank(rank, world_size, root):
    """Megatron-LM's own `save_checkpoint` of a --lora-rank chunk, through the plugin's hook, on one rank, with
    the tracker file unwritable (a folder in its place): the run stops where Megatron-LM would name the
    iteration. What the iteration folder holds by then."""
    _with_megatron_lm()
    from megatron_csbp.compat.megatron_lm import install_megatron_lm_cpu_compat
    install_megatron_lm_cpu_compat()
    from megatron.core import parallel_state as mpu
    from megatron.training import global_vars, training
    from megatron.training.arguments import parse_args, validate_args
    from megatron_csbp.training import megatron_lm

    lora = ["--lora-rank", "4", "--save", root, "--save-interval", "1", "--no-save-optim"]
    sys.argv = ["pretrain_bdlm.py"] + rewrite_argv(_without(ARGV, "--block-parallel-size") + lora)
    args = parse_args(megatron_lm.extra_args_provider)
    validate_args(args, {})
    global_vars.build_tokenizer(args)
    global_vars.set_args(args)
    megatron_lm.install_initialize_hook()
    megatron_lm.install_checkpoint_hook()
    mpu.initialize_model_parallel(create_gloo_process_groups=True)
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    os.makedirs(os.path.join(root, "latest_checkpointed_iteration.txt"))
    stopped = None
    try:
        training.save_checkpoint(1, [megatron_lm.model_provider()], None, None, 0)
    except OSError as exc:  # IsADirectoryError: the tracker
        stopped = type(exc).__name__
    return stopped, sorted(os.listdir(os.path.join(root, "iter_0000001")))


@needs_megatron_lm
def test_a_lora_save_stopped_before_the_tracker_already_holds_its_record(tmp_path):
    """pretrain()'s LoRA checkpoints: the record (megatron_csbp_lora.json) is written beside the adapters before
    Megatron-LM's tracker names the iteration (before: after Megatron-LM's whole save, so a run stopped in between
    left the tracker on adapters without their record, which --load refuses)."""
    stopped, held = run_distributed(_interrupted_lora_save_rank, 1, str(tmp_path))[0]
    assert stopped == "IsADirectoryError", stopped
    assert "megatron_csbp_lora.json" in held and ".metadata" in held, held
