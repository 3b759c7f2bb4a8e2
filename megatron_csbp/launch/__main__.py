"""`python -m megatron_csbp.launch RECIPE`: megatron_csbp.launch.recipes."""
import sys

from megatron_csbp.launch.recipes import main
from megatron_csbp.utils.cli import run

sys.exit(run(main))
