"""What an objective gives the model: the noisy stream, per-row targets and weights, a denominator.

Noise depends only on (seed, the sample's global index): every rank of a model replica draws the
same noise for the same sample, so the loss does not depend on the parallel layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

import torch

from megatron_csbp.data.megatron_data import sample_generator  # noqa: F401  (objectives draw with it)
from megatron_csbp.objectives.flags import check_mask_token_id, check_noise_interval, option_values
from megatron_csbp.utils.option import Option


@dataclass
class NoisedBatch:
    noisy_tokens: torch.Tensor  # [b, L] ids fed to the noisy rows
    targets: torch.Tensor  # [b, L] target id of each noisy row, -100 where the row is no target
    weights: torch.Tensor  # [b, L] float32 loss weight of each noisy row (0 where no target)
    # Objectives that expand the batch (e.g. complementary views) give the clean stream of each
    # returned row; None means the input tokens.
    clean_tokens: Optional[torch.Tensor] = None
    # Objectives with a loss on the clean stream (DiffusionGemma's AR term): target of clean row p
    # (-100 where none) and its weight, [b, L]; `BlockDiffusionModel` then sends the clean rows
    # that carry a target (on the rank that counts them) through the output layer too.
    clean_targets: Optional[torch.Tensor] = None
    clean_weights: Optional[torch.Tensor] = None
    #: [b] bool: the sample gets a self-conditioning first pass (None: the objective has none)
    self_conditioning: Optional[torch.Tensor] = None
    #: first block with a noisy copy (canvas of response blocks); None: every block
    first_canvas_block: Optional[int] = None


@dataclass(frozen=True)
class ObjectiveInputs:
    """What an objective read from its own files (`Objective.prepare_args`; the resolved run carries it):
    `flags`, the flags they fix (dest -> value: the trainer resolves those flags to them), and
    `facts`, what else its registered chunk builder reads (carried into ModelArgs)."""
    flags: Mapping[str, Any] = field(default_factory=dict)
    facts: Mapping[str, Any] = field(default_factory=dict)


def block_times(num_blocks: int, generator: torch.Generator, eps_min: float, eps_max: float,
                antithetic: bool = True) -> torch.Tensor:
    """[num_blocks] float64 times in [eps_min, eps_max]: antithetic, t_i = (u + i / num_blocks) mod 1
    from one uniform u, or independent uniforms."""
    if antithetic:
        u = torch.rand(1, generator=generator, dtype=torch.float64)
        t = torch.remainder(u + torch.arange(num_blocks, dtype=torch.float64) / max(num_blocks, 1), 1.0)
    else:
        t = torch.rand(num_blocks, generator=generator, dtype=torch.float64)
    return eps_min + (eps_max - eps_min) * t


def next_token_targets(tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[b, L] targets of a token shift: row p -> token p + 1 where `keep` [b, L - 1] holds, else -100."""
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = torch.where(keep, tokens[:, 1:], targets[:, :-1])
    return targets


