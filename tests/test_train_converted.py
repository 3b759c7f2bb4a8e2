"""The trainer on a converted Hugging Face checkpoint (`convert hf-to-megatron` -> `train --load`):
the model shape comes from megatron_csbp_model.json, `release` loads weights only at iteration 0,
the AR eval loss equals transformers' loss on the same tokens, Fast-dLLM v2 trains from it, and the
trained checkpoint exports back with `convert megatron-to-hf`."""
import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import train_rank

pytest.importorskip("transformers")

SEQ, BLOCK, MBS = 32, 8, 2
COMMON = ["--mock-data", "--seq-length", str(SEQ), "--block-size", str(BLOCK), "--micro-batch-size", str(MBS),
          "--global-batch-size", str(MBS), "--no-progress-bar", "--log-interval", "1", "--seed", "1234"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megatron_csbp.conversion import api
    from megatron_csbp.conversion.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("train_converted")
    hf = save_tiny_model("llama", str(root / "hf"), seed=3)
    # a reserved token, looked up by --mask-token (the mock data draws ids 0..126, below the EOD 127 of the
    # NullTokenizer covering the 128-id vocabulary: it includes 126, and tokens equal to the mask are never targets)
    with open(root / "hf" / "tokenizer.json", "w") as f:
        json.dump({"added_tokens": [{"id": 126, "content": "<|mask|>", "special": True}], "model": {"vocab": {}}}, f)
    api.hf_to_megatron_checkpoint(str(root / "hf"), str(root / "megatron"))
    return hf, str(root / "megatron"), root


def hf_eval_loss(hf_model, vocab):
    """transformers' mean next-token loss on the trainer's first validation batch (mock data: the ids of
    the NullTokenizer covering the checkpoint's vocabulary, those below its EOD vocab - 1)."""
    from megatron_csbp.data.megatron_data import MockDataset

    ds = MockDataset(SEQ, vocab - 1, 1234, "valid")
    tokens = torch.stack([ds[i]["tokens"] for i in range(MBS)])
    with torch.no_grad():
        logits = hf_model(tokens).logits.double()
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1)))


def test_ar_eval_loss_equals_transformers(converted):
    hf_model, meg, _ = converted
    ref = hf_eval_loss(hf_model, hf_model.config.vocab_size)
    argv = COMMON + ["--load", meg, "--objective", "ar", "--skip-train", "--eval-iters", "1"]
    ev = run_distributed(train_rank, 1, argv)[0]["history"][0]["eval_loss"]
    print(f"AR eval loss: trainer {ev!r}, transformers {ref!r}, rel diff {abs(ev - ref) / abs(ref):.2e}")
    assert abs(ev - ref) <= 1e-5 * abs(ref), (ev, ref)


@pytest.mark.slow
def test_ar_eval_loss_equals_transformers_under_tp2(converted):
    hf_model, meg, _ = converted
    ref = hf_eval_loss(hf_model, hf_model.config.vocab_size)
    argv = COMMON + ["--load", meg, "--objective", "ar", "--skip-train", "--eval-iters", "1"]
    # TP = 2 on 2 ranks: the unsharded release checkpoint resharded by dist_checkpointing
    for r in run_distributed(train_rank, 2, argv + ["--tensor-model-parallel-size", "2"]):
        print(f"TP=2 eval loss {r['history'][0]['eval_loss']!r}")
        assert abs(r["history"][0]["eval_loss"] - ref) <= 1e-5 * abs(ref), (r["history"][0]["eval_loss"], ref)


def test_fast_dllm_v2_trains_from_the_converted_checkpoint_and_exports(converted):
    from megatron_csbp.conversion import api, hf_io
    from megatron_csbp.model.families import SHAPE_FILE

    hf_model, meg, root = converted
    save = str(root / "bdlm")
    argv = COMMON + ["--load", meg, "--save", save, "--objective", "fast-dllm-v2", "--mask-token", "<|mask|>",
                     "--train-iters", "2", "--lr", "1e-3", "--min-lr", "1e-4"]
    r = run_distributed(train_rank, 1, argv)[0]
    print(f"fast-dllm-v2 losses {r['losses']}")
    assert r["iteration"] == 2 and len(r["losses"]) == 2
    assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert os.path.isfile(os.path.join(save, SHAPE_FILE))
    assert os.path.isfile(os.path.join(save, "iter_0000002", SHAPE_FILE))
    assert os.path.isdir(os.path.join(save, "hf_assets"))
    out = str(root / "bdlm_hf")
    api.megatron_to_hf_checkpoint(save, out)
    trained = hf_io.read_tensors(out)
    source = hf_io.read_tensors(str(root / "hf"))
    assert sorted(trained) == sorted(source)
    assert any(not torch.equal(trained[k], source[k]) for k in source)  # the weights moved
    # The export holds the trained weights: transformers' own model read from it gives the AR loss
    # that the trainer's model gives on the trained checkpoint (iteration 2), on the same tokens; the
    # untrained source model does not (the bound, as in test_ar_eval_loss_equals_transformers: fp32
    # on both sides, ~u32 x sqrt(K) x depth, 1e-5 relative).
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ref = hf_eval_loss(exported, exported.config.vocab_size)
    # evaluation only: the weights without the optimizer and its schedule (--no-load-optim, as in
    # Megatron-LM; the run above trained with other --lr/--min-lr, which a resume refuses)
    ev = run_distributed(train_rank, 1, COMMON + ["--load", save, "--objective", "ar", "--skip-train",
                                                  "--no-load-optim", "--eval-iters", "1"])[0]["history"][0]["eval_loss"]
    print(f"trained checkpoint: trainer AR eval loss {ev!r}, transformers on the export {ref!r}")
    assert abs(ev - ref) <= 1e-5 * abs(ref), (ev, ref)
    assert abs(hf_eval_loss(hf_model, hf_model.config.vocab_size) - ref) > 1e-4 * abs(ref)  # training moved it


@pytest.mark.parametrize("flags,needle", [
    (["--hidden-size", "64"], "--hidden-size 64 contradicts the checkpoint"),
    (["--num-layers", "3"], "--num-layers 3 contradicts"),
    (["--vocab-size", "256"], "--vocab-size 256 contradicts"),
    (["--objective", "fast-dllm-v2"], "needs --mask-token-id or --mask-token"),
    (["--objective", "fast-dllm-v2", "--mask-token-id", "128"], "outside the vocabulary"),
    (["--objective", "fast-dllm-v2", "--mask-token", "<nope>"], "is not a token of"),
    (["--objective", "fast-dllm-v2", "--mask-token", "<|mask|>", "--mask-token-id", "126"], "not both"),
])
def test_contradicting_flags_are_refused(converted, flags, needle, capsys):
    from megatron_csbp.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(COMMON + ["--load", converted[1]] + flags, world_size=1)
    assert needle in capsys.readouterr().err


def test_shape_flags_come_from_the_checkpoint(converted):
    from megatron_csbp.training.arguments import parse_args

    hf_model, meg, _ = converted
    args = parse_args(COMMON + ["--load", meg, "--hidden-size", "32", "--objective", "ar"], world_size=1)
    cfg = hf_model.config
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.vocab_size) == \
        (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size)
    assert args.ffn_hidden_size == cfg.intermediate_size and args.untie_embeddings_and_output_weights
    args = parse_args(COMMON + ["--load", meg, "--objective", "fast-dllm-v2", "--mask-token", "<|mask|>"], world_size=1)
    assert args.mask_token_id == 126
