"""LoRA adapters on megatron-core's parallel linears, inserted through the layer spec (docs/lora.md)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_csbp.lora.options import DEFAULT_TARGETS, INITS, LORA_OPTIONS  # noqa: F401

#: a fused module's parts (the rows of its weight, in order) that canonical targets adapt separately
FUSED_PARTS: Dict[str, Tuple[str, ...]] = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}
#: canonical target -> (the fused module it is a part of, the part)
PART_TARGETS: Dict[str, Tuple[str, str]] = {"linear_q": ("linear_qkv", "q"), "linear_k": ("linear_qkv", "k"),
                                            "linear_v": ("linear_qkv", "v"), "linear_fc1_gate": ("linear_fc1", "gate"),
                                            "linear_fc1_up": ("linear_fc1", "up")}
_ADAPTER = re.compile(r"\.lora_([AB])(?:_(q|k|v|gate|up))?$")


def split_target(target: str) -> Tuple[str, Optional[str]]:
    """(the module target, the part or None) of a --lora-target-modules name: `experts.linear_fc1_gate`
    -> (`experts.linear_fc1`, `gate`)."""
    parent, _, leaf = target.rpartition(".")
    if leaf not in PART_TARGETS:
        return target, None
    module, part = PART_TARGETS[leaf]
    return (f"{parent}.{module}" if parent else module), part


def _suffix(a: Sequence[str], b: Sequence[str]) -> bool:
    return list(b[-len(a):]) == list(a) or list(a[-len(b):]) == list(b)


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: Tuple[str, ...] = DEFAULT_TARGETS
    init: str = "default"

    def __post_init__(self):
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.rank <= 0:
            raise ValueError(f"--lora-rank must be positive for a LoRAConfig, got {self.rank}")
        if self.init not in INITS:
            raise ValueError(f"--lora-init must be one of {', '.join(INITS)}, got {self.init}")
        split = [split_target(t) for t in self.target_modules]
        for t, (module, part) in zip(self.target_modules, split):
            clash = [f for f, (m, p) in zip(self.target_modules, split)
                     if p is None and part is not None and _suffix(m.split("."), module.split("."))]
            if clash:
                raise ValueError(f"--lora-target-modules {t} and {clash[0]}: a fused module takes either its own "
                                 "adapter or adapters on its parts, not both")

    def parts_for(self, path: Sequence[str]) -> Optional[Tuple[str, ...]]:
        """The adapter of the module at spec `path`: None (no adapter), () (one fused adapter) or its
        parts in order (canonical targets: one adapter per part)."""
        from megatron_csbp.lora.spec import matches

        chosen = {p for m, p in map(split_target, self.target_modules) if matches(m, path)}
        if not chosen:
            return None
        return tuple(p for p in FUSED_PARTS.get(path[-1], ()) if p in chosen)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, args) -> Optional["LoRAConfig"]:
        """The config of the flags (a namespace or ModelArgs); None when --lora-rank is 0 or absent."""
        if not getattr(args, "lora_rank", 0):
            return None
        return cls(args.lora_rank, float(args.lora_alpha), float(args.lora_dropout), tuple(args.lora_target_modules),
                   args.lora_init)


def is_adapter(name: str) -> bool:
    """A parameter or state-dict key of an adapter (`....lora_A` / `....lora_B`, a part's `....lora_A_q`)."""
    return _ADAPTER.search(name) is not None


def adapter_key(name: str) -> Tuple[str, str, Optional[str]]:
    """(module, "A" or "B", part or None) of an adapter's name."""
    m = _ADAPTER.search(name)
    if m is None:
        raise ValueError(f"{name} is not an adapter tensor (.lora_A / .lora_B, or a part's .lora_A_q etc.)")
    return name[: m.start()], m.group(1), m.group(2)


def adapter_names(model) -> List[str]:
    """The adapter parameters' names in `model`."""
    return [n for n, _ in model.named_parameters() if is_adapter(n)]
