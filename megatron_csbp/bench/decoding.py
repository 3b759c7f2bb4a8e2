"""BD3-LM decoding speed with and without the clean-prefix KV cache:

    python -m megatron_csbp.bench.decoding --load runs/default/checkpoints [--output docs/benchmarks/generation.md]

For each decoding mode (`--steps-per-block` = B, one token per forward; Fast-dLLM `--threshold`)
and each prompt, decodes `--max-new-tokens` with the cache and without it (same seed), checks the
tokens are the same, and reports generated tokens per second (wall clock, one process), forward
calls and tokens per forward. Without the cache a step runs [B noisy rows ; whole clean prefix];
with it, B rows (plus each finished block once as clean rows).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, Sequence

import torch

from megatron_csbp.checkpoint.model import load_for_generation
from megatron_csbp.generation.bd3lm import BlockDiffusionSampler

PROMPTS = ("The for statement", "A class definition", "The import statement", "Exceptions are raised")
#: (name, sampler options, temperature: None = --temperature)
MODES = (("one token per step (random order)", dict(order="random"), None),
         ("one token per step (confidence order), temperature 0", dict(order="confidence"), 0.0),
         ("--threshold 0.9, temperature 0", dict(threshold=0.9), 0.0),
         ("--threshold 0.1, temperature 0", dict(threshold=0.1), 0.0))
#: timings: the best of this many repeats (a shared machine's noise only slows a run down)
REPEATS = 2


def run(load: str, max_new_tokens: int, temperature: float, seed: int):
    from megatron_csbp.data.megatron_data import saved_tokenizer

    model, margs, step = load_for_generation(load)
    tok = saved_tokenizer(margs.get("tokenizer_type"), margs.get("tokenizer_model"), margs.get("vocab_size"))
    rows = []
    for i, (name, kw, mode_temperature) in enumerate(MODES, 1):
        print(f"[decoding] mode {i}/{len(MODES)}: {name}, {len(PROMPTS)} prompts with and without the KV cache",
              file=sys.stderr, flush=True)
        t = temperature if mode_temperature is None else mode_temperature
        out, stats = {}, {}
        for cache in (True, False):
            s = BlockDiffusionSampler(model, margs["vocab_size"], margs["mask_token_id"], tok.eod,
                                      margs["block_size"], use_cache=cache)
            best = None
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                s.forward_calls = 0
                out[cache] = [s.generate(tok.tokenize(prompt), max_new_tokens, temperature=t, seed=seed,
                                         max_length=margs["seq_length"], **kw) for prompt in PROMPTS]
                best = min(best or 1e9, time.perf_counter() - t0)
            stats[cache] = (sum(map(len, out[cache])), best, s.forward_calls)
        same = out[True] == out[False]
        if not same:
            raise AssertionError(f"{name}: decoding with the KV cache gave other tokens than without it")
        (n, t_c, f_c), (_, t_n, f_n) = stats[True], stats[False]
        rows.append((name, n, n / t_c, f_c, n / t_n, f_n, t_n / t_c, same))
    return rows, step, margs


def table(rows, load: str, step: int, margs, max_new_tokens: int, temperature: float) -> str:
    lines = [f"BD3-LM decoding, `{load}` (iteration {step}; {margs.get('num_layers')} layers, hidden "
             f"{margs.get('hidden_size')}, block {margs['block_size']}), {len(PROMPTS)} prompts x up to "
             f"{max_new_tokens} new tokens (stopping at EOD), temperature {temperature} unless the mode says, one "
             f"process, {torch.get_num_threads()} thread(s), best of {REPEATS}, `python -m megatron_csbp.bench.decoding`. "
             "Forwards count the clean-prefix forwards of the cache too (one per finished block).",
             "",
             "| mode | tokens | tokens/s with cache | forwards | tokens/s without cache | forwards | speed-up | same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {name} | {n} | {tc:.1f} | {fc} | {tn:.1f} | {fn} | {speed:.2f}x | {'yes' if same else 'NO'} |"
              for name, n, tc, fc, tn, fn, speed, same in rows]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> str:
    from megatron_csbp.bench.report import bench_parser, write_file

    p = bench_parser("decoding", __doc__, raw=True)
    p.add_argument("--load", required=True)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output", default=None, help="also write the table (markdown) here")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    rows, step, margs = run(a.load, a.max_new_tokens, a.temperature, a.seed)
    text = table(rows, a.load, step, margs, a.max_new_tokens, a.temperature)
    print(text)
    write_file(a.output, "# Generation benchmark\n\n" + text)
    return text


if __name__ == "__main__":  # utils.cli.run under another name: this module's run() stays what main calls
    from megatron_csbp.utils.cli import run as run_cli

    sys.exit(run_cli(main))
