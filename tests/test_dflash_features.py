"""`python -m megatron_csbp.dflash prepare-features`: captured features equal the verifier's hidden
states, documents run on their own, shards are memory-mapped and a rerun resumes; the CLI refuses
bad flags by name; `--objective dflash` is in the trainer's registry."""
import json
import os
import shutil

import numpy as np
import pytest
import torch


def _tiny_verifier(path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def _indexed(prefix, docs):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(50))
    for d in docs:
        b.add_document(torch.tensor(d, dtype=torch.int64), [len(d)])
    b.finalize(prefix + ".idx")


def test_prepare_features_exact_and_resumable(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_csbp.dflash import FeatureDataset, main

    verifier, prefix, out = str(tmp_path / "v"), str(tmp_path / "data"), str(tmp_path / "feat")
    _tiny_verifier(verifier)
    g = np.random.RandomState(0)
    docs = [list(g.randint(5, 50, size=n)) + [3] for n in (9, 30, 4, 17, 25, 11, 40)]
    _indexed(prefix, docs)
    argv = ["prepare-features", "--hf-path", verifier, "--data-path", prefix, "--seq-length", "32",
            "--target-layer-ids", "0", "2", "--output", out, "--shard-size", "2", "--eod-token-id", "3",
            "--no-progress-bar"]
    main(argv)
    data = FeatureDataset(out)
    stream = np.concatenate(docs)
    assert len(data) == len(stream) // 32 == 4 and len(data.shards) == 2
    item = data[3]
    assert isinstance(data.shards[1]["features"], np.memmap)
    assert item["tokens"].tolist() == stream[96:128].tolist()
    # The verifier run on each document segment alone, from position 0.
    model = AutoModelForCausalLM.from_pretrained(verifier).eval()
    doc_ids = item["doc_ids"]
    for doc in np.unique(doc_ids):
        seg = np.nonzero(doc_ids == doc)[0]
        with torch.no_grad():
            hs = model(input_ids=torch.as_tensor(item["tokens"][seg], dtype=torch.long)[None],
                       output_hidden_states=True).hidden_states
        want = torch.cat([hs[1][0], hs[3][0]], dim=-1).numpy()
        assert np.abs(item["features"][seg] - want).max() < 1e-5
    assert len(np.unique(doc_ids)) > 1  # the sequence really spans documents
    # Resume: a lost shard is recaptured, the complete one is left alone.
    before = os.path.getmtime(os.path.join(out, "shard_00000", "features.npy"))
    saved = np.array(data[2]["features"])
    shutil.rmtree(os.path.join(out, "shard_00001"))
    result = main(argv)
    assert result["captured_now"] == 2
    assert os.path.getmtime(os.path.join(out, "shard_00000", "features.npy")) == before
    assert np.array_equal(FeatureDataset(out)[2]["features"], saved)
    # Different flags on the same output are refused by name.
    with pytest.raises(ValueError, match="target_layer_ids"):
        main([x if x != "2" else "1" for x in argv])


def test_cli_refusals(tmp_path):
    from megatron_csbp.dflash import main

    with pytest.raises(SystemExit):
        main(["train", "--features-path", "x", "--verifier", "v", "--mask-token-id", "4", "--block-size", "1"])
    with pytest.raises(FileNotFoundError, match="prepare-features"):
        from megatron_csbp.dflash import FeatureDataset
        FeatureDataset(str(tmp_path))


def test_objective_registry():
    from megatron_csbp.objectives.dflash import DFlashObjective
    from megatron_csbp.training.arguments import OBJECTIVES
    from megatron_csbp.training.loop import objective_of
    from megatron_csbp.training.model import ModelArgs, build_objective

    assert "dflash" in OBJECTIVES
    assert objective_of(["--seed", "1", "--objective", "dflash"]) == "dflash"
    obj = build_objective(ModelArgs(objective="dflash", block_size=8, mask_token_id=4))
    assert isinstance(obj, DFlashObjective) and obj.block_size == 8
    with pytest.raises(ValueError, match="--mask-token-id"):
        build_objective(ModelArgs(objective="dflash", block_size=8))
    with pytest.raises(ValueError, match="--dflash-loss"):
        DFlashObjective(8, 4, loss="kl")
