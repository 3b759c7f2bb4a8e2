"""The trainer's one typed config: what `Trainer` reads, grouped by concern.

`TrainerConfig.from_args(args, facts)` takes the namespace `training.arguments.parse_args` validated
(every rule about the flags lives there and in the objective/layout objects it builds) and what the
flags derive (`RunFacts`), and copies them into frozen sections. From then on nothing reads the
namespace: the model is described by `ModelArgs` (the typed model config `training.model.build_model`
consumes, shared with generate and the Megatron-LM hooks), and the loop, optimizer, data, evaluation, checkpoints and logging each by a
section below. A field's name is its flag's dest, so `--lr-warmup-iters` is `optim.lr_warmup_iters`.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, fields, make_dataclass
from typing import Any, Dict, Optional

from megatron_csbp.layout.sizes import layout_kind, shard_group_size
from megatron_csbp.config.options import all_options, section_fields


def _source(args: argparse.Namespace, facts, name: str):
    """Where `name` lives: `facts` (what the flags derive: training.arguments.RunFacts) when it
    has it, else the namespace."""
    return facts if hasattr(facts, name) else args


def _take(cls, args: argparse.Namespace, facts=None, **overrides):
    """`cls` with every field copied from the attribute of the same name (`_source`)."""
    values = {f.name: getattr(_source(args, facts, f.name), f.name) for f in fields(cls)
              if f.name not in overrides and (hasattr(_source(args, facts, f.name), f.name) or f.default is MISSING)}
    values.update(overrides)
    return cls(**values)


def _section(name: str, section: str, *extra, **methods):
    """A frozen config section: the options declared for `section` (config/options.py), then the
    `extra` (name, type, default) fields the flags derive."""
    return make_dataclass(name, [*section_fields(section), *extra], frozen=True,
                          namespace=dict(methods, __module__=__name__))


def _describe(self) -> str:
    pp = ""
    if self.pipeline_model_parallel_size > 1:
        vp = self.virtual_pipeline_model_parallel_size
        pp = f" x PP {self.pipeline_model_parallel_size}" + (f" (VP {vp})" if vp else "")
    return (f"world {self.world_size} = TP {self.tensor_model_parallel_size}{pp} x CP {self.context_parallel_size} / "
            f"BP {self.block_parallel_size} (layout {self.layout}) x DP {self.data_parallel_size}")


ParallelConfig = _section(
    "ParallelConfig", "parallel", ("world_size", int, 1), ("data_parallel_size", int, 1),
    ("virtual_pipeline_model_parallel_size", Optional[int], None),  # interleaved 1F1B (megatron_csbp/parallel/pipeline.py)
    # ranks that hold one sequence: max(CP, BP) (Megatron's context-parallel axis)
    shard_group_size=property(lambda self: shard_group_size(self.context_parallel_size, self.block_parallel_size)),
    layout=property(lambda self: layout_kind(self.context_parallel_size, self.block_parallel_size)),
    describe=_describe)
BatchConfig = _section("BatchConfig", "batch", ("num_microbatches", int, 1))
OptimConfig = _section("OptimConfig", "optim")
#: where samples come from; `build_datasets` reads these (and the objective's data needs)
DataConfig = _section("DataConfig", "data", ("features_path", Optional[str], None), ("eval_sequences", int, 0))
EvalConfig = _section("EvalConfig", "eval")
CheckpointConfig = _section(
    "CheckpointConfig", "checkpoint",
    # a converted checkpoint's ModelShape: its shape file and HF assets travel into every save
    ("model_shape", Any, None),
    # hyper-parameters saved beside the weights (`bdlm_meta.json`; generate rebuilds the model from them)
    ("model_meta", Any, None))
LogConfig = _section("LogConfig", "log", ("flags", Any, None))  # the run's flags, logged as the wandb config


#: ModelArgs fields saved with a checkpoint (`bdlm_meta.json` "model_args"; format unchanged): the options
#: declared `saved` (the objectives' too), then the tokenizer's EOD
CHECKPOINT_MODEL_KEYS = (*(o.name for o in all_options() if o.saved), "eod_token_id")


def model_meta(args: argparse.Namespace, facts=None) -> Dict[str, Any]:
    """`bdlm_meta.json` "model_args": the saved flags, plus what they derive that a reader needs
    (`facts`: the tokenizer's EOD; the padded vocabulary of a flag-built model, which depends on TP;
    the weights' dtype)."""
    from megatron_csbp.model.builder import padded_vocab_size

    meta = {k: getattr(_source(args, facts, k), k, None) for k in CHECKPOINT_MODEL_KEYS}
    from megatron_csbp.data.tokenizer import tokenizer_record

    meta.update(tokenizer_record(meta["tokenizer_type"], meta["tokenizer_model"]))  # found again by the export
    meta["params_dtype"] = ("bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False)
                            else "float32")
    if getattr(facts, "model_shape", None) is None and getattr(args, "vocab_size", None):
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
    def from_args(cls, args: argparse.Namespace, facts) -> "TrainerConfig":
        """From a namespace `validate_args` has checked and what it derived (`facts`: RunFacts, the sizes
        and the checkpoint's shape)."""
        from megatron_csbp.training.arguments import model_args

        return cls(
            model=model_args(args, facts),
            parallel=_take(ParallelConfig, args, facts),
            batch=_take(BatchConfig, args, facts),
            optim=_take(OptimConfig, args),
            data=_take(DataConfig, args),
            eval=_take(EvalConfig, args),
            checkpoint=_take(CheckpointConfig, args, facts, model_meta=model_meta(args, facts)),
            log=_take(LogConfig, args, wandb_save_dir=args.wandb_save_dir or (
                os.path.join(args.save, "wandb") if args.wandb_project else None),  # --save/wandb by default
                      flags={k: v for k, v in {**vars(args), **vars(facts), **facts.objective_facts}.items()
                             if isinstance(v, (int, float, str, bool, type(None)))}),  # the flags and what they derive
        )
