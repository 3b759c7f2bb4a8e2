"""LoRA checkpoints (docs/lora.md#checkpoints): a --lora-rank run saves its adapters and their
optimizer state only, with its base's path and fingerprint; a resume is exact (same layout: bit for
bit; another layout: the suite's fp32 layout tolerance), in fp32 and bf16 (fused and canonical q / k /
v targets); a wrong base, a full checkpoint given to a LoRA run and the reverse, and other LoRA flags
are refused in one line; the
checkpoint is smaller than the full model's by the expected factor; `read_lora_checkpoint` /
`write_lora_checkpoint` give and take the adapters as full tensors."""
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.train_helpers import TINY, train_rank

LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
CSBP = ["--context-parallel-size", "2", "--block-parallel-size", "2", "--use-distributed-optimizer"]


def _bases(rank, world_size, root):
    """Two full checkpoints of the TINY model (fp32, Adam): `base` after 2 iterations, `other` after 3
    (the first step's learning rate is 0: warmup)."""
    from megatron_csbp.training.loop import main

    for name, iters in (("base", 2), ("other", 3)):
        main(TINY + ["--train-iters", str(iters), "--save", os.path.join(root, name)])


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bases"))
    run_distributed(_bases, 1, root)
    return os.path.join(root, "base"), os.path.join(root, "other")


def _trainer(argv):
    from megatron_csbp.training.arguments import build_parser, validate_args
    from megatron_csbp.training.config import TrainerConfig
    from megatron_csbp.training.trainer import Trainer

    return Trainer(TrainerConfig.from_args(validate_args(build_parser().parse_args(list(argv)), 1)))


def _train(argv):
    """(losses, {adapter name: tensor} at the end, parameter count, adapter count) of one run."""
    from megatron_csbp.lora import is_adapter

    with _trainer(argv) as t:
        result = t.train()
        named = dict(t.chunks[0].gpt.named_parameters())
        adapters = {n: p.detach().clone() for n, p in named.items() if is_adapter(n)}
        counts = (sum(p.numel() for n, p in named.items() if not is_adapter(n)), sum(a.numel() for a in adapters.values()))
    return [h["loss"] for h in result["history"]], adapters, counts


def _refusal(argv):
    """The one line that refuses `argv` (at parse time or at the load), or None when it trains."""
    try:
        with _trainer(argv) as t:
            t.train()
    except ValueError as exc:  # (CheckpointError is one)
        return str(exc)
    return None


