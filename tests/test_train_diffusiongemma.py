"""`python -m megatron_csbp.train --objective diffusiongemma-sft` on a converted tiny DiffusionGemma
(sliding + full layers, 4 experts) with the shipped SFT set and tokenizer: the same loss and
gradient norm under every layout, expert parallelism included, and refusals that name the rule.

The runs use --adam-eps 1e-3: with Adam's default 1e-8, parameters whose gradient is at the fp32
noise floor (every embedding row receives a ~1e-10 gradient through the self-conditioning soft
embeddings) move by about +-lr with a sign set by rounding, so the second loss of two layouts
differs by up to ~3e-4 relative (measured) although their first losses and gradients agree; a
larger eps leaves such updates at ~lr * 1e-7 and the comparison of every iteration meaningful.
"""
import os

import pytest

from tests.distributed import run_distributed
from tests.train_helpers import train_rank

pytest.importorskip("transformers")

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_csbp", "data", "assets")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from megatron_csbp.conversion import api
    from megatron_csbp.model.diffusiongemma.tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("dg")
    tiny_hf_model(seed=2, vocab_size=1024, sliding_window=16).save_pretrained(str(root / "hf"))
    api.hf_to_megatron_checkpoint(str(root / "hf"), str(root / "meg"))
    return str(root / "meg")


def sft_argv(load, *extra):
    return ["--load", load, "--objective", "diffusiongemma-sft",
            "--sft-data-path", os.path.join(ASSETS, "pydoc_sft.jsonl"),
            "--tokenizer-model", os.path.join(ASSETS, "pydoc_topics_unigram1024.model"),
            "--seq-length", "128", "--block-size", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "3", "--log-interval", "1", "--lr", "1e-3", "--adam-eps", "1e-3", "--no-progress-bar", *extra]


LAYOUTS = {
    "CSBP 2+2, EP 2": ("--context-parallel-size 2 --block-parallel-size 2 --expert-model-parallel-size 2", 2),
    "CP 2": ("--context-parallel-size 2", 2),
    "DP 2, EP 2": ("--expert-model-parallel-size 2", 2),
    "TP 2 + SP": ("--tensor-model-parallel-size 2 --sequence-parallel", 2),
}
# Also exact at model level (tests/test_diffusiongemma_layouts.py, test_kv_source_exchange.py): slow set.
MORE_LAYOUTS = {
    "CSBP 2+2, ring": ("--context-parallel-size 2 --block-parallel-size 2 --attention-transport ring", 2),
    "BP 2": ("--block-parallel-size 2", 2),
}


@pytest.fixture(scope="module")
def single(converted):
    return run_distributed(train_rank, 1, sft_argv(converted))[0]["history"]


# slow set (suite budget): the model-level layout tests (test_diffusiongemma_layouts, fp64) and the
# recipe --check test cover the default suite
@pytest.mark.slow
def test_diffusiongemma_sft_loss_is_the_same_under_every_layout(converted, single):
    _compare_layouts(converted, single, LAYOUTS)


@pytest.mark.slow
def test_diffusiongemma_sft_loss_is_the_same_under_more_layouts(converted, single):
    _compare_layouts(converted, single, MORE_LAYOUTS)


def _compare_layouts(converted, single, layouts):
    print(f"1 rank: losses {[h['loss'] for h in single]}, grad norms {[h['grad_norm'] for h in single]}")
    assert all(h["loss"] == h["loss"] and not h["skipped"] for h in single)  # finite, not skipped
    for name, (flags, world) in layouts.items():
        hist = run_distributed(train_rank, world, sft_argv(converted, *flags.split()))[0]["history"]
        print(f"{name}: losses {[h['loss'] for h in hist]}, grad norms {[h['grad_norm'] for h in hist]}")
        for it in range(3):
            assert abs(hist[it]["loss"] - single[it]["loss"]) <= 2e-5 * single[it]["loss"], (name, it)
        assert abs(hist[0]["grad_norm"] - single[0]["grad_norm"]) <= 1e-5 * single[0]["grad_norm"], name


