"""The flags `convert hf-to-megatron` prints as "flags that rebuild this model" and the trainer's
parser agree: every printed flag is one the trainer takes, the trainer's flag-built model from them
is the converted model (the same `ModelShape`, hence the same Hugging Face config), and with
`--load` of the converted checkpoint the printed flags are accepted (none contradicts its shape)."""
import shlex

import pytest

pytest.importorskip("transformers")

GPT_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
COMPARED = ("family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "kv_channels", "vocab_size", "max_position_embeddings", "norm_epsilon", "rotary_base", "rope_scaling",
            "add_qkv_bias", "qk_layernorm", "tie_word_embeddings", "num_experts", "moe_router_topk",
            "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_layer_pattern", "moe_input_jitter_eps",
            "rotary_percent", "params_dtype")
# --objective ar: the shape does not depend on the objective, and bd3lm would need --mask-token-id
# (with --make-vocab-size-divisible-by 1 no padding id is free for the default)
RUN = ["--mock-data", "--seq-length", "32", "--block-size", "8", "--micro-batch-size", "1", "--objective", "ar"]


def printed_flags(shape):
    from megatron_csbp.conversion.api import flags_text

    return shlex.split(flags_text(shape).replace("\\\n", " "))


def tiny_shape(family, **change):
    import json

    from megatron_csbp.conversion.tiny import tiny_config
    from megatron_csbp.model.families import shape_from_hf_config

    cfg = json.loads(tiny_config(family).to_json_string())
    cfg.update(change)
    return shape_from_hf_config(cfg)


@pytest.mark.parametrize("family,change", [(f, {}) for f in GPT_FAMILIES] + [
    ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2)),  # --moe-router-pre-softmax, --moe-layer-freq
    ("mixtral", dict(router_jitter_noise=0.1)),                         # --moe-input-jitter-eps
    ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}, dtype="bfloat16")),
    ("qwen3", dict(dtype="float16")),                                   # --fp16
])
def test_printed_flags_rebuild_the_same_model_in_the_trainer(family, change):
    from megatron_csbp.model.families.gpt import shape_of_flags
    from megatron_csbp.training.arguments import build_parser, validate_args
    from megatron_csbp.training.config import model_meta

    shape = tiny_shape(family, **change)
    flags = printed_flags(shape)
    parser = build_parser()
    unknown = [f for f in flags if f.startswith("--") and f not in parser._option_string_actions]
    assert not unknown, f"printed flags the trainer does not take: {unknown}"
    args = parser.parse_args(flags + RUN)
    rebuilt = shape_of_flags(model_meta(validate_args(args, 1)))
    differ = {k: (getattr(rebuilt, k), getattr(shape, k)) for k in COMPARED if getattr(rebuilt, k) != getattr(shape, k)}
    assert not differ, differ


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_printed_flags_are_accepted_with_the_converted_checkpoint(family, tmp_path):
    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.tiny import save_tiny_model
    from megatron_csbp.training.arguments import build_parser, validate_args

    save_tiny_model(family, str(tmp_path / "hf"), seed=1)
    shape = api.hf_to_megatron_checkpoint(str(tmp_path / "hf"), str(tmp_path / "meg"))
    facts = validate_args(build_parser().parse_args(printed_flags(shape) + RUN + ["--load", str(tmp_path / "meg")]), 1)
    assert facts.model_shape == shape
    # a printed flag given with another value is refused, naming it
    flags = printed_flags(shape)
    i = flags.index("--norm-epsilon")
    flags[i + 1] = "0.5"
    with pytest.raises(ValueError, match="--norm-epsilon 0.5 contradicts the checkpoint"):
        validate_args(build_parser().parse_args(flags + RUN + ["--load", str(tmp_path / "meg")]), 1)
