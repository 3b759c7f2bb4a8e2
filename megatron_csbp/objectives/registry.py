"""Objectives registered by name: the one place `--objective NAME` is looked up.

    @register_objective("my-objective")
    class MyObjective(Objective):
        ...

in a new module of this package, plus its import line in `megatron_csbp/objectives/__init__.py`
(docs/training.md#objectives-one-registry).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

from megatron_csbp.utils.option import add_options

_REGISTRY: Dict[str, type] = {}


def register_objective(name: str):
    """Class decorator: register an `Objective` subclass as `--objective name`."""

    def register(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"objective {name!r} is registered twice ({_REGISTRY[name].__name__}, {cls.__name__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def unregister_objective(name: str) -> None:
    """Remove a registration (tests that register a throwaway objective)."""
    _REGISTRY.pop(name, None)


def objective_names() -> Tuple[str, ...]:
    """`--objective`'s choices, in registration order."""
    return tuple(registered_objectives())


def registered_objectives() -> Dict[str, type]:
    _load()
    return dict(_REGISTRY)


def objective_class(name: str) -> Type:
    cls = registered_objectives().get(name)
    if cls is None:
        raise ValueError(f"--objective must be one of {tuple(_REGISTRY)}, got {name!r}")
    return cls


def build_objective(args, vocab_size: Optional[int] = None):
    """The objective `args.objective` names, built from `args` (an argparse namespace or ModelArgs:
    flags it lacks take their declared defaults). With a vocabulary size (given, or `args.vocab_size`
    when `args` has one) its mask token is checked against it (`Objective.check_vocab`)."""
    objective = objective_class(args.objective).from_args(args)
    vocab = getattr(args, "vocab_size", None) if vocab_size is None else vocab_size
    if vocab is not None:
        objective.check_vocab(int(vocab))
    return objective


def objective_options(args) -> Dict[str, object]:
    """dest -> value of the flags `args.objective` reads (so a namespace that only copies some
    fields, e.g. ModelArgs, can carry an objective's own flags along)."""
    return {flag.dest: flag.value(args) for flag in objective_class(args.objective).flags}


def add_objective_args(parser) -> None:
    """The flags of every objective (each flag once, in registration order)."""
    add_options(parser, [flag for cls in registered_objectives().values() for flag in cls.flags])


def objective_help() -> str:
    """`--objective`'s help: each objective's `summary`."""
    return "; ".join(f"{name}: {cls.summary}" for name, cls in registered_objectives().items() if cls.summary)


def _load() -> None:
    import megatron_csbp.objectives  # noqa: F401  (its imports register the built-in objectives)
