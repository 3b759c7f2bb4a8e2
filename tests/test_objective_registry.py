"""The objective registry is the one source of `--objective`: a throwaway objective registered here
(one class, no edit elsewhere) is a choice of the trainer's and the Megatron-LM hooks' parsers, its
flag parses, its rules run in validate_args, it builds from the flags and gets FLOPs; and the
noise-eps and mask-id rules read the same from an objective's constructor and from validate_args."""
import argparse
import contextlib
from dataclasses import replace

import pytest
import torch

from megatron_csbp.objectives import (BD3LMObjective, DiffusionGemmaSFTObjective, FastDLLMv2Objective, NoisedBatch,
                                      Objective)
from megatron_csbp.objectives.flags import MASK_TOKEN_FLAGS, NOISE_FLAGS, option
from megatron_csbp.objectives.registry import objective_class, objective_names, register_objective, unregister_objective
from megatron_csbp.training.arguments import Resolved, build_parser, model_args, parse_args
from tests.train_helpers import TINY

V = 128  # the embedding rows of TINY (--vocab-size 64: ids 0..63 plus EOD 64, padded to 128): the mask-id bound

TOY_RATE = option("--toy-rate", float, 0.5, "toy: share of supervised tokens masked")


class ToyObjective(Objective):
    """Masks the first ceil(rate * L) supervised tokens of every sample (weight 1)."""

    flags = MASK_TOKEN_FLAGS + (TOY_RATE,)
    mask_token_needed = "--mask-token-id (toy)"

    def __init__(self, block_size, mask_token_id, rate):
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"--toy-rate must be in (0, 1], got {rate}")
        self.check_mask(mask_token_id)
        self.block_size, self.mask_token_id, self.rate = block_size, mask_token_id, rate

    @classmethod
    def validate(cls, args, facts=None):
        if not 0.0 < TOY_RATE.value(args) <= 1.0:
            raise ValueError(f"--toy-rate must be in (0, 1], got {TOY_RATE.value(args)}")

    @classmethod
    def from_args(cls, args):
        return cls(args.block_size, args.mask_token_id, TOY_RATE.value(args))

    def noise(self, tokens, loss_mask, sample_index):
        masked = loss_mask.bool() & (torch.cumsum(loss_mask, 1) <= self.rate * tokens.shape[1])
        return NoisedBatch(torch.where(masked, torch.full_like(tokens, self.mask_token_id), tokens),
                           torch.where(masked, tokens, torch.full_like(tokens, -100)), masked.float())


@contextlib.contextmanager
def toy_registered():
    register_objective("toy")(ToyObjective)
    try:
        yield
    finally:
        unregister_objective("toy")


def _parse_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=1)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_a_registered_objective_reaches_every_parser_and_builds(capsys):
    from megatron_csbp.training.megatron_lm import extra_args_provider
    from megatron_csbp.training.metrics import flops_per_sample
    from megatron_csbp.model.assemble import build_objective

    assert "toy" not in objective_names()
    with toy_registered():
        assert objective_names()[-1] == "toy"
        for parser in (build_parser(), extra_args_provider(argparse.ArgumentParser())):
            action = next(a for a in parser._actions if "--objective" in a.option_strings)
            assert "toy" in action.choices
            assert parser.get_default("toy_rate") == 0.5
        # its rule runs in validate_args, naming the flag
        assert "--toy-rate must be in (0, 1], got 2.0" in _parse_error(
            TINY + ["--objective", "toy", "--toy-rate", "2", "--mask-token-id", "5"], capsys)
        # its mask rule too (the shared one: an id of the vocabulary)
        assert f"--mask-token-id {V} is outside the vocabulary [0, {V})" in _parse_error(
            TINY + ["--objective", "toy", "--mask-token-id", str(V)], capsys)
        args = facts = parse_args(TINY + ["--objective", "toy", "--toy-rate", "0.25", "--mask-token-id", "5"],
                                 world_size=1)
        # ModelArgs does not name --toy-rate: the objective's flags ride along
        objective = build_objective(model_args(facts))
        assert isinstance(objective, ToyObjective) and objective.rate == 0.25 and objective.mask_token_id == 5
        tokens = torch.arange(2 * 32).view(2, 32) % 60
        noised = objective.noise(tokens, torch.ones(2, 32), torch.arange(2))
        assert int(noised.weights.sum()) == 2 * 8 and bool((noised.noisy_tokens[:, :8] == 5).all())
        # FLOPs terms from the base class: a [noisy ; clean] objective of one view, as BD3-LM's
        toy_flops = flops_per_sample(args)
        assert toy_flops == flops_per_sample(replace(args, derived={**args.derived, "objective": "bd3lm"})) > 0
    assert "toy" not in objective_names()
    assert "invalid choice: 'toy'" in _parse_error(TINY + ["--objective", "toy"], capsys)