# Pipeline parallelism (docs/pipeline.md): 4 micro-batches per iteration (global batch 8, micro-batch
# 2), more than the 2 stages; canvas plans turn on megatron-core's variable_seq_lengths P2P.
PP = {
    "PP 2 x CP 2": ("--pipeline-model-parallel-size 2 --context-parallel-size 2", 4),
    "PP 2 x BP 2": ("--pipeline-model-parallel-size 2 --block-parallel-size 2", 4),
    "PP 2 x CSBP 2+2": ("--pipeline-model-parallel-size 2 --context-parallel-size 2 --block-parallel-size 2", 4),
    "PP 2 x CSBP 2+2, EP 2": ("--pipeline-model-parallel-size 2 --context-parallel-size 2 --block-parallel-size 2 "
                              "--expert-model-parallel-size 2", 4),
    # EP peers hold different samples: they agree on which micro-batches run the first pass
    "PP 2 x DP 2, EP 2": ("--pipeline-model-parallel-size 2 --expert-model-parallel-size 2", 4),
    # the first pass's hidden states: each TP rank's share of the noisy rows, all-gathered on the first stage
    "PP 2 x TP 2 + SP": ("--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel", 4),
    "PP 2 x VP 2": ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1", 2),
}
PP_CASES = [(name, "0.5") for name in PP] + [("PP 2 x CSBP 2+2", "0")]


@pytest.fixture(scope="module")
def single_pp_batch(converted):
    """One rank, 4 micro-batches, self-conditioning 0.5 (the objective's default) and 0."""
    return {sc: run_distributed(train_rank, 1, sft_argv(converted, *PP_FLAGS, "--self-conditioning-prob", sc))[0]["history"]
            for sc in ("0.5", "0")}


# evaluation (forward only) runs self-conditioning's first pass through the stages too
PP_FLAGS = ("--global-batch-size", "8", "--eval-interval", "2", "--eval-iters", "1")


# Bound: the model is fp32 and PP moves no arithmetic between ranks; the CP / BP shard group reorders
# the fp32 sums of the attention merges and of the all-reduced losses and gradients (~10^3 terms a
# sum, each reorder <= K u32 = 10^3 x 6e-8 relative in the worst case, ~sqrt(K) u32 = 2e-6 typically),
# as under the PP 1 layouts above: the same 2e-5 (loss) / 1e-5 (first gradient norm) bound, with
# --adam-eps 1e-3 keeping later iterations comparable (module docstring). Measured:
# loss <= 1.4e-7 relative, first gradient norm <= 2.0e-6 (every case here).
@pytest.mark.slow  # ~40 s a layout on the shared 2-core machine
@pytest.mark.parametrize("name,sc", PP_CASES)
def test_diffusiongemma_sft_under_pipeline_parallelism_matches_one_rank(converted, single_pp_batch, name, sc):
    """`--objective diffusiongemma-sft` under PP 2 x CP / BP / CSBP through the trainer, with
    self-conditioning (its first pass through the stages, pipeline_self_conditioning) and without."""
    flags, world = PP[name]
    ref = single_pp_batch[sc]
    hist = run_distributed(train_rank, world, sft_argv(converted, *PP_FLAGS, "--self-conditioning-prob", sc,
                                                       *flags.split()))[0]["history"]
    print(f"{name}, sc {sc}: losses {[h['loss'] for h in hist]} vs {[h['loss'] for h in ref]}, grad norms "
          f"{[h['grad_norm'] for h in hist]} vs {[h['grad_norm'] for h in ref]}")
    for it in range(3):
        assert abs(hist[it]["loss"] - ref[it]["loss"]) <= 2e-5 * ref[it]["loss"], (name, it)
    assert abs(hist[0]["grad_norm"] - ref[0]["grad_norm"]) <= 1e-5 * ref[0]["grad_norm"], name
    assert abs(hist[1]["eval_loss"] - ref[1]["eval_loss"]) <= 2e-5 * ref[1]["eval_loss"], name


@pytest.mark.parametrize("flags, world, needle", [
    ("--block-parallel-size 2 --expert-model-parallel-size 2", 2, "(plain BP) is not supported"),
    ("--expert-model-parallel-size 3 --global-batch-size 6", 3, "must divide the 4 experts"),
    ("--context-parallel-size 2 --block-parallel-size 2 --expert-model-parallel-size 2 --seq-length 96", 2,
     "6 blocks must be a multiple of 4"),
    ("--clean-attention block_causal", 1, "clean stream is token_causal"),
    ("--tensor-model-parallel-size 2", 2, "on an MoE model needs --sequence-parallel"),
    # packed samples have their own canvas rows: a stage could not send two side by side
    ("--pipeline-model-parallel-size 2 --reset-attention-mask", 2, "use --micro-batch-size 1"),
])
def test_diffusiongemma_refusals_name_the_rule(converted, flags, world, needle, capsys):
    from megatron_csbp.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(sft_argv(converted, *flags.split()), world_size=world)
    assert needle in capsys.readouterr().err


