"""The datasets an objective trains on (`Objective.build_datasets` picks): mock tokens, pretraining
tokens (Megatron's indexed datasets, --data-path) or prompt/response pairs (--sft-data-path).
Each returns (train, valid)."""
from __future__ import annotations

from typing import Optional


def mock_datasets(args):
    from megatron_csbp.data.megatron_data import MockDataset

    # Only ids the tokenizer produces as text: a NullTokenizer's are those below its EOD, its last id
    # (`args.vocab_size` is the tokenizer's vocabulary, EOD included, on every megatron-core; its mask id
    # defaults to a padding id above); another tokenizer's stay below its last two ids.
    num_ids = args.vocab_size - 1 if args.tokenizer_type == "NullTokenizer" else args.vocab_size - 2
    return tuple(MockDataset(args.seq_length, num_ids, args.seed, split) for split in ("train", "valid"))


def sft_datasets(args, align_response_to: Optional[int] = None):
    """One SFT dataset serves both splits. `align_response_to`: pad prompts so that responses start
    on a multiple of it (DiffusionGemma's canvases start on block boundaries)."""
    import torch.distributed as dist

    from megatron_csbp.data.megatron_data import saved_tokenizer
    from megatron_csbp.data.sft import SFTDataset, chat_template, describe_rendering

    tok = saved_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    template = chat_template(tok, getattr(args, "chat_template", "auto"))
    ds = SFTDataset(args.sft_data_path, tok, args.seq_length, align_response_to=align_response_to,
                    pack=bool(getattr(args, "pack_sequences", False)), template=template,
                    trajectory_turns=getattr(args, "sft_trajectory_turns", "record"))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(describe_rendering(template), flush=True)
        if ds.packing_efficiency is not None:
            print(ds.describe_packing(), flush=True)
    return ds, ds


def token_splits_read(args):
    """Which of Megatron's (train, valid, test) splits of --data-path a run reads: training; the
    validation split when it evaluates (--eval-iters > 0); never the test split."""
    return (True, bool(args.eval_iters), False)


def check_token_data(args, files_elsewhere: bool = False) -> Optional[str]:
    """--data-path and --split before any process group: every prefix is here, and every split the
    run reads gets a document (megatron-core hangs on one that does not). `files_elsewhere`
    (`launch --check`): prefixes that are not here are a note, not an error."""
    from megatron_csbp.data.megatron_data import checked_split_matrix, missing_prefixes

    if files_elsewhere and (missing := missing_prefixes(args.data_path)):
        return f"--data-path {' '.join(missing)} is not here: the --split rule runs at launch"
    checked_split_matrix(args.data_path, args.split, token_splits_read(args))
    return None


def token_datasets(args):
    from megatron_csbp.data.megatron_data import build_gpt_datasets, saved_tokenizer

    tok = saved_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    G = args.global_batch_size
    read = token_splits_read(args)
    n_eval = args.eval_iters * G  # every evaluation reads the same held-out batches
    train, valid, _ = build_gpt_datasets(args.data_path, args.split, args.seq_length, args.seed, tok,
                                         [args.train_iters * G, n_eval, 0], args.data_cache_path, read)
    if train is None:
        raise ValueError(f"--split {args.split} leaves no training documents")
    return train, valid if valid is not None else train
