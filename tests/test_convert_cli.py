"""`python -m megatron_csbp.convert`: the commands end to end, the checkpoint layout the trainer
loads, the printed flags, and refusals of what cannot be converted exactly."""
import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from megatron_csbp.conversion import hf_io  # noqa: E402
from megatron_csbp.conversion.tiny import save_tiny_model, tiny_config  # noqa: E402
from megatron_csbp.model.families import (  # noqa: E402
    SHAPE_FILE, ModelShape, UnsupportedModelError, megatron_flags, shape_from_hf_config,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def convert(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "megatron_csbp.convert", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


# fp32 logits against transformers (fp32): the error model of tests/test_convert_equivalence.py
# (2 x u32 x sqrt(K) x (layers + head) x logit scale; 1e-4 at |logit| <= 34, 1.2e-5 at the |logit|
# <= ~4 of these MoE models: LOGIT_TOL keeps the shared 1e-4). Measured (docs/exactness.md)
# <= 1.2e-6 under avx512 / avx2 / default.
LOGIT_TOL = 1e-4


# suite budget (docs/testing.md): its paths keep cheaper default cases (qwen3_moe logits equal
# transformers' in test_convert_equivalence; the hf-to-megatron command runs in test_dflash_import,
# score, megatron-to-hf and flags in test_export_trained)
@pytest.mark.slow
def test_cli_hf_to_megatron_score_and_back(tmp_path):
    hf, meg, back = str(tmp_path / "hf"), str(tmp_path / "meg"), str(tmp_path / "back")
    model = save_tiny_model("qwen3_moe", hf, seed=5)
    r = convert("hf-to-megatron", "--hf-path", hf, "--output", meg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--num-experts 4" in r.stdout and "--qk-layernorm" in r.stdout and "--group-query-attention" in r.stdout
    # The layout the trainer's --load reads.
    assert open(os.path.join(meg, "latest_checkpointed_iteration.txt")).read() == "release"
    for d in (meg, os.path.join(meg, "release")):
        shape = ModelShape.from_json(open(os.path.join(d, SHAPE_FILE)).read())
        assert shape.family == "qwen3_moe" and shape.num_experts == 4 and shape.kv_channels == 8
    assert os.path.isfile(os.path.join(meg, "release", "metadata.json"))
    assert os.path.isfile(os.path.join(meg, "hf_assets", "generation_config.json"))

    tokens = np.random.RandomState(0).randint(0, 128, size=(3, 11)).astype(np.int32)  # odd length
    np.save(tmp_path / "ids.npy", tokens)
    r = convert("score", "--load", meg, "--tokens", str(tmp_path / "ids.npy"), "--output",
                str(tmp_path / "logits.npy"), "--batch-size", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    logits = np.load(tmp_path / "logits.npy")
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert logits.dtype == np.float32 and logits.shape == (3, 11, 128)
    print(f"\nCLI score vs transformers (qwen3_moe): max |diff| {np.abs(logits - ref).max():.3e}")
    assert np.abs(logits - ref).max() <= LOGIT_TOL

    r = convert("megatron-to-hf", "--load", meg, "--output", back)
    assert r.returncode == 0, r.stderr[-3000:]
    src, out = hf_io.read_tensors(hf), hf_io.read_tensors(back)
    assert sorted(src) == sorted(out) and all(torch.equal(src[k], out[k]) for k in src)

    r = convert("flags", "--load", meg)
    assert r.returncode == 0 and "--moe-router-topk 2" in r.stdout


def test_cli_refuses_unsupported_model_by_name(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    r = convert("hf-to-megatron", "--hf-path", str(hf), "--output", str(tmp_path / "out"))
    assert r.returncode == 2 and "gpt2" in r.stderr and "not supported" in r.stderr
    assert not os.path.exists(tmp_path / "out")


def _cfg(family, **kw):
    cfg = json.loads(tiny_config(family).to_json_string())  # what config.json holds
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("family,change,named", [
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 2.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     "low_freq_factor"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    ("mixtral", dict(sliding_window=4096), "sliding_window"),
    ("llama", dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    ("qwen3_moe", dict(mlp_only_layers=[0, 1]), "Qwen3-MoE config without any MoE layer"),
])
def test_unsupported_options_are_named(family, change, named):
    with pytest.raises(UnsupportedModelError, match=named):
        shape_from_hf_config(_cfg(family, **change))


def test_rope_and_embedding_options_reach_the_model_and_flags():
    llama = shape_from_hf_config(_cfg("llama"))
    assert llama.rope_scaling == {"type": "llama3", "factor": 8.0} and llama.rotary_base == 1e6
    assert not llama.tie_word_embeddings and "--untie-embeddings-and-output-weights" in megatron_flags(llama)
    assert "--use-rope-scaling" in megatron_flags(llama)
    # older configs: rope_theta / rope_scaling at top level
    old = _cfg("llama")
    del old["rope_parameters"]
    old.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    s = shape_from_hf_config(old)
    assert s.rotary_base == 5e5 and s.rope_scaling == {"type": "linear", "factor": 2.0}
    assert "--rotary-seq-len-interpolation-factor 2" in megatron_flags(s)  # an int, as Megatron-LM parses it
    qwen2 = shape_from_hf_config(_cfg("qwen2"))
    assert qwen2.add_qkv_bias and qwen2.tie_word_embeddings and "--add-qkv-bias" in megatron_flags(qwen2)
    moe = shape_from_hf_config(_cfg("qwen3_moe", norm_topk_prob=False, decoder_sparse_step=2))
    assert moe.moe_router_pre_softmax and moe.moe_layer_pattern == [0, 1]
    mixtral = shape_from_hf_config(_cfg("mixtral"))
    assert not mixtral.moe_router_pre_softmax and mixtral.moe_ffn_hidden_size == 48
    # the shape file round-trips and rejects what it does not know
    assert ModelShape.from_json(moe.to_json()) == moe
    bad = json.loads(moe.to_json())
    bad["surprise"] = 1
    with pytest.raises(ValueError, match="unknown fields"):
        ModelShape.from_json(json.dumps(bad))


def test_unknown_hf_tensor_is_refused(tmp_path):
    from megatron_csbp.model.families.gpt_weights import ConversionError, hf_to_megatron

    hf = str(tmp_path / "hf")
    save_tiny_model("llama", hf)
    tensors = hf_io.read_tensors(hf)
    shape = shape_from_hf_config(hf_io.read_config(hf))
    extra = copy.copy(tensors)
    extra["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    with pytest.raises(ConversionError, match="o_proj.bias"):
        hf_to_megatron(shape, extra)
    missing = {k: v for k, v in tensors.items() if "k_proj" not in k}
    with pytest.raises(ConversionError, match="k_proj"):
        hf_to_megatron(shape, missing)


def test_sharded_hf_checkpoints_are_read_and_written(tmp_path):
    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(5)}
    files = hf_io.write_tensors(str(tmp_path), tensors, max_shard_bytes=600)
    assert len(files) > 1 and os.path.isfile(tmp_path / hf_io.INDEX_FILE)
    back = hf_io.read_tensors(str(tmp_path))
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_bf16_checkpoint_keeps_its_dtype_and_scores_in_fp32(tmp_path):
    """Released checkpoints are bf16: the Megatron checkpoint stays bf16, the export is bit-exact, and
    `score` loads the bf16 weights into an fp32 model (transformers loading the same files in fp32
    gives the same logits)."""
    import transformers

    from megatron_csbp.conversion import api

    hf, meg, back = str(tmp_path / "hf"), str(tmp_path / "meg"), str(tmp_path / "back")
    save_tiny_model("mixtral", str(tmp_path / "fp32"), seed=4)
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32"), dtype=torch.bfloat16).save_pretrained(hf)
    shape = api.hf_to_megatron_checkpoint(hf, meg)
    assert shape.params_dtype == "bfloat16"
    api.megatron_to_hf_checkpoint(meg, back)
    src, out = hf_io.read_tensors(hf), hf_io.read_tensors(back)
    assert all(out[k].dtype == torch.bfloat16 and torch.equal(src[k], out[k]) for k in src)
    tokens = np.random.RandomState(2).randint(0, 128, size=(1, 10))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = ref_model(torch.from_numpy(tokens)).logits.numpy()
    diff = np.abs(api.score(meg, tokens) - ref).max()
    print(f"\nbf16 checkpoint scored in fp32 vs transformers fp32 (mixtral): max |diff| {diff:.3e}")
    assert diff <= LOGIT_TOL