def test_sft_objective_needs_a_diffusiongemma_and_ep_needs_experts(capsys):
    from megatron_csbp.training.arguments import parse_args

    base = ["--sft-data-path", os.path.join(ASSETS, "pydoc_sft.jsonl"),
            "--tokenizer-model", os.path.join(ASSETS, "pydoc_topics_unigram1024.model")]
    with pytest.raises(SystemExit):
        parse_args(base + ["--objective", "diffusiongemma-sft"], world_size=1)
    assert "--objective diffusiongemma-sft trains a DiffusionGemma" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(base + ["--expert-model-parallel-size", "2"], world_size=2)
    assert "--expert-model-parallel-size 2 needs an MoE model" in capsys.readouterr().err


def test_sft_samples_start_their_response_on_a_block_boundary():
    from megatron_csbp.data.sft import SFTDataset, default_sft_path
    from megatron_csbp.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(os.path.join(ASSETS, "pydoc_topics_unigram1024.model"))
    plain = SFTDataset(default_sft_path(), tok, 128)
    aligned = SFTDataset(default_sft_path(), tok, 128, align_response_to=16)
    # one sample per prompt/response pair of the shipped file (164: one per pydoc topic document)
    with open(default_sft_path()) as f:
        pairs = sum(1 for line in f if line.strip())
    assert len(aligned) == len(plain) == pairs == 164
    for i in range(len(aligned)):
        mask, tokens = aligned[i]["loss_mask"], aligned[i]["tokens"]
        first = int(mask.argmax())
        assert first % 16 == 0
        pad = first - int(plain[i]["loss_mask"].argmax())
        assert 0 <= pad < 16 and bool((tokens[:pad] == tok.pad).all())
        # the record, then padding with the pad id (not EOD: padding is no pair of the AR term)
        n = int(plain[i]["loss_mask"].nonzero().max()) + 1  # the plain sample's record ends with its response
        assert tokens[pad:pad + n].tolist() == plain[i]["tokens"][:n].tolist()[: 128 - pad]
        assert bool((tokens[pad + n:] == tok.pad).all())


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "examples", "recipes")


# slow set (suite budget): the model-level layout tests (test_diffusiongemma_layouts, fp64) and the
# recipe --check test cover the default suite
@pytest.mark.slow
def test_cpu_diffusiongemma_recipe_runs_and_learns(tmp_path):
    """The CPU-sized DiffusionGemma SFT recipe end to end: make the tiny HF model, convert it with
    the CLI, launch the recipe (CSBP 2+2 with EP 2) for a few iterations."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def run(*cmd):
        r = subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout + r.stderr

    run("megatron_csbp.model.diffusiongemma.tiny", "--output", str(tmp_path / "hf"))
    run("megatron_csbp.convert", "hf-to-megatron", "--hf-path", str(tmp_path / "hf"), "--output", str(tmp_path / "meg"))
    out = run("megatron_csbp.launch.recipes", os.path.join(RECIPES, "diffusiongemma_tiny_sft_cpu.yaml"),
              f"training.load={tmp_path / 'meg'}", "training.train_iters=12", "training.log_interval=1")
    losses = [float(line.split("lm loss:")[1].split("|")[0]) for line in out.splitlines() if "lm loss:" in line]
    print(f"recipe losses {losses}")
    assert "layout csbp" in out and len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3


def test_paper_diffusiongemma_recipe_validates_against_the_26b_shape(tmp_path):
    """The 26B-A4B recipe's flags pass the trainer's checks (EP 2 x CP 8 x BP 8 on 16 ranks, 256K,
    block 256) against the released model's shape file; data and tokenizer paths are local stand-ins."""
    from transformers import DiffusionGemmaConfig

    from megatron_csbp.launch.recipes import load_recipe, recipe_flags
    from megatron_csbp.model.families.diffusion_gemma import shape_from_hf_config
    from megatron_csbp.model.families import SHAPE_FILE
    from megatron_csbp.training.arguments import parse_args

    text = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
                layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, num_experts=128, top_k_experts=8,
                moe_intermediate_size=704, per_layer_config={i: {"head_dim": 512, "num_key_value_heads": 2}
                                                             for i in range(5, 30, 6)})
    shape = shape_from_hf_config(DiffusionGemmaConfig(text_config=text).to_dict(), "bfloat16")
    (tmp_path / SHAPE_FILE).write_text(shape.to_json())
    recipe = load_recipe(os.path.join(RECIPES, "diffusiongemma_26b_a4b_256k_csbp.yaml"))
    recipe["training"]["load"] = str(tmp_path)
    recipe["training"]["save"] = str(tmp_path / "save")
    recipe["data"]["sft_data_path"] = os.path.join(ASSETS, "pydoc_sft.jsonl")
    recipe["data"]["tokenizer_model"] = os.path.join(ASSETS, "pydoc_topics_unigram1024.model")
    # (the folder holds the shape file alone, no weights: a stand-in for the converted checkpoint)
    args = facts = parse_args(recipe_flags(recipe) + ["--no-exit-on-missing-checkpoint"], world_size=16)
    assert (args.expert_model_parallel_size, args.context_parallel_size, args.block_parallel_size,
            facts.data_parallel_size) == (2, 8, 8, 2)
    assert args.num_layers == 30 and args.clean_attention == "token_causal" and args.vocab_size == 262144


