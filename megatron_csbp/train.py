"""`torchrun --nproc-per-node N -m megatron_csbp.train [Megatron-LM flags] [block-diffusion flags]`.

With no flags at all it runs the embedded demo (CSBP on the shipped corpus); see docs/training.md.
Without torchrun it runs on one process (world size 1). Bad input and a run that cannot go on end
with one line `error: ...` (megatron_csbp/utils/cli.py) and a nonzero exit status.
"""
import sys
from functools import partial

from megatron_csbp.training.loop import main
from megatron_csbp.utils.cli import run


def sample(argv):
    """The embedded default run's samples, decoded in this process as `generate` decodes them."""
    from megatron_csbp.generation.decode import sample_text

    return sample_text(argv)


if __name__ == "__main__":
    sys.exit(run(partial(main, sample=sample)))
