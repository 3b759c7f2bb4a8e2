"""`python -m megatron_csbp.plan`: the layout planner (see megatron_csbp/planner/cli.py)."""
import sys

from megatron_csbp.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
