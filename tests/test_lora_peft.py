"""Megatron LoRA adapters as a PEFT adapter, per family (Llama, Qwen3, Qwen3-MoE with its experts,
DiffusionGemma with its experts and tied encoder), on tiny converted models in float64:

- the Megatron model with random non-zero adapters (core's LoRA layers, `lora.spec.adapted`) and
  `peft.PeftModel.from_pretrained` on the Hugging Face base model give the same logits;
- `--merge-lora`'s export (W + scale * B A folded in) gives the same logits with plain transformers;
- export -> import gives back the same adapters and LoRA config;
- a PEFT adapter made in Hugging Face (separate q/k/v, gate/up A's) imports as canonical part
  adapters, exactly, and exports back tensor for tensor;
- what has no exact form is refused in one line (different q/k/v A's or a partial fused module where
  no part form exists, dropout on expert adapters, part adapters on fused expert stacks).
"""
import json
import os

import numpy as np
import pytest
import torch


import peft  # noqa: E402
import transformers  # noqa: E402

from megatron_csbp.checkpoint.model import load_checkpoint_model, single_process_megatron  # noqa: E402
from megatron_csbp.conversion import api  # noqa: E402
from megatron_csbp.conversion import lora as lora_conversion  # noqa: E402
from megatron_csbp.conversion.tiny import save_tiny_model, tiny_config  # noqa: E402
from megatron_csbp.lora import DEFAULT_TARGETS, LoRAConfig, is_adapter  # noqa: E402
from megatron_csbp.lora.peft import merged_state  # noqa: E402
from megatron_csbp.lora.spec import adapted  # noqa: E402
from megatron_csbp.model.builder import build_gpt_model  # noqa: E402
from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model  # noqa: E402
from megatron_csbp.model.families import shape_from_hf_config  # noqa: E402

# float64 on both sides, but transformers computes rotary angles in float32 (its
# `_compute_default_rope_parameters` / rotary forward cast to float): the HF-parity tolerance of
# tests/test_convert_equivalence.py (1e-4). Measured: <= 6e-6 with adapters moving logits by >= 3.
TOLERANCE = 1e-4
SEQ, BLOCK, DG_VOCAB = 24, 4, 96
FAMILIES = ("llama", "qwen3", "qwen3_moe", "diffusion_gemma")
LORA = LoRAConfig(rank=4, alpha=8.0, init="random")  # init "random": B is not zero, the adapters act


def _hf_model(family, path):
    cls = transformers.DiffusionGemmaForBlockDiffusion if family == "diffusion_gemma" else transformers.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float64, attn_implementation="eager",
                               experts_implementation="eager").eval()


def _hf_logits(family, model, clean, noisy):
    """Next-token logits, or DiffusionGemma's noisy-block logits block by block (after block 0)."""
    with torch.no_grad():
        if family != "diffusion_gemma":
            return model(torch.from_numpy(clean)).logits.numpy()
        return np.concatenate([model(input_ids=torch.from_numpy(clean[:, :s]),
                                     decoder_input_ids=torch.from_numpy(noisy[:, s:s + BLOCK])).logits.numpy()
                               for s in range(BLOCK, SEQ, BLOCK)], axis=1)


