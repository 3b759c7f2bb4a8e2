"""The LoRA flags, declared once as `Option`s; config/options.py adds them to the trainer's table."""
from __future__ import annotations

from megatron_csbp.utils.option import AT_LEAST_0, POSITIVE, Option, must

#: megatron-core's names of the projections adapted by default (attention, dense and expert MLPs)
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
#: PEFT's `init_lora_weights` choices: default = True, gaussian, random = False (docs/lora.md)
INITS = ("default", "gaussian", "random")

LORA_OPTIONS = [
    Option(("--lora-rank",), int, 0, "LoRA rank r of every adapter (0: no LoRA, every weight trains); the base "
           "weights are frozen", group="lora", rule=AT_LEAST_0, saved=True),
    Option(("--lora-alpha",), float, 8.0, "LoRA scaling numerator: the adapter's product is scaled by alpha / rank "
           "(PEFT's default 8)", group="lora", rule=POSITIVE, saved=True),
    Option(("--lora-dropout",), float, 0.0, "dropout on the adapter's input (PEFT's lora_dropout)", group="lora",
           rule=must(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"), saved=True),
    Option(("--lora-target-modules",), str, DEFAULT_TARGETS, "megatron-core module names to adapt: a name matches "
           "every module of that name (attention, dense MLP, experts, shared experts); a qualified name such as "
           "experts.linear_fc1 only those under that parent; the canonical targets linear_q / linear_k / linear_v (parts "
           "of linear_qkv) and linear_fc1_gate / linear_fc1_up (of SwiGLU's linear_fc1) give each part its own A and B "
           "(PEFT's separate q_proj / k_proj / v_proj, gate_proj / up_proj adapters)", group="lora", nargs="+", saved=True),
    Option(("--lora-init",), str, "default", "adapter init, PEFT's init_lora_weights: default (True: A kaiming-uniform "
           "like nn.Linear, B zeros), gaussian (A ~ N(0, 1/rank^2), B zeros), random (False: A and B both like "
           "nn.Linear; the adapter is not a no-op at step 0: for tests)", group="lora", choices=INITS, saved=True),
]
