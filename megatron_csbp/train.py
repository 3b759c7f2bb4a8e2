"""`torchrun --nproc-per-node N -m megatron_csbp.train [Megatron-LM flags] [block-diffusion flags]`.

With no flags at all it runs the embedded demo (CSBP on the shipped corpus); see docs/training.md.
"""
from megatron_csbp.training.loop import main

if __name__ == "__main__":
    main()
