"""Train a block diffusion LM with Megatron-LM's own `pretrain()` (checked with Megatron-LM tags
core_v0.16.1 on megatron-core 0.16.1 and core_v0.19.0 on megatron-core 0.19.2). With megatron_csbp
installed, run it exactly like pretrain_gpt.py plus the block-diffusion flags:

    torchrun --nproc-per-node 8 /path/to/megatron-csbp/examples/megatron_lm/pretrain_bdlm.py \
        <the usual pretrain_gpt.py flags: model, data, optimizer, checkpoints> \
        --context-parallel-size 4 --block-parallel-size 4 --block-size 16 --objective bd3lm \
        --position-embedding-type rope --attention-dropout 0 --hidden-dropout 0

Megatron-LM (pretrain_gpt.py, megatron.training) is imported from MEGATRON_LM_PATH, else the current
directory when it is a Megatron-LM checkout, else the cache ~/.cache/megatron-csbp/megatron-lm-<tag> of
the installed megatron-core (docs/megatron-lm.md "Getting Megatron-LM"; without any of them one line
says how to get it). The mask id defaults to the first padding id past the tokenizer's vocabulary.
Without CUDA it runs on CPU ranks with gloo; add --distributed-backend gloo --transformer-impl local
--no-gradient-accumulation-fusion --use-cpu-initialization (docs/megatron-lm.md lists them all).

No patch to Megatron-LM is needed: pretrain_gpt.py's dataset provider is reused, and
megatron_csbp.training.megatron_lm supplies the extra_args_provider, the model provider, the forward step and
the hook that builds the block-parallel groups inside Megatron's initialisation. The script rewrites
argv so Megatron sees --context-parallel-size max(CP, BP) (see megatron_csbp/training/megatron_lm.py).
"""
import sys

from megatron_csbp.utils import cli
from megatron_csbp.utils.megatron_lm_path import find, missing_message

if __name__ == "__main__":
    path = find(cwd=True)
    if path is None:
        cli.fail(missing_message(), 1)
    sys.path.insert(0, path)
    from megatron_csbp.training.megatron_lm import pretrain_bdlm

    pretrain_bdlm()
