"""`--objective dflash` under pipeline parallelism (the drafter's layers split over the stages, the
trainer's megatron-core schedule): the loss curve, held-out loss and acceptance and the final
weights of one rank, and torch_dist checkpoints that resume across PP 2 <-> PP 1.

fp32 bound, as tests/test_train_pipeline.py: a stage runs its layers' operations in one rank's order
(the boundary only moves the rows), so the losses differ at most by the reordered sums of the
gradient norm over the stages (clipping) and the distributed optimizer: 1e-5 relative."""
import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.test_dflash_features import _indexed, _tiny_verifier
from tests.train_helpers import train_rank

pytest.importorskip("transformers")

PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    from megatron_csbp.dflash import main

    root = tmp_path_factory.mktemp("dflash_pp")
    verifier, prefix, feats = str(root / "v"), str(root / "data"), str(root / "feat")
    _tiny_verifier(verifier)  # vocabulary 50, hidden 16
    g = np.random.RandomState(0)
    _indexed(prefix, [list(g.randint(5, 50, size=n)) + [3] for n in (9, 30, 4, 17, 25, 11, 40, 33, 21, 14)])
    main(["prepare-features", "--hf-path", verifier, "--data-path", prefix, "--seq-length", "32",
          "--target-layer-ids", "0", "2", "--output", feats, "--eod-token-id", "3", "--no-progress-bar"])
    return root


def _train(root, world, flags, save=None):
    argv = _argv(root, flags)
    if save:
        argv += ["--save", str(root / save), "--save-interval", "2"]
    return run_distributed(train_rank, world, argv)


def _argv(root, flags):
    return ["--objective", "dflash", "--features-path", str(root / "feat"), "--verifier", str(root / "v"),
            "--mask-token-id", "4", "--block-size", "4", "--num-layers", "2", "--num-attention-heads", "2",
            "--micro-batch-size", "1", "--global-batch-size", "3", "--train-iters", "3", "--lr", "3e-3",
            "--lr-decay-style", "constant", "--dflash-max-anchors", "5", "--eval-sequences", "2", "--log-interval", "1",
            "--use-distributed-optimizer", "--no-progress-bar"] + flags


def _weights(path):
    from megatron_csbp.checkpoint.drafter import read_drafter
    from megatron_csbp.checkpoint.model import single_process_megatron

    with single_process_megatron():
        return {k: v for k, v in read_drafter(path).state_dict().items() if torch.is_tensor(v)}


def _evals(r):
    return [(h["eval_loss"], h["eval_expected_acceptance_length"]) for h in r["history"] if "eval_loss" in h]


@pytest.fixture(scope="module")
def one_rank(features):
    (one,) = _train(features, 1, [], save="one")
    assert len(one["losses"]) == 3 and len(_evals(one)) == 1  # evaluated after the last step
    return one


def test_pp2_matches_one_rank_and_resumes_across_layouts(features, one_rank):
    root, one = features, one_rank
    pp = _train(root, 2, PP2, save="pp2")
    print("one rank", one["losses"], _evals(one), "PP 2", pp[0]["losses"], _evals(pp[0]))
    for r in pp:  # every stage reports the loss (reduced over the pipeline) and the held-out metrics
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=0)
        assert [e for ev in _evals(r) for e in ev] == pytest.approx([e for ev in _evals(one) for e in ev], rel=1e-5)
    a, b = _weights(str(root / "one")), _weights(str(root / "pp2"))
    assert sorted(a) == sorted(b) and any(k.startswith("layers.1.") for k in a)
    print("largest weight difference", max(float((b[k] - a[k]).abs().max()) for k in a))
    for k in a:
        assert torch.allclose(b[k], a[k], rtol=1e-5, atol=1e-7), k
    # PP 2's checkpoint of iteration 2 -> one rank: the same last step (the other way: the slow test below)
    (resumed,) = _train(root, 1, ["--load", str(root / "pp2"), "--ckpt-step", "2"])
    assert resumed["iteration"] == 3 and resumed["losses"] == pytest.approx(one["losses"][2:], rel=1e-5, abs=0)