def _sizes(folder):
    """(bytes of the tensors .metadata lists, bytes of the .distcp files) of a checkpoint folder."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(folder).read_metadata().state_dict_metadata.values()
    data = sum(m.size.numel() * m.properties.dtype.itemsize for m in meta if hasattr(m, "chunks"))
    return data, sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".distcp"))


def _one_rank(rank, world_size, base, other, root):
    """Everything one process checks, in one spawn (a world can be made again after the last)."""
    from megatron.core import dist_checkpointing

    from megatron_csbp.checkpoint.files import LORA_FILE
    from megatron_csbp.lora.checkpoint import read_lora_checkpoint, write_lora_checkpoint

    out = {}
    lora, run = os.path.join(root, "lora"), TINY + LORA + ["--pretrained-checkpoint", base]
    out["full"], out["adapters"], out["counts"] = _train(run + ["--train-iters", "4", "--save", lora,
                                                                "--save-interval", "2"])
    # resumed without --pretrained-checkpoint: the base the LoRA checkpoint records
    out["resumed"], _, _ = _train(TINY + LORA + ["--train-iters", "4", "--load", lora, "--ckpt-step", "2"])
    meta = dist_checkpointing.load_tensors_metadata(os.path.join(lora, "iter_0000004"))
    out["model_keys"] = sorted(k for k in meta if not k.startswith("optimizer."))
    out["lora_bytes"] = _sizes(os.path.join(lora, "iter_0000004"))
    out["full_bytes"] = _sizes(os.path.join(base, "iter_0000002"))
    out["record"] = open(os.path.join(lora, "iter_0000004", LORA_FILE)).read()
    config, adapters, base_path = read_lora_checkpoint(lora)
    out["read"] = (config.rank, config.alpha, base_path, adapters)
    # the adapters written back as a release LoRA checkpoint: a LoRA run starts from them
    imported = os.path.join(root, "imported")
    write_lora_checkpoint(imported, config, adapters, base)
    out["reread"] = read_lora_checkpoint(imported)[1]
    with _trainer(run + ["--train-iters", "1", "--load", imported]) as t:
        t.load()
        out["loaded"] = {n: p.detach().clone() for n, p in t.chunks[0].gpt.named_parameters() if n in adapters}
        out["loaded_iteration"] = t.iteration
    # bf16: save at 2, resume from 2
    bf16, run16 = os.path.join(root, "bf16"), run + ["--bf16", "--train-iters", "4"]
    out["bf16"], _, _ = _train(run16 + ["--save", bf16, "--save-interval", "2"])
    out["bf16_resumed"], _, _ = _train(run16 + ["--load", bf16, "--ckpt-step", "2"])
    out["bf16_bytes"] = _sizes(os.path.join(bf16, "iter_0000004"))
    # bf16 with canonical targets (separate q / k / v adapters): save at 2, resume from 2
    canon = run16 + ["--lora-target-modules", "linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc2"]
    saved = os.path.join(root, "bf16-canonical")
    out["canonical"], out["canonical_adapters"], _ = _train(canon + ["--save", saved, "--save-interval", "2"])
    out["canonical_resumed"], out["canonical_resumed_adapters"], _ = _train(canon + ["--load", saved,
                                                                                     "--ckpt-step", "2"])
    # without LoRA, Megatron-LM's meaning: --pretrained-checkpoint = the weights of --load ... --finetune
    out["pretrained"] = _train(TINY + ["--pretrained-checkpoint", base, "--train-iters", "2"])[0]
    out["finetune"] = _train(TINY + ["--load", base, "--finetune", "--train-iters", "2"])[0]
    seeded = os.path.join(root, "seeded")  # adapters on the --seed initialisation (no --pretrained-checkpoint)
    _train(TINY + LORA + ["--train-iters", "1", "--save", seeded])
    out["refusals"] = {
        "seeded base": _refusal(TINY + LORA + ["--pretrained-checkpoint", base, "--load", seeded, "--train-iters", "1"]),
        "other base": _refusal(TINY + LORA + ["--pretrained-checkpoint", other, "--load", lora, "--train-iters", "4"]),
        "full to lora": _refusal(TINY + LORA + ["--load", base, "--train-iters", "2"]),
        "lora to full": _refusal(TINY + ["--load", lora, "--train-iters", "4"]),
        "rank": _refusal(TINY + ["--lora-rank", "2", "--lora-alpha", "8", "--load", lora, "--train-iters", "4"]),
        "lora as base": _refusal(TINY + LORA + ["--pretrained-checkpoint", lora, "--train-iters", "1"]),
    }
    return out


def test_lora_checkpoint_one_rank(bases, tmp_path):
    base, other = bases
    r = run_distributed(_one_rank, 1, base, other, str(tmp_path))[0]
    assert r["resumed"] == r["full"][2:], "a LoRA resume must continue the loss curve bit for bit"
    assert r["bf16_resumed"] == r["bf16"][2:], "bf16: a LoRA resume must continue the loss curve bit for bit"
    assert r["canonical_resumed"] == r["canonical"][2:], "bf16, canonical targets: the resume must be bit for bit"
    parts = {n.rsplit(".", 1)[1] for n in r["canonical_adapters"]}
    assert {"lora_A_q", "lora_B_k", "lora_B_v"} <= parts, parts
    assert r["canonical_resumed_adapters"].keys() == r["canonical_adapters"].keys()
    assert all(torch.equal(r["canonical_resumed_adapters"][n], t) for n, t in r["canonical_adapters"].items())
    assert r["model_keys"] and all(k.endswith((".lora_A", ".lora_B")) for k in r["model_keys"]), r["model_keys"]
    assert '"fingerprint": "sha256:' in r["record"] and os.path.abspath(base) in r["record"]
    # Size: a full fp32 checkpoint holds every parameter x (4 bytes + Adam's 2 x 4), the LoRA one its
    # adapters only x the same 12 bytes (fp32: no main copy; bf16: 2 + 4 of the fp32 main copy + 8),
    # so full / LoRA = parameters / adapter parameters: 28,832 / 4,096 = 7.0 here. On disk torch adds
    # about 0.8 KB per stored tensor, 1.5 times the data of this model's 0.5 KB adapters (16 matrices
    # x 2 layers x 3 states): the files are 3.5x smaller here, the factor at any real size.
    params, adapter_params = r["counts"]
    (lora_data, lora_disk), (full_data, full_disk) = r["lora_bytes"], r["full_bytes"]
    assert (lora_data, full_data) == (12 * adapter_params, 12 * params), (lora_data, full_data)
    assert r["bf16_bytes"][0] == 14 * adapter_params
    assert lora_disk * 3 < full_disk, (lora_disk, full_disk)
    rank, alpha, base_path, adapters = r["read"]
    assert (rank, alpha, base_path) == (4, 8.0, os.path.abspath(base))
    assert adapters.keys() == r["adapters"].keys()
    assert all(torch.equal(adapters[n], r["adapters"][n]) for n in adapters), "read_lora_checkpoint: the saved adapters"
    assert all(torch.equal(r["reread"][n], adapters[n]) for n in adapters), "write_lora_checkpoint round trip"
    assert r["loaded_iteration"] == 0 and all(torch.equal(r["loaded"][n], adapters[n]) for n in adapters)
    assert r["pretrained"] == r["finetune"]
    refusals = r["refusals"]
    assert all(m is not None and "\n" not in m for m in refusals.values()), refusals
    assert "--pretrained-checkpoint" in refusals["other base"] and "--load" in refusals["other base"]
    assert "no base" in refusals["seeded base"] and os.path.abspath(base) in refusals["seeded base"]
    assert "full (non-LoRA)" in refusals["full to lora"] and "--pretrained-checkpoint" in refusals["full to lora"]
    assert "LoRA checkpoint" in refusals["lora to full"] and "--lora-rank 4" in refusals["lora to full"]
    assert refusals["rank"].startswith("--lora-rank 2 differs")
    assert "is a LoRA checkpoint" in refusals["lora as base"]


def test_lora_resume_across_layouts(bases, tmp_path):
    """Saved under CSBP (CP 2 + BP 2, distributed optimizer), resumed under CSBP (bit for bit) and
    under TP 2 + SP (the adapters sharded like their base weights, SwiGLU's fc1 B included, and the
    distributed optimizer's state resharded)."""
    base, _ = bases
    save = str(tmp_path / "lora")
    run = TINY + LORA + ["--pretrained-checkpoint", base, "--train-iters", "4"]
    full = run_distributed(train_rank, 2, run + CSBP + ["--save", save, "--save-interval", "2"])[0]["losses"]
    resumed = run_distributed(train_rank, 2, run + CSBP + ["--load", save, "--ckpt-step", "2"])[0]
    assert resumed["iteration"] == 4 and resumed["losses"] == full[2:]
    other = run_distributed(train_rank, 2, run + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                  "--use-distributed-optimizer", "--load", save, "--ckpt-step", "2"])[0]
    # the suite's fp32 layout tolerance (tests/test_checkpoint.py): TP 2 reorders sums only
    assert other["losses"] == pytest.approx(full[2:], rel=1e-5)


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--adam-eps", "1e-3", "--moe-layer-freq", "[1,0]"]


