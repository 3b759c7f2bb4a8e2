"""`python -m megatron_csbp.generate --load DIR --prompt TEXT ...`: decoding from a checkpoint on one
process (`generation/decode.py`; --help for the flags and the samplers)."""
import sys

from megatron_csbp.generation.decode import main
from megatron_csbp.utils.cli import run

if __name__ == "__main__":
    sys.exit(run(main))