def test_pipeline_flag_rules(features, capsys):
    from tests.test_train_args import _err

    base = ["--objective", "dflash", "--features-path", str(features / "feat"), "--verifier", str(features / "v"),
            "--mask-token-id", "4", "--block-size", "4", "--num-attention-heads", "2"]
    assert "--num-layers 3 must be divisible by --pipeline-model-parallel-size 2" in \
        _err(base + PP2 + ["--num-layers", "3"], 2, capsys)
    assert "--num-layers-per-virtual-pipeline-stage is refused (the drafter's pipeline stages are not interleaved)" in \
        _err(base + PP2 + ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 2, capsys)
    assert "--tensor-model-parallel-size must be 1 (every drafter layer holds all its attention heads, and the " \
        "verifier's LM head is not vocabulary-parallel)" in _err(base + ["--tensor-model-parallel-size", "2"], 2, capsys)


def test_inputs_fix_flags_without_writing_them(features):
    """What the captured features and the verifier fix (--seq-length, the hidden size, the
    vocabulary, a NullTokenizer, the held-out batches) is the resolved run's; the namespace keeps the
    flags as given."""
    import copy

    from megatron_csbp.data.megatron_data import build_tokenizer
    from megatron_csbp.training.arguments import build_parser, validate_args

    args = build_parser().parse_args(_argv(features, []))
    given = copy.deepcopy(vars(args))
    run = validate_args(args, 1)
    assert vars(args) == given
    assert (run.seq_length, run.hidden_size, run.ffn_hidden_size, run.target_layer_ids) == (32, 16, 32, [0, 2])
    null = build_tokenizer("NullTokenizer", None, 50).vocab_size  # the verifier's 50 ids (+ EOD on megatron-core 0.16)
    assert (run.vocab_size, run.tokenizer_type, run.eval_interval, run.eval_iters) == (null, "NullTokenizer", 3, 1)
    assert (args.seq_length, args.hidden_size, args.vocab_size, args.eval_iters) == (128, 128, None, None)
    assert run.objective_inputs.facts == {"dflash_drafter_load": None, "dflash_drafter_save": None}


def _train_in_turn(rank, world, argvs):
    """train_rank of each argv in turn, in one process (one rank)."""
    return [train_rank(rank, world, argv) for argv in argvs]


