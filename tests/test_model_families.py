"""The family registry is the single list of what the converter reads and the builder builds:
every registered family converts its own Hugging Face configs, nothing else is read, and a new
family is one `register_family` call away."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from megatron_csbp.conversion.tiny import FAMILIES as TINY_FAMILIES, tiny_model  # noqa: E402
from megatron_csbp.model import families  # noqa: E402
from megatron_csbp.model.families import (  # noqa: E402
    ModelShape, UnsupportedModelError, family_names, family_of_hf_config, get_family, hf_model_types,
    register_family, shape_from_hf_config,
)
from megatron_csbp.model.families.gpt import GPTFamily  # noqa: E402


def _hf_config(name):
    """config.json of a tiny model of registered family `name`."""
    if name == "diffusion_gemma":
        from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_config

        return json.loads(tiny_hf_config().to_json_string())
    from megatron_csbp.conversion.tiny import tiny_config

    return json.loads(tiny_config(name).to_json_string())


def test_registered_families_are_exactly_those_conversion_reads():
    # every registered family has a tiny model, and every tiny model is a registered family
    assert set(family_names()) == set(TINY_FAMILIES) | {"diffusion_gemma"}
    readers = {}
    for name in family_names():
        fam = get_family(name)
        assert fam.name == name and fam.model_types
        for model_type in fam.model_types:
            assert family_of_hf_config({"model_type": model_type}) is fam
            readers[model_type] = name
        cfg = _hf_config(name)
        shape = shape_from_hf_config(cfg)
        assert shape.family == name and shape.hf_config["model_type"] in fam.model_types
        assert ModelShape.from_json(shape.to_json()) == shape
        # Megatron-LM flags exist exactly where the family says so
        if fam.has_megatron_lm_flags:
            assert "--num-layers %d" % shape.num_layers in families.megatron_flags(shape)
        else:
            with pytest.raises(UnsupportedModelError, match="Megatron-LM flag set"):
                families.megatron_flags(shape)
    assert sorted(readers) == hf_model_types()
    assert set(readers.values()) == set(family_names())


@pytest.mark.parametrize("model_type", ["gpt_neox", "mistral", None])
def test_unknown_model_type_is_refused_by_name(model_type):
    with pytest.raises(UnsupportedModelError, match=f"model_type {model_type!r}") as err:
        shape_from_hf_config({"model_type": model_type, "architectures": ["SomethingForCausalLM"]})
    for known in hf_model_types():  # the message lists what is supported
        assert repr(known) in str(err.value)


def test_unknown_family_in_a_shape_file_is_refused_by_name():
    shape = shape_from_hf_config(_hf_config("llama"))
    data = json.loads(shape.to_json())
    data["family"] = "falcon"
    with pytest.raises(UnsupportedModelError, match="'falcon' is not registered"):
        families.megatron_flags(ModelShape.from_json(json.dumps(data)))


def test_names_and_model_types_are_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register_family(GPTFamily("llama", "llama_v9", "LlamaForCausalLM"))
    with pytest.raises(ValueError, match=r"\['qwen2'\] already belong to \['qwen2'\]"):
        register_family(GPTFamily("qwen2_copy", "qwen2", "Qwen2ForCausalLM"))
    assert "llama_v9" not in hf_model_types() and "qwen2_copy" not in family_names()


def test_a_new_family_is_one_registration(monkeypatch):
    """A family registered from outside the package converts its checkpoints through the same
    conversion code (weight mapping both ways) with no other change."""
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    monkeypatch.setattr(families, "_BY_MODEL_TYPE", dict(families._BY_MODEL_TYPE))
    fam = register_family(GPTFamily("my_llama", "my_llama", "MyLlamaForCausalLM", attention_bias_has_o_proj=True))
    cfg = dict(_hf_config("llama"), model_type="my_llama", architectures=["MyLlamaForCausalLM"])
    shape = shape_from_hf_config(cfg)
    assert shape.family == "my_llama" and get_family("my_llama") is fam
    tensors = {k: v.detach() for k, v in tiny_model("llama", seed=1).state_dict().items()}
    state, extra = fam.hf_to_megatron(shape, tensors, cfg)
    assert extra == {} and state["embedding.word_embeddings.weight"] is tensors["model.embed_tokens.weight"]
    hf_cfg, back, skip = fam.megatron_to_hf(shape, state)
    assert hf_cfg["model_type"] == "my_llama" and skip == ()
    assert sorted(back) == sorted(k for k in tensors if not k.endswith("rotary_emb.inv_freq"))
    assert all(torch.equal(back[k], tensors[k]) for k in back)
    with pytest.raises(UnsupportedModelError, match="architecture 'LlamaForCausalLM'"):
        shape_from_hf_config(dict(cfg, architectures=["LlamaForCausalLM"]))


def test_trainer_family_rules_come_from_the_family(tmp_path, monkeypatch):
    """The trainer's model-family rules read the family's attributes: a converted MoE checkpoint of a
    family the trainer does not train (qwen3_moe with `trainer_trains_moe` switched off here; every
    registered MoE family trains) is refused naming the family and the families it does train; a
    family that fixes the clean-stream mask (DiffusionGemma) sets the default."""
    import argparse

    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.tiny import save_tiny_model
    from megatron_csbp.training.arguments import apply_model_shape, build_parser, check_clean_attention
    from megatron_csbp.checkpoint.files import checkpoint_shape

    save_tiny_model("qwen3_moe", str(tmp_path / "hf"), seed=1)
    api.hf_to_megatron_checkpoint(str(tmp_path / "hf"), str(tmp_path / "megatron"))
    shape = checkpoint_shape(str(tmp_path / "megatron"), None)
    args = build_parser().parse_args(["--mock-data", "--load", str(tmp_path / "megatron")])
    apply_model_shape(args, shape)  # trained by the trainer (tests/test_train_moe.py)
    assert args.num_experts == shape.num_experts
    from megatron_csbp.model.families import get_family

    monkeypatch.setattr(get_family("qwen3_moe"), "trainer_trains_moe", False)
    args = build_parser().parse_args(["--mock-data", "--load", str(tmp_path / "megatron")])
    with pytest.raises(ValueError, match=r"holds a qwen3_moe MoE model .*'diffusion_gemma'.*'mixtral'"):
        apply_model_shape(args, shape)
    for family, expected in (("diffusion_gemma", "token_causal"), ("llama", "block_causal")):
        ns = argparse.Namespace(clean_attention=None)
        check_clean_attention(ns, argparse.Namespace(family=family))
        assert ns.clean_attention == expected
    with pytest.raises(ValueError, match="clean stream is token_causal"):
        check_clean_attention(argparse.Namespace(clean_attention="block_causal"),
                              argparse.Namespace(family="diffusion_gemma"))
