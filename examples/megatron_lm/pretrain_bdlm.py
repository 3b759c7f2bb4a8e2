"""Train a block diffusion LM with Megatron-LM's own `pretrain()` (checked with Megatron-LM tag
core_v0.16.1, commit 55ac7082517c3878ae653c07c09c534b8aed49f6). Run from a Megatron-LM checkout,
with megatron_csbp installed, exactly like pretrain_gpt.py plus the block-diffusion flags:

    cd Megatron-LM
    torchrun --nproc-per-node 8 /path/to/megatron-csbp/examples/megatron_lm/pretrain_bdlm.py \
        <the usual pretrain_gpt.py flags: model, data, optimizer, checkpoints> \
        --context-parallel-size 4 --block-parallel-size 4 --block-size 16 --objective bd3lm \
        --position-embedding-type rope --attention-dropout 0 --hidden-dropout 0

(the mask id defaults to the first padding id past the tokenizer's vocabulary). Without CUDA it runs
on CPU ranks with gloo; add --distributed-backend gloo --transformer-impl local
--no-gradient-accumulation-fusion --use-cpu-initialization (docs/megatron-lm.md lists them all).

No patch to Megatron-LM is needed: pretrain_gpt.py's dataset provider is reused, and
megatron_csbp.megatron_lm supplies the extra_args_provider, the model provider, the forward step and
the hook that builds the block-parallel groups inside Megatron's initialisation. The script rewrites
argv so Megatron sees --context-parallel-size max(CP, BP) (see megatron_csbp/megatron_lm.py).
"""
import os
import sys

# The Megatron-LM checkout (pretrain_gpt.py, megatron.training): MEGATRON_LM_PATH, else the current directory.
sys.path.insert(0, os.environ.get("MEGATRON_LM_PATH") or os.getcwd())

from megatron_csbp.megatron_lm import pretrain_bdlm  # noqa: E402

if __name__ == "__main__":
    pretrain_bdlm()
