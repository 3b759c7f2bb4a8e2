"""The package's size in code lines (issue 42): lines that hold code, not blank, not comment-only,
not inside a module, class or function docstring. Prose lives in docs/, so moving it there does not
count; this measures what a maintainer reads to change behaviour.

Issue 42's goal is 16,000 code lines. The package is not there yet: `CEILING` is its size when the
model contract landed, and only goes down (a change that adds code removes as much elsewhere, or says
in its commit why the ceiling moves)."""
import ast
import io
import pathlib
import tokenize

PKG = pathlib.Path(__file__).resolve().parent.parent / "megatron_csbp"
GOAL = 16_000  # issue 42
CEILING = 17_609  # 18,112 after the model contract; +1,221 for LoRA, +1 planner import of OWNERSHIP_SCHEDULES, -7 one generation model builder (issue 44: lora/ 11 modules, its planner model, benchmark, PEFT conversion, LoRA checkpoints); round 25: +129 canonical LoRA targets (separate q/k/v, gate/up adapters: PEFT import of HF adapters), +105 LoRA on grouped experts (lora/grouped.py), +49 pretrain()'s adapter-only checkpoints, -37 derived lists and repeats removed (PRINTED*, LOADED_FIELDS, compat.replace_once, bench flags()), +8 the test ranks' fork server (parallel.spawn); round 26: -1,188 (seven folders rewritten shorter, one draw by global name for base weights and adapters, +grouped-expert redraw, +pretrain() LoRA record before the tracker); round 27: -489 (structural cuts in every folder, code tokens -2.3%; pretrain()'s model provider uses the trainer's layer spec), +3 one --moe-layer-freq pattern helper for three places and the refusal of an int below 1 (a ZeroDivisionError before); round 28: -301 (a third structural pass over every folder, code tokens -1.3%: library calls for hand code such as megatron-core's RNG tracker and TP copy, transformers' DiffusionGemma steps, compat.replace_once for the Megatron-LM hooks); lower it as code goes

SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in SKIP:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def test_the_counter_counts_code_only():
    src = '"""doc\n\nmore"""\n# comment\n\nx = (1,\n     2)  # trailing\n\n\ndef f():\n    """doc"""\n    return x\n'
    assert code_lines(src) == 4  # x = (1, / 2) / def f(): / return x


def test_package_stays_under_its_ceiling():
    sizes = {str(p.relative_to(PKG)): code_lines(p.read_text()) for p in PKG.rglob("*.py")}
    total = sum(sizes.values())
    largest = ", ".join(f"{k} {v}" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:5])
    assert total <= CEILING, (f"megatron_csbp/ has {total} code lines, over the ceiling {CEILING} (goal {GOAL}); "
                              f"largest: {largest}")
