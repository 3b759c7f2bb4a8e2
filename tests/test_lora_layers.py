"""LoRA adapters through the layer spec on one rank (docs/lora.md): the flags, the frozen base, the
adapters' math against PEFT's formula, and one clear line for bad targets."""
import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import TINY

LORA = ["--lora-rank", "4", "--lora-init", "random"]


CANONICAL = ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2")


def test_canonical_targets_tp_sp_match_one_rank():
    """Separate q/k/v and gate/up adapters (canonical targets) under TP 2 + SP, dense and with
    expert-TP experts: float64 loss and every adapter gradient equal one rank's (the harness of
    tests/test_lora_layouts.py)."""
    from tests.test_lora_layouts import _check

    _check(2, [dict(tp=2, sp=True, lora_target_modules=CANONICAL),
               dict(tp=2, sp=True, moe=True, lora_target_modules=("linear_q", "linear_v", "linear_fc1_up"))])


def _train_two_steps(rank, world_size, argv):
    from megatron_csbp.lora import adapter_names
    from megatron_csbp.training.arguments import parse_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    s = Trainer(TrainerConfig.from_args(parse_args(list(argv)))).build()
    before = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    in_optimizer = {id(p) for g in s.optimizer.param_groups for p in g["params"]}
    s.train_step(0)
    s.train_step(4)  # the first step runs at warm-up lr 0
    return dict(adapters=sorted(adapter_names(s.model)),
                changed=sorted(n for n, p in s.model.named_parameters() if not torch.equal(before[n], p.detach())),
                trainable=sorted(n for n, p in s.model.named_parameters() if p.requires_grad),
                optimized=sorted(n for n, p in s.model.named_parameters() if id(p) in in_optimizer))


def test_training_steps_change_only_the_adapters():
    out = run_distributed(_train_two_steps, 1, TINY + ["--train-iters", "2"] + LORA)[0]
    layers = [f"bdlm.gpt.decoder.layers.{i}.{m}.lora_{x}" for i in range(2) for x in "AB"
              for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert out["adapters"] == sorted(layers)
    assert out["trainable"] == out["adapters"] and out["changed"] == out["adapters"]
    assert out["optimized"] == out["adapters"]


def _families(rank, world_size):
    """{family: sorted adapted module paths (layer index dropped)} of the converted families' tiny
    models built with adapters on every projection, expert and GDN name."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.conversion.tiny import tiny_config
    from megatron_csbp.lora import LoRAConfig, adapter_names
    from megatron_csbp.lora.spec import adapted
    from megatron_csbp.model import builder
    from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_config
    from megatron_csbp.model.families import shape_from_hf_config
    from megatron_csbp.parallel import state as bps

    install_cpu_compat()
    bps.initialize_block_parallel()
    model_parallel_cuda_manual_seed(1)
    lora = LoRAConfig(2, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    out = {}
    configs = {f: tiny_config(f).to_dict() for f in ("qwen3", "qwen3_moe", "qwen3_5")}
    configs["diffusion_gemma"] = tiny_hf_config().to_dict()
    for family, cfg in configs.items():
        shape = shape_from_hf_config(cfg)
        gpt = adapted(lora, lambda: builder.build_gpt_model(shape, perform_initialization=True,
                                                                      params_dtype=torch.float64), seed=3)
        out[family] = sorted({".".join(p for p in n.split(".")[3:] if not p.isdigit()) for n in adapter_names(gpt)})
        if family == "qwen3":
            out["peft"] = _against_peft(gpt)
    experts_only = LoRAConfig(2, target_modules=("experts.linear_fc2",))  # a qualified target (the spec's path)
    gpt = adapted(experts_only, lambda: builder.build_gpt_model(shape_from_hf_config(configs["qwen3_moe"])), seed=3)
    out["experts.linear_fc2"] = sorted({".".join(p for p in n.split(".")[3:] if not p.isdigit())
                                        for n in adapter_names(gpt)})
    try:  # Qwen3.5's gated attention: linear_qkv is not [q; k; v] per query group
        adapted(LoRAConfig(2, target_modules=("linear_q",)), lambda: builder.build_gpt_model(
            shape_from_hf_config(configs["qwen3_5"])), seed=3)
    except ValueError as e:
        out["gated"] = str(e)
    bps.destroy_block_parallel()
    return out


def _against_peft(gpt):
    """max |LoRA layer - PEFT's lora.Linear on the same weights| for a column and a row layer, and
    the init: B zero, A within nn.Linear's kaiming-uniform bound."""
    import peft

    layer = gpt.decoder.layers[0]
    errors, init_ok = {}, True
    for name, module in (("qkv", layer.self_attention.linear_qkv), ("fc2", layer.mlp.linear_fc2)):
        init_ok &= bool((module.lora_B == 0).all()) and \
            float(module.lora_A.detach().abs().max()) <= module.lora_A.shape[1] ** -0.5
        with torch.no_grad():
            module.lora_B.copy_(torch.randn_like(module.lora_B))
        base = torch.nn.Sequential()
        base.add_module("lin", torch.nn.Linear(module.weight.shape[1], module.weight.shape[0], bias=False,
                                               dtype=torch.float64))
        base.lin.weight.data.copy_(module.weight.detach())
        cfg = module.lora_config
        wrapped = peft.get_peft_model(base, peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=["lin"]))
        with torch.no_grad():
            wrapped.base_model.model.lin.lora_A["default"].weight.copy_(module.lora_A)
            wrapped.base_model.model.lin.lora_B["default"].weight.copy_(module.lora_B)
            x = torch.randn(5, 2, module.weight.shape[1], dtype=torch.float64)
            errors[name] = float((module(x)[0] - wrapped(x)).abs().max())
    return dict(errors=errors, init_ok=init_ok)


