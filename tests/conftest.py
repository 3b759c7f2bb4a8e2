"""Shared fixtures. Tests run on CPU in fp32 with one intra-op thread (the machines are shared)."""
import os
import warnings

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every torchrun a test starts is --standalone (the variable torchrun reads for it): it binds a free
# port, so two test sessions on one machine (a developer's and CI's) never meet on torchrun's default port.
os.environ["PET_STANDALONE"] = "1"
# torch inductor's on-disk kernel cache is not keyed on ATEN_CPU_CAPABILITY: a kernel compiled under
# avx512 (e.g. Megatron's torch.compile'd `_apply_output_gate`, used by gated attention, qwen3_5) and
# reused under avx2 gave logits off by 9.7; under `default` the cached build failed to compile. One
# cache directory per capability (inherited by spawned ranks).
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")


@pytest.fixture(scope="session")
def megatron_single_rank():
    """A gloo world of size 1 with Megatron's parallel state at TP = PP = 1, for in-process models.

    Multi-rank tests spawn their own processes (tests/distributed.py) and are unaffected."""
    from megatron.core import parallel_state as mpu

    from megatron_csbp.training.demo import init_single_rank

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        init_single_rank()
    assert mpu.get_tensor_model_parallel_world_size() == 1
    yield


def build_tiny_gpt(vocab_size=64, seq_length=32, num_layers=2, hidden_size=32, num_attention_heads=4,
                   num_query_groups=2, ffn_hidden_size=64, seed=0, swap=True, **config_overrides):
    """A real megatron-core GPTModel (local spec, rotary, fp32, CPU) with the block attention swapped in."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_csbp.model.spec import with_block_diffusion_attention

    position_embedding_type = config_overrides.pop("position_embedding_type", "rope")
    kw = dict(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
              num_query_groups=num_query_groups, ffn_hidden_size=ffn_hidden_size, use_cpu_initialization=True,
              attention_dropout=0.0, hidden_dropout=0.0)
    kw.update(config_overrides)
    config = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec()
    if swap:
        spec = with_block_diffusion_attention(spec)
    torch.manual_seed(seed)
    return GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=seq_length,
                    position_embedding_type=position_embedding_type)


@pytest.fixture
def tiny_gpt(megatron_single_rank):
    """Factory: tiny_gpt(**overrides) -> GPTModel (see `build_tiny_gpt`)."""
    return build_tiny_gpt
