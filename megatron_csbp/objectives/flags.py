"""Command-line flags of the objectives, and the rules shared by several of them.

A flag is declared once, as a `Flag`; an objective lists the flags it reads in `Objective.flags`
(own ones and shared ones such as `MASK_TOKEN_ID`, `NOISE_EPS_MIN`), and the trainer's parser gets
the union over the registered objectives (`registry.add_objective_args`), each flag once.

The rules here are the only copies: objective constructors, `Objective.validate(args)`, the
trainer's `validate_args`, the Megatron-LM hooks and the DFlash trainer all call them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Set


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its name and `add_argument` keywords (type, default, choices, help)."""

    name: str
    options: Dict[str, Any] = field(default_factory=dict)
    #: a flag whose rule changed (parsed default None): its value when unset, and the rule of the
    #: checkpoints saved before the flag existed (a resume that leaves it unset keeps the saved rule,
    #: `training.arguments.resume_objective_flags`)
    fallback: Any = None
    before: Any = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def default(self):
        return self.options.get("default")

    def add_to(self, parser) -> None:
        parser.add_argument(self.name, **self.options)

    def value(self, args):
        """The flag's value in `args` (an argparse namespace or ModelArgs), its default when absent."""
        value = getattr(args, self.dest, self.default)
        return self.fallback if value is None else value


def add_flags(parser, flags: Iterable[Flag], added: Optional[Set[str]] = None) -> None:
    """Add `flags` to `parser` (or an argument group), skipping the names in `added` (updated)."""
    added = set() if added is None else added
    for flag in flags:
        if flag.name not in added:
            flag.add_to(parser)
            added.add(flag.name)


# ---- shared flags --------------------------------------------------------------------------------
MASK_TOKEN_ID = Flag("--mask-token-id", dict(
    type=int, default=None,
    help="absorbing mask token, any id in [0, vocab) (default: the tokenizer's <mask>); data tokens equal to it "
         "are never targets"))
MASK_TOKEN = Flag("--mask-token", dict(
    type=str, default=None,
    help="mask token as a string of the converted checkpoint's tokenizer (--load DIR/hf_assets/tokenizer.json), "
         "e.g. '<|reserved_special_token_0|>'; alternative to --mask-token-id"))
NOISE_EPS_MIN = Flag("--noise-eps-min", dict(type=float, default=1e-3,
                                              help="noise times t are drawn from [--noise-eps-min, --noise-eps-max]"))
NOISE_EPS_MAX = Flag("--noise-eps-max", dict(type=float, default=1.0, help="the largest noise time t"))

MASK_TOKEN_FLAGS = (MASK_TOKEN_ID, MASK_TOKEN)
NOISE_FLAGS = (NOISE_EPS_MIN, NOISE_EPS_MAX)


# ---- shared rules --------------------------------------------------------------------------------
def check_noise_interval(eps_min: float, eps_max: float) -> None:
    """Noise times are drawn from [eps_min, eps_max]: 0 < min <= max <= 1 (t = 0 would give BD3-LM
    an infinite 1/t weight and DiffusionGemma a block with no noise at all)."""
    if not 0.0 < eps_min <= eps_max <= 1.0:
        raise ValueError(f"--noise-eps-min/--noise-eps-max must satisfy 0 < min <= max <= 1, got {eps_min}, {eps_max}")


def check_noise_flags(args) -> None:
    """`check_noise_interval` on the parsed --noise-eps-min/--noise-eps-max."""
    check_noise_interval(NOISE_EPS_MIN.value(args), NOISE_EPS_MAX.value(args))


def check_mask_token_id(mask_token_id: Optional[int], vocab_size: Optional[int] = None,
                        needed_by: Optional[str] = None, vocabulary: str = "vocabulary") -> None:
    """A mask id is a row of the embedding: in [0, vocab_size) (checked once the vocabulary is
    known). `needed_by` ("--objective NAME needs --mask-token-id (why)"): the message when it is
    unset; None: an unset id passes."""
    if mask_token_id is None:
        if needed_by is not None:
            raise ValueError(needed_by)
        return
    if vocab_size is not None and not 0 <= int(mask_token_id) < vocab_size:
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


def check_choice(flag: Flag, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{flag.name} must be one of {tuple(choices)}, got {value!r}")