def test_bf16_drafter_within_bf16_bound_of_fp32_and_resumes(features, one_rank):
    """--bf16 trains the drafter (its weights and the verifier's frozen embeddings and head in
    bfloat16, fp32 main weights and norm weights), with and without the distributed optimizer,
    saves and resumes bit for bit.

    Error model against the fp32 run (`one_rank`): bf16 rounds with unit roundoff u = 2^-8. Each
    weight and each stored activation is rounded once; a draft row's path to the logits passes
    the embedding, the context projection and its norm, then per layer about 10 rounded tensors
    (norm, q, kv, q/k norms, attention output, projection, residual, two MLP GEMMs, residual), and
    the final norm: K = 3 + 10 D = 23 roundings for D = 2 layers (the CE itself is fp32). Worst case
    the relative errors add, so |d logit| <= K u max|logit|, and max|logit| <= |final norm output|
    x max row norm of the head = sqrt(h) (1 + 3 lr) max_v |head_v| (the norm's output has RMS 1
    times its weight, which Adam moves by <= lr a step). The CE moves by at most twice the largest
    logit change; the 3 steps' updates carry the gradients' K u relative error into weights that
    change by <= 3 lr, second order here. Bound: |loss_bf16 - loss_fp32| <= 2 K u max|logit|."""
    from transformers import AutoModelForCausalLM
    from torch.distributed.checkpoint import FileSystemReader

    root = features
    head = AutoModelForCausalLM.from_pretrained(str(root / "v")).get_output_embeddings().weight.detach()
    max_logit = head.shape[1] ** 0.5 * (1 + 3 * 3e-3) * float(head.norm(dim=1).max())
    bound = 2 * (3 + 10 * 2) * 2.0 ** -8 * max_logit
    dist = _argv(root, ["--bf16"])
    plain = [a for a in dist if a != "--use-distributed-optimizer"]
    runs = []
    for name, argv in (("bf16", dist), ("bf16_plain", plain)):
        runs += [argv + ["--save", str(root / name), "--save-interval", "2"],
                 argv + ["--load", str(root / name), "--ckpt-step", "2"]]
    dist_full, dist_resumed, plain_full, plain_resumed = run_distributed(_train_in_turn, 1, runs)[0]
    print("fp32", one_rank["losses"], _evals(one_rank), "bf16", dist_full["losses"], _evals(dist_full),
          "bf16 without the distributed optimizer", plain_full["losses"], _evals(plain_full))
    for full, resumed in ((dist_full, dist_resumed), (plain_full, plain_resumed)):
        assert max(abs(a - b) for a, b in zip(full["losses"], one_rank["losses"])) <= bound
        assert abs(_evals(full)[0][0] - _evals(one_rank)[0][0]) <= bound
        assert full["losses"] != one_rank["losses"]  # it did run in bf16
        assert resumed["iteration"] == 3 and resumed["losses"] == full["losses"][2:]
    print("bound", bound)
    saved = FileSystemReader(str(root / "bf16" / "iter_0000002")).read_metadata().state_dict_metadata
    dtypes = {k: str(v.properties.dtype) for k, v in saved.items() if hasattr(v, "properties")}
    assert dtypes["layers.0.linear_q.weight"] == dtypes["encoder.fc.weight"] == "torch.bfloat16"
    assert dtypes["final_norm.weight"] == "torch.float32"


@pytest.mark.slow
def test_pp2_csbp_matches_one_rank_and_pp2_resumes_one_rank(features, one_rank):
    """PP 2 x CSBP (CP 2 x BP 2: a shard group of 2 per stage) on 4 ranks, the global batch in one
    micro-batch of 3 sequences (their rows cross the stage one after the other); CSBP and the
    micro-batching reorder fp32 sums (tests/test_dflash_layouts.py's error model): 1e-5 relative."""
    flags = PP2 + ["--context-parallel-size", "2", "--block-parallel-size", "2", "--micro-batch-size", "3"]
    for r in _train(features, 4, flags):
        assert r["losses"] == pytest.approx(one_rank["losses"], rel=1e-5, abs=0)
        assert list(_evals(r)[0]) == pytest.approx(list(_evals(one_rank)[0]), rel=1e-5)
    # one rank's checkpoint of iteration 2 -> PP 2: the same last step
    for r in _train(features, 2, PP2 + ["--load", str(features / "one"), "--ckpt-step", "2"]):
        assert r["iteration"] == 3 and r["losses"] == pytest.approx(one_rank["losses"][2:], rel=1e-5, abs=0)


@pytest.mark.slow  # suite budget (18 s): test_pp2_matches_one_rank_and_resumes_across_layouts keeps the drafter's PP 2 exactness in the default suite
def test_pp2_uneven_stages_match_one_rank(features):
    """Stages of different depth (`--decoder-first-pipeline-num-layers 1` of 3 layers: 1 + 2): the
    drafter's layers are keyed by their global index, so the split does not change the model; the
    same 1e-5 bound."""
    three = ["--num-layers", "3"]
    (one,) = _train(features, 1, three)
    pp = _train(features, 2, PP2 + three + ["--decoder-first-pipeline-num-layers", "1"])
    print("one rank", one["losses"], _evals(one), "PP 2 (1 + 2 layers)", pp[0]["losses"], _evals(pp[0]))
    for r in pp:
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=0)
        assert [e for ev in _evals(r) for e in ev] == pytest.approx([e for ev in _evals(one) for e in ev], rel=1e-5)