def _moe_one_rank(rank, world_size, root, stage):
    """One rank: the MoE base (`stage` "base"), or the EP-2 LoRA checkpoint read, written back as a
    release LoRA checkpoint and loaded ("read")."""
    from megatron_csbp.lora.checkpoint import read_lora_checkpoint, write_lora_checkpoint
    from megatron_csbp.training.loop import main

    base, lora = os.path.join(root, "base"), os.path.join(root, "lora")
    if stage == "base":
        return main(TINY + MOE + ["--train-iters", "2", "--save", base])["iteration"]
    config, adapters, _ = read_lora_checkpoint(lora)
    write_lora_checkpoint(os.path.join(root, "imported"), config, adapters, base)
    with _trainer(TINY + MOE + LORA + ["--pretrained-checkpoint", base, "--load", os.path.join(root, "imported"),
                                       "--train-iters", "1"]) as t:
        t.load()
        loaded = {n: p.detach().clone() for n, p in t.chunks[0].gpt.named_parameters() if ".lora_" in n}
    return adapters, loaded


@pytest.mark.slow
def test_lora_experts_saved_under_ep(tmp_path):
    """MoE every other layer (megatron-core stores those layers' tensors by layer number, the dense
    ones stacked), the experts' adapters saved under EP 2 (DP 2, distributed optimizer): resumed under CSBP + EP 2 (the MoE
    layout tolerance), read on one rank by global expert index, written back and loaded. (The
    optimizer state of an EP-2 run does not load at EP 1, LoRA or not: megatron-core chains an expert
    optimizer then.)"""
    root = str(tmp_path)
    run_distributed(_moe_one_rank, 1, root, "base")
    run = TINY + MOE + LORA + ["--pretrained-checkpoint", os.path.join(root, "base"), "--expert-model-parallel-size",
                               "2", "--train-iters", "4"]
    full = run_distributed(train_rank, 2, run + ["--use-distributed-optimizer", "--save", os.path.join(root, "lora"), "--save-interval", "2"])[0]
    resumed = run_distributed(train_rank, 2, run + CSBP + ["--load", os.path.join(root, "lora"), "--ckpt-step", "2"])[0]
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)
    adapters, loaded = run_distributed(_moe_one_rank, 1, root, "read")[0]
    experts = {n for n in adapters if ".local_experts." in n}
    assert {n.split(".local_experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}
    assert all(n.startswith("decoder.layers.0.mlp.experts.local_experts.") for n in experts)  # MoE in layer 0 only
    assert any(n.startswith("decoder.layers.1.mlp.linear_fc1.") for n in adapters)
    assert loaded.keys() == adapters.keys() and all(torch.equal(loaded[n], adapters[n]) for n in adapters)
