"""`Option`: one command-line flag declared once, with everything derived from it.

The trainer's table is `config.options.OPTIONS`; an objective lists its own Options in
`Objective.flags` (objectives/), and the parser collects them from the registry. This module sits
in utils/ so that both can import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Set, Tuple


@dataclass(frozen=True)
class Option:
    flags: Tuple[str, ...]  # the first is the name; the rest Megatron-LM's aliases
    type: Any = None        # None with a bool default: a switch
    default: Any = None
    help: Optional[str] = None
    group: str = "transformer"  # parser group (config.options.GROUPS)
    to: Tuple[str, ...] = ("model",)  # TrainerConfig sections that carry the value
    choices: Optional[Tuple] = None
    dest: Optional[str] = None  # None: from the flag's name
    off: Optional[str] = None  # the switch that clears it (--no-swiglu)
    off_help: Optional[str] = None
    rule: Optional[Callable[[str, Any], Optional[str]]] = None  # (flag, value) -> the refusal, or None
    config: Optional[str] = None  # TransformerConfig field of a flag-built model
    gpt: Optional[str] = None     # GPTModel keyword of a flag-built model
    nargs: Optional[str] = None
    action: Optional[str] = None  # Megatron's odd switches (--no-rope-fusion: store_false, default False)
    #: in a checkpoint's bdlm_meta.json "model_args" (training.config.CHECKPOINT_MODEL_KEYS); `shape` and
    #: `tensors` imply it
    saved: bool = False
    #: `ModelShape` has the attribute of this name: a converted checkpoint's value of the flag
    shape: bool = False
    #: the Hugging Face config.json key of a flag-built model's export
    hf: Optional[str] = None
    #: fixes the shapes of the saved tensors: a resume must give the checkpoint's value
    tensors: bool = False
    #: a flag whose rule changed (parsed default None): its value when unset, and the rule of the
    #: checkpoints saved before the flag existed (training.arguments.resume_objective_flags)
    fallback: Any = None
    before: Any = None

    def __post_init__(self):
        if self.dest is None:
            object.__setattr__(self, "dest", self.flags[0][2:].replace("-", "_"))
        object.__setattr__(self, "saved", self.saved or self.shape or self.tensors)

    @property
    def name(self) -> str:
        return self.dest

    @property
    def moe(self) -> bool:
        """A flag of the MoE layers (its TransformerConfig field is set only for an MoE model)."""
        return self.name == "num_experts" or self.name.startswith("moe_")

    @property
    def flag(self) -> str:
        return self.flags[0]

    def value(self, args):
        """The value in `args` (a namespace or ModelArgs), the default when absent, `fallback` when None."""
        value = getattr(args, self.dest, self.default)
        return self.fallback if value is None else value

    def add_to(self, group) -> None:
        kw = dict(dest=self.name, default=self.default, help=self.help)
        if self.action:
            return group.add_argument(*self.flags, action=self.action, **kw)
        if self.type is None and isinstance(self.default, bool):
            group.add_argument(*self.flags, action="store_true", **kw)
            if self.off:
                group.add_argument(self.off, dest=self.name, action="store_false", default=self.default,
                                   help=self.off_help)
            return
        metavar = None if self.choices else {int: "N", float: "X"}.get(self.type, "VALUE")
        group.add_argument(*self.flags, type=self.type, choices=self.choices, nargs=self.nargs, metavar=metavar, **kw)


def add_options(parser, options: Iterable[Option], added: Optional[Set[str]] = None) -> None:
    """Add `options` to `parser` (or an argument group), skipping the dests in `added` (updated)."""
    added = set() if added is None else added
    for o in options:
        if o.name not in added:
            o.add_to(parser)
            added.add(o.name)


def must(ok: Callable[[Any], bool], what: str):
    """A rule: `flag what, got value` unless ok(value) (None values are not checked)."""
    return lambda flag, v: None if ok(v) else f"{flag} {what}, got {v}"


POSITIVE, AT_LEAST_0 = must(lambda v: v > 0, "must be positive"), must(lambda v: v >= 0, "must be at least 0")
