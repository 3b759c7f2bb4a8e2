"""Megatron model flags of the trainer reach the model it builds (the recipes' --kv-channels,
--recompute-method/--recompute-num-layers, --attention-backend, dropout, biases), and
--attention-kernel / --attention-backend choose the kernel that runs for every model family: the
flag-built GPT, a converted Hugging Face model (Llama) and a converted DiffusionGemma. Models are
built through the trainer's own path (`parse_args` -> `model_args` -> `build_model`) on one rank."""
import os

import pytest
import torch

from tests.train_helpers import TINY

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.tiny import save_tiny_model
    from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("kernel_flags")
    save_tiny_model("llama", str(root / "llama_hf"), seed=3)
    api.hf_to_megatron_checkpoint(str(root / "llama_hf"), str(root / "llama"))
    tiny_hf_model(seed=2, vocab_size=256, sliding_window=16).save_pretrained(str(root / "dg_hf"))
    api.hf_to_megatron_checkpoint(str(root / "dg_hf"), str(root / "dg"))
    return {"gpt": None, "llama": (str(root / "llama"), 128), "dg": (str(root / "dg"), 256)}


@pytest.fixture(autouse=True)
def te_backend_env(monkeypatch):
    """Megatron's LanguageModule turns TransformerConfig.attention_backend into NVTE_*_ATTN
    environment variables and refuses a model whose backend disagrees with values already set in
    the process: each test starts without them and leaves the process as it found it."""
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.setenv(var, "1")  # recorded: restored (or removed) after the test
        monkeypatch.delenv(var)


def build(argv):
    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.training.arguments import model_args, parse_args
    from megatron_csbp.training.model import build_model

    install_cpu_compat()
    for var in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # one model per process in a run
        os.environ.pop(var, None)  # (te_backend_env restores the process's values after the test)
    args = facts = parse_args(argv, world_size=1)
    model = build_model(model_args(facts))
    if args.load:  # converted weights (build_model leaves them uninitialised)
        from megatron_csbp.checkpoint.state import load_checkpoint
        load_checkpoint(args.load, model, None, None)
    return args, model


def family_argv(converted_model):
    common = ["--seq-length", "32", "--block-size", "8", "--micro-batch-size", "2", "--no-progress-bar"]
    if converted_model is None:
        return TINY
    load, vocab = converted_model
    # a converted model's vocabulary has no padding row for bd3lm's default mask id: give one (its
    # second-last id, as the trainer picked before NullTokenizer took Megatron-LM's meaning)
    return ["--load", load, "--mock-data", "--mask-token-id", str(vocab - 2), *common]


class CountingKernel:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


@pytest.mark.parametrize("family", ["gpt", "llama", "dg"])
@pytest.mark.parametrize("flags,kernel", [(["--attention-kernel", "flex"], "flex"), (["--attention-kernel", "cpu_flash"], "cpu_flash"),
                                          (["--attention-backend", "local"], "tiled"), (["--attention-backend", "unfused"], "math")])
def test_attention_kernel_reaches_every_model_family(megatron_single_rank, converted, monkeypatch, family, flags,
                                                     kernel):
    from megatron_csbp.attention.kernels import registry as kernels
    from megatron_csbp.attention.core_attention import BlockDiffusionAttention

    # flex has no CPU backward: the trainer takes it here for evaluation only
    argv = family_argv(converted[family]) + flags + ["--skip-train", "--eval-iters", "1"]
    args, model = build(argv)
    assert args.attention_kernel == kernel
    attn = [m for m in model.modules() if isinstance(m, BlockDiffusionAttention)]
    assert len(attn) == model.config.num_layers and {m.kernel_name for m in attn} == {kernel}
    # ... and it is the kernel that runs
    counters = {name: CountingKernel(fn) for name, fn in kernels.KERNELS.items()}
    monkeypatch.setattr(kernels, "KERNELS", counters)
    tokens = torch.randint(0, 50, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(tokens, torch.ones_like(tokens), torch.tensor([0]))
    assert torch.isfinite(out.loss)
    assert counters[kernel].calls >= len(attn)
    assert sum(c.calls for name, c in counters.items() if name != kernel) == 0


def test_model_flags_reach_the_transformer_config(megatron_single_rank):
    from megatron.core.transformer.enums import AttnBackend

    argv = [a for a in TINY] + ["--kv-channels", "16", "--add-bias-linear", "--hidden-dropout", "0.1",
                                "--recompute-granularity", "full", "--recompute-method", "block",
                                "--recompute-num-layers", "2", "--attention-backend", "unfused",
                                "--position-embedding-type", "rope"]
    args, model = build(argv)
    cfg = model.config
    assert (cfg.kv_channels, cfg.add_bias_linear, cfg.hidden_dropout) == (16, True, 0.1)
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 2)
    assert cfg.attention_backend == AttnBackend.unfused and args.attention_kernel == "math"
    qkv = model.gpt.decoder.layers[0].self_attention.linear_qkv
    heads, groups = args.num_attention_heads, args.num_query_groups
    assert tuple(qkv.weight.shape) == ((heads + 2 * groups) * 16, args.hidden_size)  # the head size is 16
    assert qkv.bias is not None and qkv.bias.shape[0] == (heads + 2 * groups) * 16
    # defaults: the previous behaviour (no biases, no dropout, full recompute = uniform x 1)
    args, model = build(TINY + ["--recompute-granularity", "full"])
    cfg = model.config
    assert (cfg.add_bias_linear, cfg.hidden_dropout, cfg.attention_dropout) == (False, 0.0, 0.0)
    assert (cfg.recompute_method, cfg.recompute_num_layers) == ("uniform", 1)
    assert cfg.kv_channels == args.hidden_size // args.num_attention_heads


def test_moe_layer_freq_places_the_moe_layers(megatron_single_rank):
    """--moe-layer-freq: MoE every N layers (an int) or a 0/1 pattern places the MoE layers; the
    others are dense (MoE every 2nd layer built every layer as MoE before)."""
    moe = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq"]
    cases = (("1", ["MoELayer"] * 4), ("2", ["MoELayer", "MLP"] * 2),
             ("([0,1,1,0])", ["MLP", "MoELayer", "MoELayer", "MLP"]))
    for freq, mlps in cases:
        _, model = build(TINY + moe + [freq])
        assert [type(layer.mlp).__name__ for layer in model.gpt.decoder.layers] == mlps, freq


def test_moe_layer_freq_below_one_is_refused(capsys):
    """--moe-layer-freq 0 (MoE every 0 layers) is one line naming the flag (a ZeroDivisionError before)."""
    from megatron_csbp.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(TINY + ["--num-experts", "4", "--moe-layer-freq", "0"], world_size=1)
    assert "--moe-layer-freq '0' must be at least 1" in capsys.readouterr().err
