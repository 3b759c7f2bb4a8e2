"""What every `python -m megatron_csbp.*` command does first: hide the warnings a user cannot act on.

`filter_warnings()` is called at the top of each command's `main()` (before megatron-core is
imported: these warnings fire at import time). It hides, and only hides:

- megatron-core's "Transformer Engine and Apex are not installed" / "Apex is not installed"
  notices: its fallbacks (torch optimizers, torch norms) are what the CPU path uses on purpose,
  and on GPU the block-diffusion attention replaces TE's anyway (docs/install.md: GPU extras);
- megatron-core's "full scope is deprecated" (its own `TransformerConfig` default for
  `cuda_graph_scope`; the plugin sets no CUDA-graph option);
- `FutureWarning` / `DeprecationWarning` raised inside megatron-core or inside
  `torch.distributed.checkpoint` (which megatron-core's `dist_checkpointing` calls: ShardedTensor
  and `load_state_dict` deprecations): library internals, nothing in a command line changes them.

Everything else (the plugin's own warnings, transformers', a user's code) is shown as usual. As a
library (`import megatron_csbp...`) nothing is filtered: only the commands call this.
"""
from __future__ import annotations

import warnings

#: (action, message regex, category, module regex) as `warnings.filterwarnings` takes them
FILTERS = (
    ("ignore", r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning, r"megatron\."),
    ("ignore", r"full scope is deprecated", UserWarning, r"megatron\.core"),
    ("ignore", "", FutureWarning, r"(megatron\.core|torch\.distributed\.checkpoint)(\.|$)"),
    ("ignore", "", DeprecationWarning, r"(megatron\.core|torch\.distributed\.checkpoint)(\.|$)"),
)


def filter_warnings() -> None:
    """Install `FILTERS` (idempotent: `warnings` drops duplicate filters)."""
    for action, message, category, module in FILTERS:
        warnings.filterwarnings(action, message=message, category=category, module=module)
