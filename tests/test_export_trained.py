"""Checkpoints the trainer writes from flags (no `convert hf-to-megatron` shape file) export to
Hugging Face and score through the one checkpoint reader (`megatron_csbp.checkpoint.files`):

- the README's default run (its exact flags, 2 ranks, CSBP CP = BP = 2, shipped corpus; a few
  iterations) -> `convert megatron-to-hf` -> transformers' `LlamaForCausalLM` gives the logits
  `convert score` gives on the Megatron checkpoint;
- a TP = 2 run with --qk-layernorm exports as `Qwen3ForCausalLM`, and an EP = 2 MoE run as
  `MixtralForCausalLM`, equal the same way;
- `convert flags` prints flags for them; a model no Hugging Face class holds is refused by flag.
"""
import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import TINY, train_rank

pytest.importorskip("transformers")


def convert(*args):
    """`python -m megatron_csbp.convert ARGS` (its `main`, in this process: no interpreter start-up);
    returns what it printed."""
    from megatron_csbp.conversion.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    assert rc == 0, out.getvalue()[-2000:] + err.getvalue()[-3000:]
    return out.getvalue()


def with_flags(argv, drop=(), **values):
    """`argv` without the flags in `drop` (each with its value), with --flag values replaced/added."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        key = flag[2:].replace("-", "_")
        if flag in drop or key in values:
            i += 2 if takes_value else 1
            continue
        out.append(flag)
        i += 1
    for key, value in values.items():
        out += ["--" + key.replace("_", "-"), str(value)]
    return out


def logit_bound(logits: np.ndarray, layers: int, width: int) -> float:
    """fp32 (Megatron) vs fp32 (transformers) logits of the same weights: each layer's dot products
    of length K round to ~u32 sqrt(K) relative error in different orders, compounding over the
    layers and the head: 2 u32 sqrt(K) (layers + 1) max|logit|, with a margin of 10."""
    u32 = 2.0 ** -24
    return 10 * 2 * u32 * np.sqrt(width) * (layers + 1) * float(np.abs(logits).max())


def export_and_compare(save, tmp_path, vocab, architecture, layers, width, seq=13):
    hf = str(tmp_path / "hf")
    r = convert("megatron-to-hf", "--load", save, "--output", hf)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    assert cfg["architectures"] == [architecture], cfg["architectures"]
    tokens = np.random.RandomState(0).randint(0, vocab, size=(2, seq)).astype(np.int64)  # odd length
    np.save(tmp_path / "ids.npy", tokens)
    convert("score", "--load", save, "--tokens", str(tmp_path / "ids.npy"), "--output", str(tmp_path / "logits.npy"))
    ours = np.load(tmp_path / "logits.npy")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()
    assert ours.shape == ref.shape == (2, seq, cfg["vocab_size"])
    diff, bound = float(np.abs(ours - ref).max()), logit_bound(ref, layers, width)
    print(f"\n{architecture}: convert score vs transformers on the export: max |diff| {diff:.3e} "
          f"(bound {bound:.3e}, max |logit| {np.abs(ref).max():.2f})")
    assert diff <= bound
    flags = convert("flags", "--load", save)
    assert f"--num-layers {layers}" in flags
    return cfg, r, flags


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron_csbp.data.preprocess import main as preprocess

    d = tmp_path_factory.mktemp("corpus")
    preprocess(["--input", "shipped", "--output-prefix", str(d / "pydoc"), "--append-eod"])
    return str(d / "pydoc_text_document")


def test_default_run_exports_to_llama_and_scores_the_same(corpus, tmp_path):
    from megatron_csbp.training.demo import demo_argv

    save = str(tmp_path / "ckpt")
    # The README's default run (2 ranks: CSBP, CP = BP = 2), three iterations.
    argv = with_flags(demo_argv(2, corpus), drop=("--save-initial",), train_iters=3, save=save, save_interval=3,
                      eval_interval=3, eval_iters=1, log_interval=1, tensorboard_dir=str(tmp_path / "tb"),
                      log_json=str(tmp_path / "log.jsonl"), data_cache_path=str(tmp_path / "cache"))
    run_distributed(train_rank, 2, argv)
    assert not os.path.exists(os.path.join(save, "megatron_csbp_model.json"))  # flag-built: no shape file
    meta = json.load(open(os.path.join(save, "iter_0000003", "bdlm_meta.json")))["model_args"]
    cfg, printed, flags = export_and_compare(save, tmp_path, meta["vocab_size"], "LlamaForCausalLM", layers=2,
                                             width=512)
    assert cfg["vocab_size"] == meta["padded_vocab_size"] and cfg["num_key_value_heads"] == 2
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"] is True
    assert "--qk-layernorm" not in flags
    # The export carries the training tokenizer (the checkpoint recorded it): AutoTokenizer on the
    # export gives the training tokenizer's ids, and the text back; EOD and mask keep their ids.
    from transformers import AutoTokenizer

    from megatron_csbp.data.megatron_data import saved_tokenizer
    from megatron_csbp.data.tokenizer import DEFAULT_MODEL, tokenizer_sha256

    assert (meta["tokenizer_path"], meta["tokenizer_sha256"]) == (DEFAULT_MODEL, tokenizer_sha256(DEFAULT_MODEL))
    assert "tokenizer: the sentencepiece tokenizer" in printed and "loadable by AutoTokenizer" in printed
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    trained_with = saved_tokenizer(meta["tokenizer_type"], meta["tokenizer_model"], meta["vocab_size"])
    text = 'The for statement is used to iterate over the elements of a sequence:\n\n   for x in "abc":\n  pass  '
    ids = tok(text)["input_ids"]
    assert ids == trained_with.tokenize(text) and tok.decode(ids) == trained_with.detokenize(ids) == text
    assert (tok.eos_token_id, tok.mask_token_id) == (meta["eod_token_id"], meta["mask_token_id"]) == (3, 4)


@pytest.mark.slow  # suite budget: the default-run export (Llama) stays default
def test_tp2_qk_layernorm_run_exports_to_qwen3(tmp_path):
    save = str(tmp_path / "ckpt")
    argv = TINY + ["--tensor-model-parallel-size", "2", "--qk-layernorm", "--norm-epsilon", "1e-6", "--kv-channels",
                   "16", "--untie-embeddings-and-output-weights", "--train-iters", "2", "--save", save]
    run_distributed(train_rank, 2, argv)
    cfg, _, flags = export_and_compare(save, tmp_path, 64, "Qwen3ForCausalLM", layers=2, width=96)
    assert cfg["head_dim"] == 16 and cfg["rms_norm_eps"] == 1e-6 and cfg["tie_word_embeddings"] is False
    assert "--qk-layernorm" in flags and "--norm-epsilon 1e-06" in flags


@pytest.mark.slow  # suite budget: the default-run export (Llama) stays default
def test_ep2_moe_run_exports_to_mixtral(tmp_path):
    """A flag-built MoE trained with its experts split over 2 ranks (EP 2) exports as Mixtral
    (Megatron's top-k-then-softmax router is Mixtral's softmax-then-renormalised top-k)."""
    save = str(tmp_path / "ckpt")
    argv = TINY + ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                   "--train-iters", "2", "--save", save]
    run_distributed(train_rank, 2, argv)
    cfg, _, flags = export_and_compare(save, tmp_path, 64, "MixtralForCausalLM", layers=2, width=96)
    assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert "--num-experts 4" in flags


@pytest.mark.parametrize("change,named", [
    (dict(normalization="LayerNorm"), "--normalization LayerNorm"),
    (dict(swiglu=False), "--no-swiglu"),
    (dict(add_bias_linear=True), "--add-bias-linear"),
    (dict(qk_layernorm=True, add_qkv_bias=True), "--qk-layernorm with --add-qkv-bias"),
])
def test_flag_built_models_without_a_hf_class_are_refused_by_flag(change, named):
    from megatron_csbp.model.families import UnsupportedModelError
    from megatron_csbp.model.families.gpt import shape_of_flags

    flags = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 seq_length=32, vocab_size=64, normalization="RMSNorm", swiglu=True,
                 untie_embeddings_and_output_weights=False, rotary_base=10000)
    assert shape_of_flags(flags).family == "llama"
    with pytest.raises(UnsupportedModelError, match=named):
        shape_of_flags(dict(flags, **change))



#: the `bdlm_meta.json` "model_args" keys older checkpoints lack (saved since the export of flag-built
#: models) and the defaults they take: the hand-written FLAG_DEFAULTS of round 19
ADDED_WITH_EXPORT = dict(
    kv_channels=None, add_bias_linear=False, position_embedding_type="rope", max_position_embeddings=None,
    qk_layernorm=False, norm_epsilon=1e-5, rotary_percent=1.0, add_qkv_bias=False, use_rope_scaling=False,
    rope_scaling_factor=8.0, rotary_seq_len_interpolation_factor=None, num_experts=None, moe_router_topk=2,
    moe_ffn_hidden_size=None, moe_layer_freq=1, moe_router_score_function="softmax", moe_router_pre_softmax=False,
    moe_input_jitter_eps=None)
#: the LoRA flags (round 24, issue 44): a checkpoint saved before them is a run without LoRA
ADDED_WITH_LORA = dict(lora_rank=0, lora_alpha=8.0, lora_dropout=0.0,
                       lora_target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), lora_init="default")
#: every "model_args" key the trainer saves: the hand list of round 19, the format `Option.saved` keeps
SAVED_KEYS = {
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "seq_length",
    "vocab_size", "make_vocab_size_divisible_by", "block_size", "objective", "mask_token_id", "clean_attention",
    "normalization", "swiglu", "untie_embeddings_and_output_weights", "rotary_base", "tokenizer_type",
    "tokenizer_model", "eod_token_id", "noise_eps_min", "noise_eps_max", "loss_weighting", "seed", "init_method_std",
    "chat_template", "block_times", "encoder_loss_scope",  # round 22: SFT rendering and the DiffusionGemma rules
    *ADDED_WITH_EXPORT, *ADDED_WITH_LORA}


def test_saved_model_args_keep_their_keys_and_older_checkpoints_their_defaults():
    """The saved keys and the defaults of the keys older checkpoints lack come from the declarations
    (config/options.py); both stay what the hand lists were, and a checkpoint written before the export
    (no such keys, no padded vocabulary or dtype) gives the Hugging Face config its flags give."""
    from megatron_csbp.model.families.gpt import FLAG_DEFAULTS, hf_config_of_flags
    from megatron_csbp.training.arguments import build_parser
    from megatron_csbp.training.config import CHECKPOINT_MODEL_KEYS, model_meta

    assert len(CHECKPOINT_MODEL_KEYS) == len(SAVED_KEYS) and set(CHECKPOINT_MODEL_KEYS) == SAVED_KEYS
    assert {k: FLAG_DEFAULTS[k] for k in ADDED_WITH_EXPORT} == ADDED_WITH_EXPORT
    assert {k: FLAG_DEFAULTS[k] for k in ADDED_WITH_LORA} == ADDED_WITH_LORA
    assert (FLAG_DEFAULTS["params_dtype"], FLAG_DEFAULTS["padded_vocab_size"]) == ("float32", None)
    flags = "--tokenizer-type NullTokenizer --vocab-size 100 --ffn-hidden-size 256 --num-query-groups 2"
    meta = model_meta(build_parser().parse_args(flags.split()))
    assert set(meta) == SAVED_KEYS | {"params_dtype", "padded_vocab_size"}
    older = {k: v for k, v in meta.items()
             if k not in {*ADDED_WITH_EXPORT, *ADDED_WITH_LORA, "params_dtype", "padded_vocab_size"}}
    assert hf_config_of_flags(older) == hf_config_of_flags(meta) and hf_config_of_flags(meta)["vocab_size"] == 128