# ---- one rule each for the noise interval and the mask id, in the constructor and validate_args ----

def _message(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _validate_args_message(argv, capsys):
    """The message validate_args exits with (None: accepted)."""
    try:
        parse_args(argv, world_size=1)
    except SystemExit:
        err = capsys.readouterr().err
        return err.strip().splitlines()[-1].split("error: ", 1)[1]
    return None


def _or_pretrained(want, name):
    """fast-dllm-v2 adapts a pretrained model: flags that pass every other rule still need a --load
    checkpoint (the last rule validate_args checks)."""
    if want is None and objective_class(name).needs_pretrained:
        return (f"--objective {name} adapts a pretrained autoregressive model: give --load DIR (a checkpoint, "
                "e.g. from python -m megatron_csbp.convert hf-to-megatron)")
    return want


@pytest.mark.parametrize("eps", [(0.0, 1.0), (0.5, 0.4), (1e-3, 1.5), (-0.1, 0.5), (0.2, 0.8), (1.0, 1.0)])
def test_noise_interval_rule_is_one(eps, capsys):
    lo, hi = eps
    want = None if 0.0 < lo <= hi <= 1.0 else \
        f"--noise-eps-min/--noise-eps-max must satisfy 0 < min <= max <= 1, got {lo}, {hi}"
    flags = ["--noise-eps-min", str(lo), "--noise-eps-max", str(hi)]
    constructors = {
        "bd3lm": lambda: BD3LMObjective(8, 5, eps_min=lo, eps_max=hi),
        "fast-dllm-v2": lambda: FastDLLMv2Objective(8, 5, eps_min=lo, eps_max=hi),
        "diffusiongemma-sft": lambda: DiffusionGemmaSFTObjective(8, V, eps_min=lo, eps_max=hi),
    }
    for name, build in constructors.items():
        assert _message(build) == want, name
    for name in ("bd3lm", "fast-dllm-v2"):
        argv = TINY + ["--objective", name, "--mask-token-id", "5"] + flags
        assert _validate_args_message(argv, capsys) == _or_pretrained(want, name), name
    # diffusiongemma-sft's validate (validate_args needs a DiffusionGemma checkpoint for the rest)
    ns = build_parser().parse_args(["--objective", "diffusiongemma-sft", "--sft-data-path", "x"] + flags)
    facts = Resolved(shape_unknown=True)
    assert _message(lambda: DiffusionGemmaSFTObjective.validate(ns, facts)) == want
    assert _message(lambda: Objective.validate(ns, facts)) is None  # the base class has no noise flags


def test_a_constructor_setting_is_checked_by_its_flag_never_rounded():
    """An objective's keyword settings pass through their flags' type and rule: an int setting given 2.5 is
    refused in one line naming the flag (not truncated to 2), an equal float is taken."""
    from megatron_csbp.objectives.dflash import DFlashObjective

    assert _message(lambda: DFlashObjective(4, 5, max_anchors=2.5)) == \
        "--dflash-max-anchors must be of type int, got 2.5"
    assert DFlashObjective.option_values(max_anchors=3.0, gamma=3) == DFlashObjective.option_values(max_anchors=3,
                                                                                                    gamma=3.0)


@pytest.mark.parametrize("mask_id", [None, -1, 0, 5, V - 1, V, V + 7])
@pytest.mark.parametrize("cls,name", [(BD3LMObjective, "bd3lm"), (FastDLLMv2Objective, "fast-dllm-v2")])
def test_mask_id_rule_is_one(cls, name, mask_id, capsys):
    want = _message(lambda: cls(8, mask_id).check_vocab(V))
    if mask_id is None:
        assert want.startswith(f"--objective {name} needs --mask-token-id")
    elif 0 <= mask_id < V:
        assert want is None
    else:
        assert want == f"--mask-token-id {mask_id} is outside the vocabulary [0, {V})"
    argv = TINY + ["--objective", name] + ([] if mask_id is None else ["--mask-token-id", str(mask_id)])
    got = _validate_args_message(argv, capsys)
    if mask_id is None and cls.mask_from_tokenizer:
        assert got is None  # bd3lm: the tokenizer's <mask> fills an unset id, then the same rule holds
    else:
        assert got == _or_pretrained(want, name)