def _megatron_logits(family, model, clean, noisy):
    with torch.no_grad():
        if family != "diffusion_gemma":
            return api.ARScorer(model, SEQ)(torch.from_numpy(clean)).numpy()
        out = api.BlockDiffusionScorer(model, SEQ, BLOCK, 0, "token_causal")(torch.from_numpy(clean),
                                                                             torch.from_numpy(noisy))
        return out[:, BLOCK:].numpy()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_peft")


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_export_merge_and_import(family, root):
    d = root / family
    hf, meg, adapter, merged = (str(d / n) for n in ("hf", "meg", "adapter", "merged"))
    if family == "diffusion_gemma":
        tiny_hf_model(seed=3, vocab_size=DG_VOCAB, sliding_window=3).save_pretrained(hf)
    else:
        save_tiny_model(family, hf, seed=3)
    shape = api.hf_to_megatron_checkpoint(hf, meg)
    rs = np.random.RandomState(0)
    clean, noisy = rs.randint(0, shape.vocab_size, (2, SEQ)), rs.randint(0, shape.vocab_size, (2, SEQ))

    with single_process_megatron():
        base, _ = load_checkpoint_model(meg, params_dtype=torch.float64)
        model = adapted(LORA, lambda: build_gpt_model(shape, params_dtype=torch.float64), seed=5)
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        assert not unexpected and all(is_adapter(k) or k.endswith("_extra_state") for k in missing)
        model.eval()
        ours = _megatron_logits(family, model, clean, noisy)
        adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if is_adapter(k)}
    assert any("local_experts" in k for k in adapters) == (family in ("qwen3_moe", "diffusion_gemma"))

    lora_conversion.export_peft_adapter(shape, LORA, adapters, adapter, base=meg)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    saved = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert saved["r"] == 4 and saved["lora_alpha"] == 8.0 and saved["peft_type"] == "LORA"
    assert bool(saved["target_parameters"]) == (family in ("qwen3_moe", "diffusion_gemma"))  # the 3D expert stacks

    with_adapter = peft.PeftModel.from_pretrained(_hf_model(family, hf), adapter).eval()
    ref = _hf_logits(family, with_adapter, clean, noisy)
    with with_adapter.disable_adapter():
        plain = _hf_logits(family, with_adapter, clean, noisy)
    diff, effect = float(np.abs(ours - ref).max()), float(np.abs(ref - plain).max())
    print(f"\n[{family}] max |megatron+LoRA - peft| = {diff:.2e}; the adapters move logits by {effect:.2f}")
    assert effect > 1.0 and diff <= TOLERANCE

    # --merge-lora: the merged full model (in the checkpoint's float32), read by plain transformers
    api.megatron_to_hf_checkpoint(meg, merged, transform=lambda s: merged_state(s, LORA, adapters))
    merged_diff = float(np.abs(_hf_logits(family, _hf_model(family, merged), clean, noisy) - ref).max())
    print(f"[{family}] max |merged - peft| = {merged_diff:.2e}")
    assert merged_diff <= TOLERANCE

    config, back = lora_conversion.import_peft_adapter(shape, adapter)
    assert config == LoRAConfig(4, 8.0, 0.0, tuple(sorted(DEFAULT_TARGETS)))
    assert sorted(back) == sorted(adapters) and all(torch.equal(back[k], adapters[k]) for k in adapters)


CANONICAL_HF = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "qwen3_moe": ["q_proj", "v_proj", "o_proj"]}  # (the experts' gate_up_proj is one 3D parameter)


@pytest.mark.parametrize("family", sorted(CANONICAL_HF))
def test_peft_adapter_with_separate_a_imports_as_canonical_targets(family, tmp_path):
    """A PEFT adapter made in Hugging Face (init_lora_weights=False: every A its own) imports as the
    canonical targets (one adapter per q/k/v, gate/up part); the Megatron model's logits equal
    PeftModel's, --merge-lora's equal them too, and the export writes the same tensors back."""
    from safetensors.torch import load_file

    hf, meg, adapter, back, merged = (str(tmp_path / n) for n in ("hf", "meg", "adapter", "back", "merged"))
    save_tiny_model(family, hf, seed=3)
    shape = api.hf_to_megatron_checkpoint(hf, meg)
    torch.manual_seed(0)
    with_adapter = peft.get_peft_model(_hf_model(family, hf), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=CANONICAL_HF[family])).eval()
    with_adapter.save_pretrained(adapter)
    tokens = np.random.RandomState(0).randint(0, shape.vocab_size, (2, SEQ))
    ref = _hf_logits(family, with_adapter, tokens, None)

    config, adapters = lora_conversion.import_peft_adapter(shape, adapter)
    want = ("linear_proj", "linear_q", "linear_v") if family == "qwen3_moe" else \
        ("linear_fc1_gate", "linear_fc1_up", "linear_fc2", "linear_k", "linear_proj", "linear_q", "linear_v")
    assert config.target_modules == want
    with single_process_megatron():
        base, _ = load_checkpoint_model(meg, params_dtype=torch.float64)
        model = adapted(config, lambda: build_gpt_model(shape, params_dtype=torch.float64), seed=5)
        model.load_state_dict({**base.state_dict(), **adapters}, strict=False)
        assert all(torch.equal(p, adapters[n]) for n, p in model.named_parameters() if is_adapter(n))
        ours = _megatron_logits(family, model.eval(), tokens, None)
    with with_adapter.disable_adapter():
        effect = float(np.abs(ref - _hf_logits(family, with_adapter, tokens, None)).max())
    assert effect > 1.0 and float(np.abs(ours - ref).max()) <= TOLERANCE

    groups = shape.num_query_groups
    api.megatron_to_hf_checkpoint(meg, merged, transform=lambda s: merged_state(s, config, adapters, groups))
    assert float(np.abs(_hf_logits(family, _hf_model(family, merged), tokens, None) - ref).max()) <= TOLERANCE

    # the LoRA checkpoint of `convert hf-to-megatron --peft-adapter` holds the part adapters as they are
    from megatron_csbp.lora.checkpoint import read_lora_checkpoint, write_lora_checkpoint

    write_lora_checkpoint(str(tmp_path / "ckpt"), config, adapters, meg)
    saved, tensors, _ = read_lora_checkpoint(str(tmp_path / "ckpt"))
    assert saved == config and sorted(tensors) == sorted(adapters)
    assert all(torch.equal(tensors[k], v) for k, v in adapters.items())

    lora_conversion.export_peft_adapter(shape, config, adapters, back)
    written, read = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (back, adapter))
    assert sorted(written) == sorted(read) and all(torch.equal(written[k], read[k]) for k in read)


