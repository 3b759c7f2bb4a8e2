"""The trainer's one typed config: what `Trainer` reads, grouped by concern.

`TrainerConfig.from_args(args)` takes the namespace `training.arguments.parse_args` validated (every
rule about the flags lives there and in the objective/layout objects it builds) and copies it into
frozen sections. From then on nothing reads the namespace: the model is described by `ModelArgs`
(the typed model config `training.model.build_model` consumes, shared with generate and the
Megatron-LM hooks), and the loop, optimizer, data, evaluation, checkpoints and logging each by a
section below. A field's name is its flag's dest, so `--lr-warmup-iters` is `optim.lr_warmup_iters`.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict, Optional

from megatron_csbp.layout.sizes import layout_kind, shard_group_size


def _take(cls, args: argparse.Namespace, **overrides):
    """`cls` with every field copied from the namespace attribute of the same name."""
    values = {f.name: getattr(args, f.name) for f in fields(cls)
              if f.name not in overrides and (hasattr(args, f.name) or f.default is MISSING)}
    values.update(overrides)
    return cls(**values)


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    block_parallel_size: int
    expert_model_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool  # Megatron's TP sequence parallelism (activations split over TP ranks)
    use_distributed_optimizer: bool
    distributed_backend: Optional[str]
    virtual_pipeline_model_parallel_size: Optional[int] = None  # interleaved 1F1B (megatron_csbp/pipeline.py)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False

    @property
    def shard_group_size(self) -> int:
        """Ranks that hold one sequence: max(CP, BP) (Megatron's context-parallel axis)."""
        return shard_group_size(self.context_parallel_size, self.block_parallel_size)

    @property
    def layout(self) -> str:
        return layout_kind(self.context_parallel_size, self.block_parallel_size)

    def describe(self) -> str:
        pp = ""
        if self.pipeline_model_parallel_size > 1:
            vp = self.virtual_pipeline_model_parallel_size
            pp = f" x PP {self.pipeline_model_parallel_size}" + (f" (VP {vp})" if vp else "")
        return (f"world {self.world_size} = TP {self.tensor_model_parallel_size}{pp} x CP {self.context_parallel_size} / "
                f"BP {self.block_parallel_size} (layout {self.layout}) x DP {self.data_parallel_size}")


@dataclass(frozen=True)
class BatchConfig:
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    train_iters: int
    exit_interval: Optional[int]  # exit after every multiple of this iteration (Megatron-LM's)
    exit_duration_in_mins: Optional[float]  # exit after the first iteration past this many minutes
    skip_train: bool
    exit_signal_handler: bool  # on SIGTERM: finish the iteration, save, exit (Megatron-LM's)


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    bf16: bool
    fp16: bool
    loss_scale: Optional[float]
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    lr_warmup_iters: int
    lr_decay_iters: Optional[int]
    lr_decay_style: str
    check_for_nan_in_loss_and_grad: bool  # a non-finite loss or gradient norm stops the run
    #: warmup over this fraction of the decay steps (Megatron's --lr-warmup-fraction), else lr_warmup_iters
    lr_warmup_fraction: Optional[float] = None


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from; `build_datasets` reads these (and the objective's data needs)."""
    mock_data: bool
    data_path: Optional[Any]
    sft_data_path: Optional[str]
    split: str
    data_cache_path: Optional[str]
    tokenizer_type: Optional[str]
    tokenizer_model: Optional[str]
    vocab_size: Optional[int]
    seq_length: int
    block_size: int
    objective: str
    seed: int
    global_batch_size: int
    train_iters: int
    eval_iters: int
    pack_sequences: bool = False
    #: DataLoader worker processes reading training samples ahead (Megatron-LM's --num-workers)
    num_workers: int = 0
    #: --objective dflash: captured verifier features, the last `eval_sequences` held out
    features_path: Optional[str] = None
    eval_sequences: int = 0


@dataclass(frozen=True)
class EvalConfig:
    eval_interval: Optional[int]
    eval_iters: int


@dataclass(frozen=True)
class CheckpointConfig:
    load: Optional[str]
    save: Optional[str]
    save_interval: Optional[int]
    save_initial: bool
    ckpt_step: Optional[int]
    #: a converted checkpoint's ModelShape: its shape file and HF assets travel into every save
    model_shape: Optional[Any]
    #: hyper-parameters saved beside the weights (`bdlm_meta.json`; generate rebuilds the model from them)
    model_meta: Dict[str, Any]
    #: load weights only and start at iteration 0 (--finetune); skip optimizer + scheduler state (--no-load-optim)
    finetune: bool = False
    no_load_optim: bool = False
    #: keep only checkpoints at multiples of this (and the latest)
    save_retain_interval: Optional[int] = None
    #: Megatron-LM's rule for a resume whose schedule flags differ from the checkpoint's
    #: (training/checkpointing.py `check_resumed_schedule`)
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False


@dataclass(frozen=True)
class LogConfig:
    log_interval: int
    log_json: Optional[str]
    tensorboard_dir: Optional[str]
    no_progress_bar: bool
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    #: the run's flags, logged as the wandb run's config (Megatron logs vars(args))
    flags: Optional[Dict[str, Any]] = None


#: ModelArgs fields saved with a checkpoint (`bdlm_meta.json` "model_args"); format unchanged
CHECKPOINT_MODEL_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "seq_length",
    "vocab_size", "make_vocab_size_divisible_by", "block_size", "objective", "mask_token_id", "clean_attention",
    "normalization", "swiglu", "untie_embeddings_and_output_weights", "rotary_base", "tokenizer_type",
    "tokenizer_model", "eod_token_id", "noise_eps_min", "noise_eps_max", "loss_weighting", "seed", "init_method_std",
    # added with the export of flag-built models (model.families.gpt.hf_config_of_flags); older
    # checkpoints lack them and take the defaults of their time (model.families.gpt.FLAG_DEFAULTS)
    "kv_channels", "add_bias_linear", "position_embedding_type", "max_position_embeddings", "qk_layernorm",
    "norm_epsilon", "rotary_percent", "add_qkv_bias", "use_rope_scaling", "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor", "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_input_jitter_eps")


def model_meta(args: argparse.Namespace) -> Dict[str, Any]:
    """`bdlm_meta.json` "model_args": the saved flags, plus what they derive that a reader needs
    (the padded vocabulary of a flag-built model, which depends on TP; the weights' dtype)."""
    from megatron_csbp.model.builder import padded_vocab_size

    meta = {k: getattr(args, k, None) for k in CHECKPOINT_MODEL_KEYS}
    from megatron_csbp.data.tokenizer import tokenizer_record

    meta.update(tokenizer_record(meta["tokenizer_type"], meta["tokenizer_model"]))  # found again by the export
    meta["params_dtype"] = ("bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False)
                            else "float32")
    if getattr(args, "model_shape", None) is None and getattr(args, "vocab_size", None):
        meta["padded_vocab_size"] = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                      args.tensor_model_parallel_size)
    return meta


@dataclass(frozen=True)
class TrainerConfig:
    model: Any  # training.model.ModelArgs
    parallel: ParallelConfig
    batch: BatchConfig
    optim: OptimConfig
    data: DataConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    log: LogConfig

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainerConfig":
        """From a namespace `validate_args` has filled (derived sizes, the checkpoint's shape)."""
        from megatron_csbp.training.arguments import model_args

        return cls(
            model=model_args(args),
            parallel=_take(ParallelConfig, args),
            batch=_take(BatchConfig, args),
            optim=_take(OptimConfig, args),
            data=_take(DataConfig, args),
            eval=_take(EvalConfig, args),
            checkpoint=_take(CheckpointConfig, args, model_shape=getattr(args, "model_shape", None),
                             model_meta=model_meta(args)),
            log=_take(LogConfig, args, flags={k: v for k, v in vars(args).items()
                                               if isinstance(v, (int, float, str, bool, type(None)))}),
        )