def test_trained_checkpoint_exports_to_hugging_face_with_its_vision_tower(converted, tmp_path):
    """A checkpoint the trainer saved under CSBP + EP exports as a diffusion_gemma folder: trained text
    weights, the source's vision tower carried through, loadable by transformers."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from megatron_csbp.conversion import api, hf_io

    save, out = str(tmp_path / "save"), str(tmp_path / "hf")
    run_distributed(train_rank, 2, sft_argv(converted, "--context-parallel-size", "2", "--block-parallel-size", "2",
                                            "--expert-model-parallel-size", "2", "--train-iters", "1", "--save", save))
    api.megatron_to_hf_checkpoint(save, out)
    src = hf_io.read_tensors(os.path.join(os.path.dirname(converted), "hf"))
    got = hf_io.read_tensors(out)
    assert sorted(src) == sorted(got)
    vision = [k for k in src if "vision" in k]
    assert vision and all(torch.equal(src[k], got[k]) for k in vision)
    assert not torch.equal(src["model.decoder.embed_tokens.weight"], got["model.decoder.embed_tokens.weight"])
    DiffusionGemmaForBlockDiffusion.from_pretrained(out)


TRAJECTORIES = [
    {"messages": [{"role": "user", "content": "Name a loop."}, {"role": "assistant", "content": "for"},
                  {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "while, which repeats"},
                  {"role": "user", "content": "And a third?"}, {"role": "assistant", "content": "a recursive call"}]},
    {"prompt": "What is a tuple?", "response": "An immutable sequence."},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a dict?"},
                  {"role": "assistant", "content": "A mapping."}, {"role": "user", "content": "Ordered?"},
                  {"role": "assistant", "content": "Yes, by insertion."}]},
    {"prompt": "What does len do?", "response": "It returns the number of items."},
]


@pytest.mark.slow  # the trainer on 1 rank and two 2-rank layouts (~2 min on 2 cores)
@pytest.mark.parametrize("pack", [False, True])
def test_trajectory_turns_train_the_same_under_every_layout(converted, tmp_path, pack):
    """--sft-trajectory-turns all through the trainer: every turn of a record in one optimizer step
    (--global-batch-size 2 records), the same losses on 1 rank, CP 2 and BP 2, packed or not."""
    import json

    path = tmp_path / "traj.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRAJECTORIES))
    argv = [a if a != os.path.join(ASSETS, "pydoc_sft.jsonl") else str(path) for a in sft_argv(converted)]
    argv += ["--sft-trajectory-turns", "all", "--micro-batch-size", "1", "--global-batch-size", "2",
             "--train-iters", "2"] + (["--pack-sequences", "--reset-attention-mask", "--reset-position-ids"] if pack else [])
    one = [h["loss"] for h in run_distributed(train_rank, 1, argv)[0]["history"]]
    for flags in ("--context-parallel-size 2", "--block-parallel-size 2"):
        got = [h["loss"] for h in run_distributed(train_rank, 2, argv + flags.split())[0]["history"]]
        print(f"pack={pack} {flags}: {got} (1 rank {one})")
        assert got == pytest.approx(one, rel=2e-6, abs=0)
