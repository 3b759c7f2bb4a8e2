"""A hybrid Qwen3.5 (Gated DeltaNet + gated attention) checkpoint through the trainer: the AR eval
loss of the converted model equals transformers' Qwen3_5ForCausalLM, and Fast-dLLM v2 (AR -> BDLM)
trains from it for two steps and exports back to Hugging Face with moved weights."""
import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train_converted import COMMON, MBS, hf_eval_loss
from tests.train_helpers import train_rank

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("train_qwen3_5")
    hf = save_tiny_model("qwen3_5", str(root / "hf"), seed=3)
    with open(root / "hf" / "tokenizer.json", "w") as f:
        json.dump({"added_tokens": [{"id": 126, "content": "<|mask|>", "special": True}], "model": {"vocab": {}}}, f)
    api.hf_to_megatron_checkpoint(str(root / "hf"), str(root / "megatron"))
    return hf, str(root / "megatron"), root


@pytest.mark.slow
def test_qwen3_5_ar_eval_then_fast_dllm_v2_training_and_export(converted):
    from megatron_csbp.conversion import api, hf_io

    hf_model, meg, root = converted
    ref = hf_eval_loss(hf_model, hf_model.config.vocab_size)
    ev = run_distributed(train_rank, 1, COMMON + ["--load", meg, "--objective", "ar", "--skip-train",
                                                  "--eval-iters", "1"])[0]["history"][0]["eval_loss"]
    print(f"Qwen3.5 AR eval loss: trainer {ev!r}, transformers {ref!r}")
    assert abs(ev - ref) <= 1e-5 * abs(ref), (ev, ref)
    save = str(root / "bdlm")
    argv = COMMON + ["--load", meg, "--save", save, "--objective", "fast-dllm-v2", "--mask-token", "<|mask|>",
                     "--train-iters", "2", "--lr", "1e-3", "--min-lr", "1e-4"]
    r = run_distributed(train_rank, 1, argv)[0]
    print(f"Qwen3.5 fast-dllm-v2 losses {r['losses']}")
    assert r["iteration"] == 2 and len(r["losses"]) == 2
    assert all(torch.isfinite(torch.tensor(r["losses"])))
    out = str(root / "bdlm_hf")
    api.megatron_to_hf_checkpoint(save, out)
    trained, source = hf_io.read_tensors(out), hf_io.read_tensors(str(root / "hf"))
    assert sorted(trained) == sorted(source)
    moved = [k for k in source if not torch.equal(trained[k], source[k])]
    assert any("linear_attn" in k for k in moved) and any("self_attn" in k for k in moved), moved


@pytest.mark.slow
def test_qwen3_5_ar_eval_under_tp2_resharded(converted):
    """The unsharded release checkpoint loaded under TP = 2 (dist_checkpointing splits GDN's in_proj
    and conv1d per rank as megatron-core's GatedDeltaNet describes): the same eval loss."""
    hf_model, meg, _ = converted
    ref = hf_eval_loss(hf_model, hf_model.config.vocab_size)
    argv = COMMON + ["--load", meg, "--objective", "ar", "--skip-train", "--eval-iters", "1",
                     "--tensor-model-parallel-size", "2"]
    for r in run_distributed(train_rank, 2, argv):
        ev = r["history"][0]["eval_loss"]
        print(f"Qwen3.5 TP=2 eval loss {ev!r} vs transformers {ref!r}")
        assert abs(ev - ref) <= 1e-5 * abs(ref), (ev, ref)
