"""`python -m megatron_csbp.convert` on DiffusionGemma and Gemma 4 checkpoints: hf-to-megatron,
`score --noisy-tokens` against Hugging Face's per-block forward, megatron-to-hf back (tensors, vision
tower and config), and refusals."""
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from megatron_csbp.conversion import hf_io  # noqa: E402
from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model  # noqa: E402
from megatron_csbp.model.families import SHAPE_FILE, ModelShape  # noqa: E402
from tests.test_convert_cli import convert  # noqa: E402

V, L, B, BATCH = 96, 24, 4, 2


def _save_tiny(path, **kw):
    model = tiny_hf_model(seed=3, vocab_size=V, sliding_window=3, **kw)
    model.save_pretrained(path)
    return model


def _ids(tmp_path, seed=0):
    g = np.random.RandomState(seed)
    clean, noisy = g.randint(0, V, (BATCH, L)), g.randint(0, V, (BATCH, L))
    np.save(tmp_path / "clean.npy", clean)
    np.save(tmp_path / "noisy.npy", noisy)
    return clean, noisy


def _hf_block_logits(model, clean, noisy, s):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(clean[:, :s]),
                     decoder_input_ids=torch.from_numpy(noisy[:, s : s + B])).logits.numpy()


# fp32 logits against transformers (fp32): the error model of tests/test_diffusiongemma.py (LOGIT_TOL:
# 2 x u32 x sqrt(K) x (layers + head) x logit scale = 1.8e-4 worst; the bound 1e-4). Measured
# (docs/exactness.md) <= 4.5e-6 under avx512 / avx2 / default.
LOGIT_TOL = 1e-4