class Objective:
    """Base class. A subclass is registered by name (`registry.register_objective`) and owns everything
    the trainer needs to know about it: flags and rules, rows, mask-token needs, model wrapper or
    builder, data, FLOPs terms, evaluation, Megatron-LM refusal (the list:
    docs/training.md#objectives-one-registry). Subclasses implement `noise` (and `__init__` and
    `from_args` unless they are built from the block size, mask id, seed and `options`).
    """

    name = "base"
    #: this objective's entry in `--objective`'s help (None: none)
    summary: Optional[str] = None
    #: the flags it reads (`Option`s: its own and shared ones), in the order they appear in --help
    flags: Tuple[Option, ...] = ()
    #: constructor keyword (and attribute) -> the flag that sets it (`option_values` reads and checks them)
    options: Mapping[str, Option] = {}
    #: False for plain next-token training: the model sees the clean stream only
    uses_noisy_stream = True
    #: batch rows the objective makes of one sample (Fast-dLLM v2's two complementary views: 2)
    views = 1
    #: the row at position p predicts token p + target_shift (AR, Fast-dLLM v2: 1); the loss mask
    #: is indexed by target token. --eod-mask-loss drops the targets of rows that read an EOD
    #: (Megatron's rule, `layout.packing.Packing.loss_mask`)
    target_shift = 0
    #: exclude the mask token's logit from the softmax (absorbing-state MDLM losses)
    exclude_mask_from_softmax = False
    mask_token_id = None
    #: the loss has terms on clean rows (`NoisedBatch.clean_targets`); layouts then assign every
    #: clean row's term to one rank (`SequenceLayout.clean_loss`)
    needs_clean_logits = False
    #: the rows of a micro-batch are fixed by the layout (False: canvas plans vary them; pipeline
    #: P2P then exchanges shapes first, megatron_csbp/parallel/pipeline.py)
    fixed_rows = True
    #: "--mask-token-id (why)": the objective needs a mask id (None: it uses none)
    mask_token_needed: Optional[str] = None
    #: an unset --mask-token-id takes the tokenizer's <mask>
    mask_from_tokenizer = False
    #: why the Megatron-LM hooks cannot train it (None: they can)
    megatron_lm_refusal: Optional[str] = None
    #: --load may hold a DFlash drafter: the trainer passes its shape to `prepare_args`
    loads_drafter = False
    #: "adapts ... (why)": it needs a --load checkpoint to start from (None: it trains from scratch too)
    needs_pretrained: Optional[str] = None

    #: `noise` takes the micro-batch's `document_ids` (packed SFT) as a keyword
    reads_documents = False

    def __init__(self, block_size: int, mask_token_id: int, seed: int = 1234, **options):
        """`options`: the keywords of `options` (their flags' defaults when not given)."""
        vars(self).update(self.option_values(**options))
        self.check_mask(mask_token_id)
        self.block_size, self.mask_token_id, self.seed = int(block_size), int(mask_token_id), seed

    # ---- flags and rules ------------------------------------------------------------------------
    @classmethod
    def prepare_args(cls, args, defaults, check_only: bool, notes: list, drafter=None) -> ObjectiveInputs:
        """Before the trainer's rules, what the objective's own inputs fix (DFlash: the captured
        features, the verifier, `drafter`: the --load drafter's `DrafterShape` when `loads_drafter`).
        `args` is read only; `defaults`: dest -> the trainer options' declared default (config/options.py,
        a layer above this one); `notes`: launch --check's list of the rules skipped."""
        return ObjectiveInputs()

    @classmethod
    def validate(cls, args, facts=None) -> None:
        """The rules on this objective's flags that need no tokenizer (ValueError naming the flag);
        `facts`: what the trainer's flags derive (training.arguments.Resolved; None in the Megatron-LM hooks)."""
        cls.option_values(args)

    @classmethod
    def option_values(cls, args=None, **given) -> dict:
        """keyword -> value of `options`, from the flags `args` or the constructor's keywords `given`
        (`flags.option_values`: each checked by its flag), and the noise interval when it reads one."""
        values = option_values(cls.options, args, **given)
        if "eps_min" in values:
            check_noise_interval(values["eps_min"], values["eps_max"])
        return values

    @classmethod
    def from_args(cls, args) -> "Objective":
        return cls(args.block_size, args.mask_token_id, seed=args.seed, **cls.option_values(args))

    @classmethod
    def check_mask(cls, mask_token_id: Optional[int], vocab_size: Optional[int] = None) -> None:
        """A given mask id lies in the vocabulary; an objective that needs one refuses None."""
        needed = f"--objective {cls.name} needs {cls.mask_token_needed}" if cls.mask_token_needed else None
        check_mask_token_id(mask_token_id, vocab_size, needed)

    def check_vocab(self, vocab_size: int) -> None:
        self.check_mask(self.mask_token_id, vocab_size)

    # ---- what the model and the trainer get ---------------------------------------------------
    def noise(self, tokens: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor) -> NoisedBatch:
        raise NotImplementedError

    def num_blocks(self, seq_length: int) -> int:
        """Blocks of `self.block_size` in a sequence; partial blocks are refused (BlockGeometry's rule)."""
        from megatron_csbp.layout.masks import BlockGeometry
        return BlockGeometry(seq_length, self.block_size).num_blocks

    def denominator(self, loss_mask: torch.Tensor, tokens=None, document_ids=None) -> torch.Tensor:
        """This micro-batch's share of the loss denominator (summed over the global batch): a
        scalar, or [noisy rows', clean rows'] for an objective whose two terms have their own.
        Default: the supervised target tokens (with a token shift, those from position 1 on)."""
        return loss_mask[:, self.target_shift:].sum().to(torch.float32)

    def for_evaluation(self) -> "Objective":
        """The objective held-out losses use (default: this one)."""
        return self

    @classmethod
    def build_datasets(cls, args):
        """(train, valid) datasets: --mock-data, --sft-data-path (prompt/response pairs) or
        --data-path (pretraining tokens)."""
        from megatron_csbp.objectives import data

        if args.mock_data:
            return data.mock_datasets(args)
        if args.sft_data_path:
            return data.sft_datasets(args)
        return data.token_datasets(args)

    # ---- FLOPs terms ----------------------------------------------------------------------------
    @classmethod
    def rows_per_sample(cls, seq_length: int) -> int:
        """Model rows of one sample: views x [noisy ; clean] (2L) or the clean stream only (L)."""
        return cls.views * (2 if cls.uses_noisy_stream else 1) * seq_length

    @classmethod
    def attention_pairs(cls, seq_length: int, block_size: int, clean_attention: str) -> int:
        """Allowed query-key pairs of one view of one sample: L*(L+B) for block-causal BD3-LM
        (each noisy query sees the clean prefix before its block and its own block)."""
        from megatron_csbp.layout.masks import BlockGeometry, clean_key_interval, logical_rows

        g = BlockGeometry(seq_length, block_size, clean_attention)
        lo, hi = clean_key_interval(logical_rows(seq_length), g)
        return int((hi - lo).clamp_min(0).sum()) + seq_length * block_size  # + each noisy query's own block
