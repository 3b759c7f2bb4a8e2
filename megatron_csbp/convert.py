"""`python -m megatron_csbp.convert`: Hugging Face <-> Megatron checkpoint conversion and scoring.

See docs/conversion.md. The main guard matters: dist_checkpointing's writer starts processes
that re-import `__main__`.
"""
import sys

from megatron_csbp.conversion.cli import main
from megatron_csbp.utils.cli import run

if __name__ == "__main__":
    sys.exit(run(main))
