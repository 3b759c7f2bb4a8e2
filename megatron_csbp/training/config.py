"""The trainer's one typed config: what `Trainer` reads, grouped by concern.

`TrainerConfig.from_args(run)` takes the flags `training.arguments.parse_args` validated and resolved
(`Resolved`: every rule about the flags lives there and in the objective/layout objects it builds)
and copies them into frozen sections. From then on nothing reads the flags: the model is described by `ModelArgs` (the typed model config `training.model.build_model`
consumes, shared with generate and the Megatron-LM hooks), and the loop, optimizer, data, evaluation, checkpoints and logging each by a
section below. A field's name is its flag's dest, so `--lr-warmup-iters` is `optim.lr_warmup_iters`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from megatron_csbp.layout.sizes import layout_kind
from megatron_csbp.config.options import all_options


def _take(cls, run, **overrides):
    """`cls` with every field copied from the resolved value of the same name (`run`: a `Resolved`)."""
    values = {f.name: getattr(run, f.name) for f in fields(cls) if f.name not in overrides and hasattr(run, f.name)}
    return cls(**values, **overrides)


def extra(default=None):
    """A section field that is no option of the table (`tests/test_trainer_config.py`): what the flags
    derive, or an objective's flag."""
    return field(default=default, metadata={"extra": True})


@dataclass(frozen=True)
class ParallelConfig:
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    distributed_backend: Optional[str] = None
    block_parallel_size: int = 1
    world_size: int = extra(1)
    data_parallel_size: int = extra(1)
    virtual_pipeline_model_parallel_size: Optional[int] = extra()  # interleaved 1F1B (parallel/pipeline.py)

    def describe(self) -> str:
        pp, cp, bp = "", self.context_parallel_size, self.block_parallel_size
        if self.pipeline_model_parallel_size > 1:
            vp = self.virtual_pipeline_model_parallel_size
            pp = f" x PP {self.pipeline_model_parallel_size}" + (f" (VP {vp})" if vp else "")
        return (f"world {self.world_size} = TP {self.tensor_model_parallel_size}{pp} x CP {cp} / BP {bp} (layout "
                f"{layout_kind(cp, bp)}) x DP {self.data_parallel_size}")


@dataclass(frozen=True)
class BatchConfig:
    seq_length: int = 128
    micro_batch_size: int = 2
    global_batch_size: Optional[int] = None
    train_iters: Optional[int] = None
    skip_train: bool = False
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    exit_signal: str = "SIGTERM"
    num_microbatches: int = extra(1)


@dataclass(frozen=True)
class OptimConfig:
    bf16: bool = False
    fp16: bool = False
    lr: float = 0.003
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_warmup_fraction: Optional[float] = None
    lr_decay_iters: Optional[int] = None
    lr_decay_style: str = "linear"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-08
    clip_grad: float = 1.0
    loss_scale: Optional[float] = None
    grad_reduce_in_bf16: bool = False
    initial_loss_scale: float = 4294967296
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    check_for_nan_in_loss_and_grad: bool = True


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from; `build_datasets` reads these (and the objective's data needs)."""
    seq_length: int = 128
    global_batch_size: Optional[int] = None
    train_iters: Optional[int] = None
    seed: int = 1234
    num_workers: int = 0
    eval_iters: Optional[int] = None
    data_path: Optional[List[str]] = None
    split: str = "969,30,1"
    data_cache_path: Optional[str] = None
    sft_data_path: Optional[str] = None
    chat_template: str = "auto"
    sft_trajectory_turns: str = "record"
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    mock_data: bool = False
    pack_sequences: bool = False
    block_size: int = 16
    objective: str = "bd3lm"
    features_path: Optional[str] = extra()  # dflash's flags (objectives/dflash.py)
    eval_sequences: int = extra(0)


@dataclass(frozen=True)
class EvalConfig:
    eval_interval: Optional[int] = None
    eval_iters: Optional[int] = None


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    pretrained_checkpoint: Optional[str] = None
    save_interval: Optional[int] = None
    save_retain_interval: Optional[int] = None
    save_initial: bool = False
    ckpt_step: Optional[int] = None
    finetune: bool = False
    no_load_optim: bool = False
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    #: a converted checkpoint's ModelShape: its shape file and HF assets travel into every save
    model_shape: Any = extra()
    #: hyper-parameters saved beside the weights (`bdlm_meta.json`; generate rebuilds the model from them)
    model_meta: Optional[Dict[str, Any]] = extra()


@dataclass(frozen=True)
class LogConfig:
    log_interval: int = 10
    tensorboard_dir: Optional[str] = None
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    no_progress_bar: bool = False
    log_json: Optional[str] = None
    flags: Optional[Dict[str, Any]] = extra()  # the run's flags, logged as the wandb config


#: ModelArgs fields saved with a checkpoint (`bdlm_meta.json` "model_args"; format unchanged): the options
#: declared `saved` (the objectives' too), then the tokenizer's EOD
CHECKPOINT_MODEL_KEYS = (*(o.name for o in all_options() if o.saved), "eod_token_id")


def model_meta(run) -> Dict[str, Any]:
    """`bdlm_meta.json` "model_args": the saved flags (`run`: a `Resolved`), plus what they derive that a
    reader needs (the tokenizer's EOD; the padded vocabulary of a flag-built model, which depends on TP;
    the weights' dtype)."""
    from megatron_csbp.model.builder import padded_vocab_size

    meta = {k: getattr(run, k, None) for k in CHECKPOINT_MODEL_KEYS}
    from megatron_csbp.data.tokenizer import tokenizer_record

    meta.update(tokenizer_record(meta["tokenizer_type"], meta["tokenizer_model"]))  # found again by the export
    meta["params_dtype"] = ("bfloat16" if getattr(run, "bf16", False) else "float16" if getattr(run, "fp16", False)
                            else "float32")
    if getattr(run, "model_shape", None) is None and getattr(run, "vocab_size", None):
        meta["padded_vocab_size"] = padded_vocab_size(run.vocab_size, run.make_vocab_size_divisible_by,
                                                      run.tensor_model_parallel_size)
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
    def from_args(cls, run) -> "TrainerConfig":
        """From the flags `validate_args` checked and resolved (`run`: a `Resolved`)."""
        from megatron_csbp.training.arguments import model_args

        return cls(
            model=model_args(run),
            parallel=_take(ParallelConfig, run),
            batch=_take(BatchConfig, run),
            optim=_take(OptimConfig, run),
            data=_take(DataConfig, run),
            eval=_take(EvalConfig, run),
            checkpoint=_take(CheckpointConfig, run, model_meta=model_meta(run)),
            log=_take(LogConfig, run, wandb_save_dir=run.wandb_save_dir or (
                os.path.join(run.save, "wandb") if run.wandb_project else None),  # --save/wandb by default
                      flags={k: v for k, v in run.values().items()  # the flags and what they derive
                             if isinstance(v, (int, float, str, bool, type(None)))}),
        )
