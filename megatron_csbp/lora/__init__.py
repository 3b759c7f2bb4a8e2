"""LoRA adapters on megatron-core's parallel linears, inserted through the layer spec (docs/lora.md)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from megatron_csbp.lora.options import DEFAULT_TARGETS, INITS, LORA_OPTIONS  # noqa: F401

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


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

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, args) -> Optional["LoRAConfig"]:
        """The config of the flags (a namespace or ModelArgs); None when --lora-rank is 0 or absent."""
        rank = getattr(args, "lora_rank", 0) or 0
        if rank == 0:
            return None
        return cls(rank, float(args.lora_alpha), float(args.lora_dropout), tuple(args.lora_target_modules),
                   args.lora_init)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LoRAConfig":
        return cls(**json.loads(text))


def is_adapter(name: str) -> bool:
    """A parameter or state-dict key of an adapter (`....lora_A` / `....lora_B`)."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_names(model) -> List[str]:
    """The adapter parameters' names in `model`."""
    return [n for n, _ in model.named_parameters() if is_adapter(n)]
