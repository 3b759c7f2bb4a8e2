"""The trainer's model for --objective dflash (`training.model.CHUNK_BUILDERS`): the DFlash drafter
(model/dflash.py) with the verifier's frozen embeddings and head, on this rank's shard group."""
from __future__ import annotations

from megatron_csbp.checkpoint.drafter import trainer_drafter
from megatron_csbp.model.assemble import assemble_drafter, params_dtype
from megatron_csbp.objectives.dflash import DFlashObjective
from megatron_csbp.training.model import register_chunk_builder


@register_chunk_builder(DFlashObjective)
def build_drafter_chunks(a, device=None, finalize_model_grads_func=None) -> list:
    """The chunk builder of --objective dflash: the drafter of `checkpoint.drafter.trainer_drafter`
    (--load's or the flags'), the verifier's frozen embeddings and LM head in --bf16 / --fp16 / fp32,
    the captured features split into training and the last --eval-sequences."""
    from megatron_csbp.data.features import FeatureDataset, FeatureSplit, load_verifier
    from megatron_csbp.objectives import build_objective

    data, n_eval = FeatureDataset(a.features_path), a.eval_sequences
    splits = (FeatureSplit(data, 0, len(data) - n_eval), FeatureSplit(data, len(data) - n_eval, n_eval))
    verifier = load_verifier(a.verifier)
    dtype = params_dtype(a)
    embedding = verifier.get_input_embeddings().weight.detach().to(dtype).clone()
    head = verifier.get_output_embeddings().weight.detach().to(dtype).clone()
    del verifier
    objective = build_objective(a, vocab_size=embedding.shape[0])
    shape, weights = trainer_drafter(a, data.meta["hidden_size"])
    return [assemble_drafter(a, shape, embedding, head, objective, data.meta["seq_length"], splits, device,
                             finalize_model_grads_func, weights)]
