"""A released-style DFlash drafter (`muse_glimmer_assistant`) imported with `convert hf-to-megatron`:
every config field kept, the same tensors back from `megatron-to-hf`, the same outputs as
transformers (scaled rotary included), and `dflash train --load` continues training it under CSBP;
the result decodes with transformers' DFlash decoding."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.test_dflash_features import _indexed, _tiny_verifier
from tests.test_dflash_model import _hf_block

pytest.importorskip("transformers")

# every field of MuseGlimmerAssistantConfig that shapes the model (hidden 16: the tiny verifier's)
CONFIG = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"], block_size=4, mask_token_id=4,
              target_layer_ids=[0, 2], bos_token_id=1, eos_token_id=3, pad_token_id=0,
              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def _convert(*args):
    return subprocess.run([sys.executable, "-m", "megatron_csbp.convert", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _save_drafter(path, seed=0):
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    torch.manual_seed(seed)
    hf = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.3) if "norm" not in name else p.uniform_(0.5, 1.5)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    hf = _save_drafter(str(root / "hf"))
    r = _convert("hf-to-megatron", "--hf-path", str(root / "hf"), "--output", str(root / "meg"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "converted a DFlash drafter (muse_glimmer_assistant: 2 layers, hidden 16, block 4" in r.stdout
    return root, hf


def test_drafter_import_round_trip_and_parity(imported, megatron_single_rank):
    from megatron_csbp.attention.block_attention import AttentionPlan
    from megatron_csbp.conversion import hf_io
    from megatron_csbp.checkpoint.drafter import read_drafter
    from megatron_csbp.layout.masks import AnchoredGeometry, RowMeta

    root, hf = imported
    r = _convert("megatron-to-hf", "--load", str(root / "meg"), "--output", str(root / "back"))
    assert r.returncode == 0, r.stderr[-3000:]
    src, out = hf_io.read_tensors(str(root / "hf")), hf_io.read_tensors(str(root / "back"))
    assert sorted(src) == sorted(out) and all(torch.equal(src[k], out[k]) for k in src)
    cfg_src, cfg_out = (json.load(open(root / d / "config.json")) for d in ("hf", "back"))
    for key in list(CONFIG) + ["hidden_act", "model_type"]:
        assert cfg_out[key] == cfg_src[key], key

    # Outputs equal transformers' (llama3-scaled rotary, a sliding layer cutting the context):
    # fp32, the error model of tests/test_dflash_model.py (1e-4).
    model = read_drafter(str(root / "meg"))
    c, B = 13, 4
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, c, 2 * 16, generator=g)
    noise = torch.randn(1, B, 16, generator=g)
    ref = _hf_block(hf, feats, noise)
    rows = RowMeta.anchored(torch.tensor([c]), torch.tensor([0]), B, torch.arange(c), torch.zeros(c, dtype=torch.long))
    plan = AttentionPlan(AnchoredGeometry(B), rows, clean_queries=False)
    with torch.no_grad():
        got = model(noise.transpose(0, 1), feats.transpose(0, 1), plan)[:, 0]
    assert (got - ref).abs().max() <= 1e-4
    # the scaling matters at these positions: the default rotary gives other outputs (the test can fail)
    from megatron_csbp.model.dflash import DFlashDrafter, load_hf_drafter

    plain = DFlashDrafter(model.shape.__class__(**{**model.shape.__dict__, "rope_parameters": {}}))
    load_hf_drafter(plain, hf)
    with torch.no_grad():
        assert (plain(noise.transpose(0, 1), feats.transpose(0, 1), plan)[:, 0] - ref).abs().max() > 1e-3


def test_drafter_import_refuses_attention_scaled_rope(tmp_path):
    cfg = dict(CONFIG, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 16})
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(**cfg)).save_pretrained(str(tmp_path / "hf"))
    r = _convert("hf-to-megatron", "--hf-path", str(tmp_path / "hf"), "--output", str(tmp_path / "meg"))
    assert r.returncode == 2 and "rope_type 'yarn' scales attention by" in r.stderr


def _train(rank, world, argv):
    from megatron_csbp.dflash import main

    return main(argv)["history"]


@pytest.mark.slow  # suite budget: the import round trip and parity test stays default
def test_imported_drafter_trains_under_csbp_and_decodes_with_transformers(imported, tmp_path):
    from megatron_csbp.checkpoint.model import single_process_megatron
    from megatron_csbp.dflash import main

    root, _ = imported
    verifier, prefix, feats = str(tmp_path / "v"), str(tmp_path / "data"), str(tmp_path / "feat")
    _tiny_verifier(verifier)
    g = np.random.RandomState(0)
    _indexed(prefix, [list(g.randint(5, 50, size=n)) + [3] for n in (9, 30, 4, 17, 25, 11, 40, 33, 21)])
    main(["prepare-features", "--hf-path", verifier, "--data-path", prefix, "--seq-length", "32",
          "--target-layer-ids", "0", "2", "--output", feats, "--eod-token-id", "3", "--no-progress-bar"])
    save = str(tmp_path / "trained")
    base = ["train", "--load", str(root / "meg"), "--features-path", feats, "--verifier", verifier,
            "--eval-sequences", "2", "--log-interval", "1"]
    # lr 0: the saved drafter is the imported one (--load loaded it, nothing re-initialised)
    same = run_distributed(_train, 1, base + ["--train-iters", "1", "--lr", "0", "--save", str(tmp_path / "same")])[0][-1]
    from megatron_csbp.checkpoint.drafter import read_drafter

    def weights(d):  # drafter.pt (the import) or the trainer's torch_dist save, read on one process
        with single_process_megatron():
            return {k: v for k, v in read_drafter(d).state_dict().items() if torch.is_tensor(v)}

    a, b = weights(str(root / "meg")), weights(str(tmp_path / "same"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert len(same["eval_acceptance_per_offset"]) == 3 and 1.0 <= same["eval_expected_acceptance_length"] <= 4.0
    # CSBP (CP 2 x BP 2 on 2 ranks), 3 steps
    hist = run_distributed(_train, 2, base + ["--train-iters", "3", "--lr", "3e-3", "--context-parallel-size", "2",
                                              "--block-parallel-size", "2", "--save", save])[0]
    print("losses", [h["loss"] for h in hist if "loss" in h], "eval", hist[-1])
    losses = [h for h in hist if "loss" in h]
    assert len(losses) == 3 and all(np.isfinite(h["loss"]) for h in losses)
    assert "eval_expected_acceptance_length" in hist[-1]
    trained = weights(save)
    assert any(not torch.equal(a[k], trained[k]) for k in a)
    # flags that contradict the drafter are refused by name
    with pytest.raises(SystemExit):
        main(base + ["--block-size", "8"])

    r = _convert("megatron-to-hf", "--load", save, "--output", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr[-3000:]
    result = main(["evaluate", "--verifier", verifier, "--drafter", str(tmp_path / "export"), "--features-path", feats,
                   "--eval-sequences", "2", "--prompt-length", "8", "--max-new-tokens", "12"])
    assert result["identical"] is True and result["tokens_per_step"] >= 1.0
    # the training-time estimate beside it, on the same held-out sequences
    assert 1.0 <= result["training_expected_acceptance_length"] <= 4.0
    print("measured", result["tokens_per_step"], "training-time estimate", result["training_expected_acceptance_length"])
