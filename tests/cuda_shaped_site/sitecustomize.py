"""`run_all.sh --cuda-shaped` puts this folder on PYTHONPATH with CSBP_CUDA_SHAPED=1: every Python
process of the run (the check scripts and the trainers they start) begins as the CUDA-shaped
device (tests/cuda_shaped.py), before anything imports megatron."""
import os
import sys

if os.environ.get("CSBP_CUDA_SHAPED") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests import cuda_shaped

    cuda_shaped.install()
