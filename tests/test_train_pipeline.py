"""The trainer under pipeline parallelism (megatron_csbp/parallel/pipeline.py): the loss curve of one rank
(fp32, <= 1e-5 relative: the layouts only reorder fp32 sums, as in tests/test_train_layouts.py),
torch_dist checkpoints that resume exactly under another PP x CP/BP layout, and the flag rules.

Four micro-batches per iteration (micro-batch 1, global batch 4), more than the 2 stages; the
embeddings are tied (TINY's default), so the last stage's copy is kept in sync across steps."""
import pytest

from megatron_csbp.training.arguments import parse_args
from tests.distributed import run_distributed
from tests.test_train_args import _err  # parse_args must exit 2; returns stderr
from tests.train_helpers import TINY, train_rank

BASE = TINY + ["--micro-batch-size", "1", "--num-layers", "4", "--use-distributed-optimizer"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VP2 = PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]
CSBP = ["--context-parallel-size", "2", "--block-parallel-size", "2"]


EVAL = ["--eval-interval", "2", "--eval-iters", "1"]


def _train(world, flags, tmp_path=None, name=None, **kw):
    argv = BASE + ["--train-iters", "4"] + flags
    if name:
        argv += ["--save", str(tmp_path / name), "--save-interval", "2"]
    return run_distributed(train_rank, world, argv)


def _same(got, ref):
    assert got == pytest.approx(ref, rel=1e-5, abs=0)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    r = _train(1, EVAL, root, "one")[0]
    return root, r["losses"], _eval_losses(r)


def _eval_losses(r):
    return [h["eval_loss"] for h in r["history"] if "eval_loss" in h]


@pytest.mark.slow  # suite budget: tests/test_pipeline_exactness.py runs PP2 x VP2 by default
def test_interleaved_pp2_matches_one_rank_and_resumes_under_pp1(one_rank, tmp_path):
    root, ref, ref_eval = one_rank
    assert len(ref) == 4 and ref[-1] < ref[0] and len(ref_eval) == 2
    for r in _train(2, VP2 + EVAL, tmp_path, "vp"):
        _same(r["losses"], ref)
        _same(_eval_losses(r), ref_eval)  # evaluation (forward only) through the interleaved schedule
    # PP 2 x VP 2 checkpoint -> one rank, PP 1: the same curve from iteration 2 on.
    resumed = _train(1, ["--load", str(tmp_path / "vp"), "--ckpt-step", "2"])[0]
    assert resumed["iteration"] == 4
    _same(resumed["losses"], ref[2:])


@pytest.mark.slow
def test_pp2_csbp_matches_one_rank_and_resumes_across_layouts(one_rank, tmp_path):
    root, ref, _ = one_rank
    for r in _train(4, PP2 + CSBP, tmp_path, "pp_csbp"):
        _same(r["losses"], ref)
    # PP 2 x CSBP -> PP 1 x CP 2 ...
    for r in _train(2, ["--context-parallel-size", "2", "--load", str(tmp_path / "pp_csbp"), "--ckpt-step", "2"]):
        _same(r["losses"], ref[2:])
    # ... and one rank (PP 1) -> PP 2 x BP 2.
    for r in _train(4, PP2 + ["--block-parallel-size", "2", "--load", str(root / "one"), "--ckpt-step", "2"]):
        _same(r["losses"], ref[2:])


@pytest.mark.slow
@pytest.mark.parametrize("flags,world", [
    (PP2, 2),
    (PP2 + ["--context-parallel-size", "2"], 4),
    (PP2 + ["--decoder-first-pipeline-num-layers", "3"], 2),
    (PP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + CSBP, 8),
])
def test_more_pipeline_layouts(one_rank, flags, world):
    for r in _train(world, flags):
        _same(r["losses"], one_rank[1])


# A flag-built MoE with dense and MoE layers mixed (Megatron's --moe-layer-freq list): each chunk
# must build the pattern entries of the layers it holds (layers 0 and 2 MoE). 8 micro-batches of 1
# sample, so with EP 2 (data-parallel 2) each pipeline still runs 4 > 2 stages.
MIXED_MOE = (TINY + ["--micro-batch-size", "1", "--global-batch-size", "8", "--num-layers", "4", "--train-iters", "3",
                     "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "([1,0,1,0])",
                     "--adam-eps", "1e-3"])