def test_every_family_gets_adapters_through_its_spec():
    out = run_distributed(_families, 1)[0]
    assert out.pop("peft") == dict(errors={"qkv": pytest.approx(0.0, abs=1e-12), "fc2": pytest.approx(0.0, abs=1e-12)},
                                   init_ok=True)
    attention = ["self_attention.linear_proj.lora_A", "self_attention.linear_proj.lora_B",
                 "self_attention.linear_qkv.lora_A", "self_attention.linear_qkv.lora_B"]
    mlp = ["mlp.linear_fc1.lora_A", "mlp.linear_fc1.lora_B", "mlp.linear_fc2.lora_A", "mlp.linear_fc2.lora_B"]
    experts = [m.replace("mlp.", "mlp.experts.local_experts.") for m in mlp]
    assert out["qwen3"] == sorted(attention + mlp)
    assert out["qwen3_moe"] == sorted(attention + experts)
    assert out["experts.linear_fc2"] == experts[2:]
    assert out.pop("gated").startswith(  # (megatron-core's build_module appends "when instantiating ...")
        "--lora-target-modules linear_q: this model's linear_qkv is not [q; k; v] per query group (e.g. a gated or "
        "latent attention); adapt linear_qkv")
    assert out["qwen3_5"] == sorted(attention + mlp)  # GDN layers: their MLP (in_proj/out_proj not targeted)
    dense = [m.replace("mlp.", "mlp.dense.") for m in mlp]
    assert out["diffusion_gemma"] == sorted(attention + experts + dense)


def test_bad_lora_flags_fail_in_one_line(capsys):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_csbp.lora import LoRAConfig
    from megatron_csbp.lora.spec import with_adapters
    from megatron_csbp.training.arguments import parse_args
    from tests.train_helpers import error_lines, run_train

    r = run_train(TINY + ["--train-iters", "1", "--lora-rank", "4", "--lora-target-modules", "linear_qkv", "linear_fc3"])
    assert r.returncode != 0
    assert error_lines(r.stdout + r.stderr) == [
        "error: --lora-target-modules linear_fc3: the model has no module named linear_fc3 "
        "(it has linear_fc1, linear_fc2, linear_proj, linear_qkv)"]
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--lora-rank", "-1"])
    assert error_lines(capsys.readouterr().err) == ["error: --lora-rank must be at least 0, got -1"]
    grouped = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)
    if "GroupedMLP" in repr(grouped):  # megatron-core 0.16: adapted (LoRAGroupedMLP), TE's refused: test_lora_grouped
        assert "LoRAGroupedMLP" in repr(with_adapters(grouped, LoRAConfig(4)))
    else:  # 0.19's local spec builds sequential experts
        adapted = repr(with_adapters(grouped, LoRAConfig(4, target_modules=("experts.linear_fc1",))))
        assert adapted.count("LoRAColumnParallelLinear") == 1 and "LoRARow" not in adapted  # not shared_experts
    with_adapters(grouped, LoRAConfig(4, target_modules=("linear_qkv",)))  # attention only: allowed
    with pytest.raises(ValueError, match=r"^--lora-target-modules experts.linear_fc1_up and linear_fc1: a fused "
                                         r"module takes either its own adapter or adapters on its parts, not both$"):
        LoRAConfig(4, target_modules=("linear_fc1", "experts.linear_fc1_up"))
