"""The trainer's model contract (`model.contract.ModelChunk`): a block diffusion LM's chunk and the
DFlash drafter's both implement it, and an evaluation keeps no state on the model: evaluations
under the held-out objective give equal losses and metrics, leave every attribute of the model as
it was, and the training loss after them is the one before."""
import numpy as np
import torch

from megatron_csbp.model.contract import ModelChunk


def _attributes(chunk):
    """Every module's own attributes (by identity) and the training objective's fields."""
    return ([(name, k, id(v)) for name, m in chunk.named_modules() for k, v in vars(m).items()],
            dict(vars(chunk.objective)))


def _check_evaluations_keep_no_state(chunk, batch, denominator):
    assert isinstance(chunk, ModelChunk)
    held_out = chunk.objective.for_evaluation()
    train_loss = float(chunk.training_loss(*batch, denominator).loss)
    before = _attributes(chunk)
    records = []
    for _ in range(2):
        metrics = {}
        with torch.no_grad():
            for _ in range(2):  # two micro-batches into one accumulator
                out, metrics = chunk.evaluation_loss(*batch, denominator, objective=held_out, metrics=metrics)
        records.append((float(out.loss), chunk.eval_record(metrics)))
    assert records[0] == records[1]
    assert _attributes(chunk) == before
    assert float(chunk.training_loss(*batch, denominator).loss) == train_loss
    assert records[0][0] != train_loss  # the held-out objective ran, not the training one
    return records[0][1]


def test_block_diffusion_chunk_keeps_no_state(megatron_single_rank):
    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.training.model import ModelArgs, build_model

    install_cpu_compat()  # the CPU relocation of Megatron's CUDA RNG tracker
    chunk = build_model(ModelArgs(objective="bd3lm", mask_token_id=127, seq_length=32, block_size=8))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 127, (2, 32), generator=g)
    chunk.objective.eps_min = 0.5  # a training schedule other than the held-out NELBO's
    batch = (tokens, torch.ones_like(tokens), torch.tensor([3, 4]))
    assert _check_evaluations_keep_no_state(chunk, batch, torch.tensor(64.0)) == {}


def test_drafter_chunk_keeps_no_state(megatron_single_rank):
    from megatron_csbp.data.features import FeatureSplit
    from megatron_csbp.attention.dflash import DFlashLayout
    from megatron_csbp.model.dflash import (DFlashDrafter, DFlashTrainingModel, DrafterShape, TrainableDrafter,
                                            drafter_transformer_config)
    from megatron_csbp.objectives.dflash import DFlashObjective

    shape = DrafterShape(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                         ffn_hidden_size=48, target_layer_ids=[1, 3], block_size=4, mask_token_id=5)
    L, V = 32, 40
    torch.manual_seed(0)
    drafter = DFlashDrafter(shape, drafter_transformer_config(shape, perform_initialization=True))
    g = np.random.RandomState(0)
    data = [{"tokens": g.randint(6, V, L), "loss_mask": np.ones(L, np.int64), "doc_ids": np.zeros(L, np.int64),
             "features": g.randn(L, 64).astype(np.float32)} for _ in range(4)]
    model = DFlashTrainingModel(drafter, torch.randn(V, 32), torch.randn(V, 32) * 0.3,
                                DFlashObjective(block_size=4, mask_token_id=5, max_anchors=5), DFlashLayout(L, 4))
    chunk = TrainableDrafter(drafter.config, model, (FeatureSplit(data, 0, 2), FeatureSplit(data, 2, 2)))
    items = [chunk.splits[0][i] for i in range(2)]
    batch = tuple(torch.stack([it[k] for it in items]) for k in ("tokens", "loss_mask")) + (torch.tensor([0, 1]),)
    record = _check_evaluations_keep_no_state(chunk, batch, 2.0)  # held out: the other split
    assert set(record) == {"eval_acceptance_per_offset", "eval_expected_acceptance_length"}
