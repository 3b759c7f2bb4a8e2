"""megatron-core (and Megatron-LM's training loop) without TE/apex, and on CPU gloo ranks: two layers.

Library fixes (`compat.libraries`) on every device, keyed on the missing library; device
relocation (`compat.cpu.install_cpu_compat()`) only without CUDA. Which patches change numerics,
and why: docs/compat.md.
"""