@pytest.mark.slow  # suite budget: tests/test_pipeline_exactness.py runs this pattern under PP 2 x VP 2 by default
def test_mixed_dense_moe_interleaved_pp2_matches_one_rank():
    """PP 2 x VP 2 on a dense/MoE pattern: one rank's loss curve (tests/test_train_moe.py's bound,
    REL = 1e-5 relative in fp32: the layouts reorder fp32 sums; measured 0 for PP 2 x VP 2, whose
    sums run in one rank's order, and 6e-8 with EP 2, which adds the data-parallel all-reduce).
    Before: building a chunk failed (megatron-core's decoder block spec asserts without the
    chunk's vp_stage), and a MoE chunk after the first drew its weights by its local layer names."""
    from tests.test_train_moe import compare

    compare(MIXED_MOE, {"PP 2 x VP 2": (VP2, 2)})


@pytest.mark.slow
def test_mixed_dense_moe_interleaved_pp2_ep2_matches_one_rank():
    from tests.test_train_moe import compare

    compare(MIXED_MOE, {"PP 2 x VP 2 x EP 2": (VP2 + ["--expert-model-parallel-size", "2"], 4)})


@pytest.mark.parametrize("flags,world,needle", [
    (PP2 + ["--num-layers", "3"], 2, "--num-layers 3 must be divisible by --pipeline-model-parallel-size 2"),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "3"], 2, "--num-layers-per-virtual-pipeline-stage 3 must "
                                                                 "divide the 2 layers of a pipeline stage"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], 1, "--num-virtual-stages-per-pipeline-rank needs "
                                                         "--pipeline-model-parallel-size > 1"),
    (PP2 + ["--decoder-first-pipeline-num-layers", "4"], 2, "--num-layers 4 leaves 0 layers for 1 middle"),
    (VP2 + ["--global-batch-size", "3"], 2, "to be a multiple of --pipeline-model-parallel-size 2"),
    (PP2 + CSBP, 6, "world size 6 is not divisible"),
])
def test_pipeline_flags_refused_with_named_flag(flags, world, needle, capsys):
    assert needle in _err(BASE + flags, world, capsys)


def test_pipeline_flags_accepted():
    f = parse_args(BASE + VP2 + CSBP, world_size=4)
    assert f.virtual_pipeline_model_parallel_size == 2 and f.num_microbatches == 4 and f.data_parallel_size == 1
    f = parse_args(BASE + PP2 + ["--virtual-pipeline-model-parallel-size", "2"], world_size=2)
    assert f.virtual_pipeline_model_parallel_size == 2
    f = parse_args(BASE + PP2 + ["--decoder-last-pipeline-num-layers", "1"], world_size=2)
    assert f.virtual_pipeline_model_parallel_size is None


@pytest.mark.slow
def test_converted_checkpoint_trains_under_pp2_and_exports_to_hf(tmp_path):
    """A converted Hugging Face model (`convert hf-to-megatron`) trains under PP 2 from its release
    checkpoint, and the PP 2 checkpoint exports with `convert megatron-to-hf` to the same weights as
    the same training on one rank (fp32, 1e-5 relative: the layouts reorder fp32 sums)."""
    pytest.importorskip("transformers")
    import torch

    from megatron_csbp.conversion import api, hf_io
    from megatron_csbp.conversion.tiny import save_tiny_model

    save_tiny_model("llama", str(tmp_path / "hf"), seed=3)  # 2 layers, untied
    api.hf_to_megatron_checkpoint(str(tmp_path / "hf"), str(tmp_path / "meg"))
    argv = ["--mock-data", "--seq-length", "32", "--block-size", "8", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--no-progress-bar", "--log-interval", "1", "--objective", "ar",
            "--load", str(tmp_path / "meg"), "--train-iters", "2", "--lr", "1e-3", "--min-lr", "1e-4"]
    exported = {}
    for name, world, flags in (("one", 1, []), ("pp2", 2, PP2)):
        losses = run_distributed(train_rank, world, argv + flags + ["--save", str(tmp_path / name)])
        exported[name] = losses[0]["losses"]
        api.megatron_to_hf_checkpoint(str(tmp_path / name), str(tmp_path / f"{name}_hf"))
    _same(exported["pp2"], exported["one"])
    one, pp2 = hf_io.read_tensors(str(tmp_path / "one_hf")), hf_io.read_tensors(str(tmp_path / "pp2_hf"))
    assert sorted(one) == sorted(pp2)
    for k in one:
        assert torch.allclose(pp2[k].double(), one[k].double(), rtol=1e-5, atol=1e-6), k