def test_diffusion_gemma_converts_scores_like_hf_per_block_and_exports(tmp_path):
    hf, meg, back = str(tmp_path / "hf"), str(tmp_path / "meg"), str(tmp_path / "back")
    model = _save_tiny(hf)
    r = convert("hf-to-megatron", "--hf-path", hf, "--output", meg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "converted diffusion_gemma from diffusion_gemma (4 layers" in r.stdout
    shape = ModelShape.from_json(open(os.path.join(meg, SHAPE_FILE)).read())
    assert shape.family == "diffusion_gemma" and shape.diffusion_gemma["k_eq_v_full"] and shape.num_experts == 4

    clean, noisy = _ids(tmp_path)
    for prompt in (0, 2 * B):
        out = tmp_path / f"logits_{prompt}.npy"
        r = convert("score", "--load", meg, "--tokens", str(tmp_path / "clean.npy"), "--noisy-tokens",
                    str(tmp_path / "noisy.npy"), "--block-size", str(B), "--prompt-length", str(prompt),
                    "--output", str(out), "--batch-size", "1")
        assert r.returncode == 0, r.stderr[-3000:]
        logits = np.load(out)
        assert logits.dtype == np.float32 and logits.shape == (BATCH, L - prompt, V)
        diffs = []
        for s in range(max(prompt, B), L, B):  # HF refuses an empty clean prefix (block 0 without prompt)
            ref = _hf_block_logits(model, clean, noisy, s)
            diffs.append(float(np.abs(logits[:, s - prompt : s - prompt + B] - ref).max()))
        print(f"prompt {prompt}: max |logit diff| per block vs HF {['%.1e' % d for d in diffs]}")
        assert max(diffs) <= LOGIT_TOL

    r = convert("megatron-to-hf", "--load", meg, "--output", back)
    assert r.returncode == 0, r.stderr[-3000:]
    src, out = hf_io.read_tensors(hf), hf_io.read_tensors(back)
    assert sorted(src) == sorted(out) and all(torch.equal(src[k], out[k]) for k in src)  # vision tower too
    cfg_src, cfg_out = (json.load(open(os.path.join(d, "config.json"))) for d in (hf, back))
    assert cfg_out["model_type"] == "diffusion_gemma" and cfg_out["text_config"] == cfg_src["text_config"]

    r = convert("flags", "--load", meg)
    assert r.returncode == 2 and "DiffusionGemma has no Megatron-LM flag set" in r.stderr


def test_score_refuses_bad_block_arguments(tmp_path, capsys):
    """`convert score`'s block rules, each one line and exit 2 (in process, through the CLI's own
    `run(main)`; the subprocess CLI is exercised by the tests above and tests/test_convert_cli.py)."""
    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.cli import main
    from megatron_csbp.utils.cli import run

    hf, meg = str(tmp_path / "hf"), str(tmp_path / "meg")
    _save_tiny(hf)
    api.hf_to_megatron_checkpoint(hf, meg)
    _ids(tmp_path)
    base = ["score", "--load", meg, "--tokens", str(tmp_path / "clean.npy"), "--output", str(tmp_path / "o.npy")]
    noisy = ["--noisy-tokens", str(tmp_path / "noisy.npy")]
    for extra, needle in ((noisy + ["--block-size", "5"], "--block-size 5 must divide the sequence length 24"),
                          (noisy + ["--block-size", "4", "--prompt-length", "6"],
                           "--prompt-length 6 must be a multiple of --block-size 4"),
                          (noisy, "--noisy-tokens needs --block-size"),
                          (noisy + ["--block-size", "4", "--clean-attention", "block_causal"], "token-causal")):
        assert run(main, base + extra) == 2  # `python -m megatron_csbp.convert` exits with it
        assert needle in capsys.readouterr().err, needle


# K=V off (parity of that model is in tests/test_diffusiongemma.py; here the refused export) is slow.
@pytest.mark.slow  # suite budget (docs/testing.md): DiffusionGemma conversion and scoring stay default above
@pytest.mark.parametrize("k_eq_v", [True, False])
def test_gemma4_text_moe_start_converts_scores_and_exports_as_diffusion_gemma(tmp_path, k_eq_v):
    """A Gemma 4 text MoE checkpoint converts to a DiffusionGemma (new self-conditioning block as a
    no-op); `score` reproduces Gemma 4's next-token logits; with K=V full layers the export is a
    diffusion_gemma folder that transformers loads and whose per-block logits equal `score`'s;
    without K=V the export is refused by name."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from tests.test_diffusiongemma import _tiny_gemma4

    hf, meg, back = str(tmp_path / "hf"), str(tmp_path / "meg"), str(tmp_path / "back")
    gemma4 = _tiny_gemma4(k_eq_v)
    gemma4.save_pretrained(hf)
    r = convert("hf-to-megatron", "--hf-path", hf, "--output", meg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "converted diffusion_gemma from gemma4_text" in r.stdout
    clean, noisy = _ids(tmp_path, seed=1)
    r = convert("score", "--load", meg, "--tokens", str(tmp_path / "clean.npy"), "--output", str(tmp_path / "ar.npy"))
    assert r.returncode == 0, r.stderr[-3000:]
    with torch.no_grad():
        ref = gemma4(input_ids=torch.from_numpy(clean)).logits.numpy()
    ar_diff = float(np.abs(np.load(tmp_path / "ar.npy") - ref).max())
    print(f"Gemma 4 (K=V {k_eq_v}) next-token logits vs HF: {ar_diff:.1e}")
    assert ar_diff <= LOGIT_TOL

    r = convert("megatron-to-hf", "--load", meg, "--output", back)
    if not k_eq_v:
        assert r.returncode == 2 and "attention_k_eq_v=False" in r.stderr and not os.path.exists(back)
        return
    assert r.returncode == 0, r.stderr[-3000:]
    dg = DiffusionGemmaForBlockDiffusion.from_pretrained(back, attn_implementation="eager").eval().float()
    r = convert("score", "--load", meg, "--tokens", str(tmp_path / "clean.npy"), "--noisy-tokens",
                str(tmp_path / "noisy.npy"), "--block-size", str(B), "--output", str(tmp_path / "bd.npy"))
    assert r.returncode == 0, r.stderr[-3000:]
    logits = np.load(tmp_path / "bd.npy")
    diffs = [float(np.abs(logits[:, s : s + B] - _hf_block_logits(dg, clean, noisy, s)).max()) for s in range(B, L, B)]
    print(f"Gemma 4 start exported as diffusion_gemma: per-block diff vs HF {['%.1e' % d for d in diffs]}")
    assert max(diffs) <= LOGIT_TOL
