"""Command-line flags of the objectives, and the rules shared by several of them.

A flag is declared once, as an `Option` (utils/option.py, the trainer table's type); an objective lists the flags it reads in `Objective.flags`
(own ones and shared ones such as `MASK_TOKEN_ID`, `NOISE_EPS_MIN`), and the trainer's parser gets
the union over the registered objectives (`registry.add_objective_args`), each flag once.

The rules here are the only copies: objective constructors, `Objective.validate(args)`, the
trainer's `validate_args`, the Megatron-LM hooks and the DFlash trainer all call them.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, Mapping, Optional

from megatron_csbp.utils.option import Option, must


def option(flag: str, type=None, default=None, help=None, **more) -> Option:
    """An objective's flag: an `Option` of the block-diffusion group."""
    return Option((flag,), type, default, help, group="bd", **more)


# ---- shared flags --------------------------------------------------------------------------------
MASK_TOKEN_ID = option("--mask-token-id", int, None, "absorbing mask token, any id in [0, vocab) (default: the "
                       "tokenizer's <mask>); data tokens equal to it are never targets", saved=True)
MASK_TOKEN = option("--mask-token", str, None, "mask token as a string of the converted checkpoint's tokenizer (--load "
                    "DIR/hf_assets/tokenizer.json), e.g. '<|reserved_special_token_0|>'; alternative to --mask-token-id")
NOISE_EPS_MIN = option("--noise-eps-min", float, 1e-3, "noise times t are drawn from [--noise-eps-min, --noise-eps-max]",
                       saved=True)
NOISE_EPS_MAX = option("--noise-eps-max", float, 1.0, "the largest noise time t", saved=True)

MASK_TOKEN_FLAGS = (MASK_TOKEN_ID, MASK_TOKEN)
NOISE_FLAGS = (NOISE_EPS_MIN, NOISE_EPS_MAX)
#: the noise flags as constructor keywords (`Objective.options`)
NOISE_OPTIONS = dict(eps_min=NOISE_EPS_MIN, eps_max=NOISE_EPS_MAX)
AT_LEAST_1 = must(lambda v: v >= 1, "must be >= 1")
IN_0_1 = must(lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")


# ---- shared rules --------------------------------------------------------------------------------
def check_noise_interval(eps_min: float, eps_max: float) -> None:
    """Noise times are drawn from [eps_min, eps_max]: 0 < min <= max <= 1 (t = 0 would give BD3-LM
    an infinite 1/t weight and DiffusionGemma a block with no noise at all)."""
    if not 0.0 < eps_min <= eps_max <= 1.0:
        raise ValueError(f"--noise-eps-min/--noise-eps-max must satisfy 0 < min <= max <= 1, got {eps_min}, {eps_max}")


def check_mask_token_id(mask_token_id: Optional[int], vocab_size: Optional[int] = None,
                        needed_by: Optional[str] = None, vocabulary: str = "vocabulary") -> None:
    """A mask id is a row of the embedding: in [0, vocab_size) (checked once the vocabulary is
    known). `needed_by` ("--objective NAME needs --mask-token-id (why)"): the message when it is
    unset; None: an unset id passes."""
    if mask_token_id is None and needed_by is not None:
        raise ValueError(needed_by)
    if mask_token_id is not None and vocab_size is not None and not 0 <= int(mask_token_id) < vocab_size:
        raise ValueError(f"--mask-token-id {int(mask_token_id)} is outside the {vocabulary} [0, {vocab_size})")


def default_mask_token_id(own: Optional[int], tokenizer_vocab: int, padded_vocab: int) -> Optional[int]:
    """The mask id when --mask-token-id is unset, chosen so that it cannot collide with data: the
    tokenizer's own mask token (`own`) if it has one, else the first id of the padded vocabulary past
    the tokenizer's (Megatron pads the vocabulary to --make-vocab-size-divisible-by: those rows exist
    in the embedding but no tokenizer output uses them), else None (no padding id is free). The
    Megatron-LM hooks and the trainer both take it from here; e.g. NullTokenizer(--vocab-size 64):
    ids 0..64 (EOD 64), padded to 128, mask id 65."""
    if own is not None:
        return int(own)
    return int(tokenizer_vocab) if padded_vocab > tokenizer_vocab else None


def check_choice(flag: Option, value) -> None:
    if value not in flag.choices:
        raise ValueError(f"{flag.flag} must be one of {tuple(flag.choices)}, got {value!r}")


def option_values(options: Mapping[str, Option], args=None, **given) -> Dict[str, Any]:
    """keyword -> value of each flag of `options` (keyword -> `Option`): read from `args` (parsed flags)
    when given, else from the keywords `given` (the flag's default, or `fallback`, for the rest),
    converted to the flag's type and checked against its choices and rule (ValueError naming it)."""
    unknown = sorted(set(given) - set(options))
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}")
    source = args if args is not None else SimpleNamespace(**{options[k].dest: v for k, v in given.items()})
    values = {}
    for key, flag in options.items():
        value = flag.value(source)
        if value is not None and flag.type is not None:
            if isinstance(value, float) and value == value and flag.type(value) != value:  # 2.5 for an int: refused
                raise ValueError(f"{flag.flag} must be of type {flag.type.__name__}, got {value!r}")
            value = flag.type(value)
        if flag.choices:
            check_choice(flag, value)
        refusal = flag.rule(flag.flag, value) if flag.rule is not None else None
        if refusal:
            raise ValueError(refusal)
        values[key] = value
    return values