def _meta_adapter(tmp_path, family, **lora_kw):
    """A PEFT adapter folder with peft's own random adapters on the meta-built model of `family`."""
    shape = shape_from_hf_config(tiny_config(family).to_dict())
    hf_model = lora_conversion.meta_hf_model(shape).to_empty(device="cpu")
    model = peft.get_peft_model(hf_model, peft.LoraConfig(r=2, init_lora_weights=False, **lora_kw))
    model.save_pretrained(str(tmp_path))
    return shape


def test_what_has_no_exact_megatron_form_is_refused(tmp_path):
    # Qwen3.5's gated q_proj ([q; gate] per head) has no canonical part form: different q/k/v A's
    # and a part of its fused module are refused
    gated = _meta_adapter(tmp_path / "qkv", "qwen3_5", target_modules=["q_proj", "k_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"--peft-adapter .*different lora_A.*shares one A"):
        lora_conversion.import_peft_adapter(gated, str(tmp_path / "qkv"))
    _meta_adapter(tmp_path / "q", "qwen3_5", target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"linear_qkv is one fused module; the adapter covers only"):
        lora_conversion.import_peft_adapter(gated, str(tmp_path / "q"))
    # q_proj alone of a plain attention: the canonical target linear_q
    shape = _meta_adapter(tmp_path / "lq", "llama", target_modules=["q_proj"])
    assert lora_conversion.import_peft_adapter(shape, str(tmp_path / "lq"))[0].target_modules == ("linear_q",)
    # o_proj alone maps exactly: linear_proj; rsLoRA's alpha / sqrt(r) becomes alpha' / r
    _meta_adapter(tmp_path / "o", "llama", target_modules=["o_proj"], use_rslora=True, lora_alpha=8)
    config, adapters = lora_conversion.import_peft_adapter(shape, str(tmp_path / "o"))
    assert config.target_modules == ("linear_proj",) and len(adapters) == 2 * shape.num_layers
    assert config.scaling == pytest.approx(8 / 2 ** 0.5)
    # peft's expert adapters (target_parameters) take no dropout
    moe = shape_from_hf_config(tiny_config("qwen3_moe").to_dict())
    expert = next(t for t in lora_conversion.peft_targets(moe) if t.expert is not None).megatron
    with pytest.raises(ValueError, match=r"--lora-dropout 0.1: peft's expert adapters .* take no dropout"):
        lora_conversion.export_peft_adapter(moe, LoRAConfig(2, dropout=0.1), {expert + ".lora_A": torch.zeros(2, 32),
                                                                                 expert + ".lora_B": torch.zeros(32, 2)},
                                            str(tmp_path / "moe"))
    # transformers' fused expert gate_up_proj takes one adapter: part adapters there have no PEFT form
    with pytest.raises(ValueError, match=r"no place for: .*part adapters of experts' linear_fc1"):
        lora_conversion.export_peft_adapter(moe, LoRAConfig(2), {expert.replace("fc2", "fc1") + f".lora_{x}_gate":
                                                                 torch.zeros(2, 2) for x in "AB"}, str(tmp_path / "moe2"))


def test_cli_exports_scores_and_imports_a_lora_checkpoint(tmp_path):
    """`convert megatron-to-hf --load LORA_CKPT` (PEFT adapter, and --merge-lora), `convert score` of the
    LoRA checkpoint, and `convert hf-to-megatron --peft-adapter` back to a LoRA checkpoint (float32,
    the converted checkpoint's dtype: the HF-parity tolerance)."""
    from megatron_csbp.conversion.cli import main
    from megatron_csbp.lora.checkpoint import read_lora_checkpoint, write_lora_checkpoint

    hf, meg, ckpt, adapter, merged, imported = (str(tmp_path / n) for n in ("hf", "meg", "lora", "ad", "merged", "imp"))
    save_tiny_model("qwen3", hf, seed=3)
    shape = api.hf_to_megatron_checkpoint(hf, meg)
    with single_process_megatron():
        model = adapted(LORA, lambda: build_gpt_model(shape), seed=5)
        adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if is_adapter(k)}
    write_lora_checkpoint(ckpt, LORA, adapters, meg)
    tokens = np.random.RandomState(0).randint(0, shape.vocab_size, (2, SEQ))
    np.save(tmp_path / "tokens.npy", tokens)

    assert main(["score", "--load", ckpt, "--tokens", str(tmp_path / "tokens.npy"), "--output", str(tmp_path / "s.npy")]) == 0
    assert main(["megatron-to-hf", "--load", ckpt, "--output", adapter]) == 0
    assert main(["megatron-to-hf", "--load", ckpt, "--merge-lora", "--output", merged]) == 0
    ours = np.load(tmp_path / "s.npy")
    with_adapter = peft.PeftModel.from_pretrained(_hf_model("qwen3", hf), adapter).eval()
    ref = _hf_logits("qwen3", with_adapter, tokens, None)
    with with_adapter.disable_adapter():
        assert float(np.abs(ref - _hf_logits("qwen3", with_adapter, tokens, None)).max()) > 1.0
    assert float(np.abs(ours - ref).max()) <= TOLERANCE
    assert float(np.abs(_hf_logits("qwen3", _hf_model("qwen3", merged), tokens, None) - ref).max()) <= TOLERANCE

    assert main(["hf-to-megatron", "--hf-path", hf, "--peft-adapter", adapter, "--output", imported]) == 0
    config, back, base = read_lora_checkpoint(imported)
    assert config == LoRAConfig(4, 8.0, 0.0, tuple(sorted(DEFAULT_TARGETS))) and base == os.path.join(imported, "base")
    assert sorted(back) == sorted(adapters) and all(torch.equal(back[k], adapters[k]) for k in adapters)
    assert main(["megatron-to-hf", "--load", meg, "--merge-lora", "--output", str(tmp_path / "x")]) == 2


def test_generate_decodes_a_diffusion_gemma_lora_checkpoint(tmp_path):
    """`generate --load LORA_CKPT` (DiffusionGemma): the same tokens as the --merge-lora export
    converted back (the adapters act: other tokens than the base's)."""
    from megatron_csbp.generation.decode import main as generate
    from megatron_csbp.lora.checkpoint import write_lora_checkpoint

    hf, meg, ckpt, merged, merged_meg = (str(tmp_path / n) for n in ("hf", "meg", "lora", "merged", "merged_meg"))
    tiny_hf_model(seed=3, vocab_size=DG_VOCAB, sliding_window=3, redraw=False).save_pretrained(hf)
    shape = api.hf_to_megatron_checkpoint(hf, meg)
    lora = LoRAConfig(4, 8.0, target_modules=("linear_qkv", "linear_proj"), init="random")  # (experts: test above)
    with single_process_megatron():
        model = adapted(lora, lambda: build_gpt_model(shape), seed=5)
        adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if is_adapter(k)}
    write_lora_checkpoint(ckpt, lora, adapters, meg)
    api.megatron_to_hf_checkpoint(meg, merged, transform=lambda s: merged_state(s, lora, adapters))
    api.hf_to_megatron_checkpoint(merged, merged_meg)
    np.save(tmp_path / "prompt.npy", np.random.RandomState(1).randint(0, DG_VOCAB, (2, 7)))
    ids = {name: generate(["--load", load, "--prompt-ids", str(tmp_path / "prompt.npy"), "--max-new-tokens", "8",
                           "--seed", "5", "--max-denoising-steps", "4"])
           for name, load in (("lora", ckpt), ("merged", merged_meg), ("base", meg))}
    assert (ids["lora"] == ids["merged"]).all() and not (ids["lora"] == ids["base"]).all()
