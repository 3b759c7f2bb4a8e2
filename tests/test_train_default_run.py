"""The default run (`torchrun --nproc-per-node 2 -m megatron_csbp.train`, no flags): a short version
in the default suite (MEGATRON_CSBP_DEMO_ITERS=30: the same model, data and layout, 6 evaluations),
the full 600-iteration run under -m slow with the README's claims (held-out NELBO evaluated 6
times, falling at every evaluation, ending <= 4.8 nats/token), run as README.md writes it, followed
by README.md's `generate` command, whose output must be README.md's block byte for byte (the run and
the sampling are deterministic)."""
import json
import os
import shlex
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
GENERATE_INTRO = "After the default run, the last command prints"


def readme_commands():
    """(the default run's command, the `generate` command, the text README.md says it prints)."""
    text = open(README).read()
    block = text[text.index("## Training with block parallelism"):]
    block = block[block.index("```bash\n") + 8:]
    lines = block[:block.index("```")].splitlines()
    train = next(ln for ln in lines if ln.startswith("torchrun --nproc-per-node 2 -m megatron_csbp.train "))
    generate = next(ln for ln in lines if ln.startswith("python -m megatron_csbp.generate "))
    shown = text[text.index(GENERATE_INTRO):]
    shown = shown[shown.index("```\n") + 4:]
    return train.split("#")[0].strip(), generate, shown[:shown.index("```\n")]


def run_default(tmp_path, iters=None, readme=False):
    """The default run; `readme`: exactly README.md's command, in `tmp_path` (output runs/default)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not readme:
        env["MEGATRON_CSBP_DEMO_DIR"] = str(tmp_path / "runs")
    if iters is not None:
        env["MEGATRON_CSBP_DEMO_ITERS"] = str(iters)
    cmd = shlex.split(readme_commands()[0]) if readme else ["torchrun", "--nproc-per-node", "2", "-m",
                                                             "megatron_csbp.train"]
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res, tmp_path / "runs" / ("default" if readme else "")


def check_run(res, run, iters):
    for name in ("loss_curve.png", "log.jsonl", "summary.json", "sample.txt", "command.txt"):
        assert (run / name).exists(), name
    ckpt = run / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(iters)
    assert (ckpt / "iter_0000000").is_dir()  # the untrained weights, for the comparison sample
    assert "layout csbp" in res.stdout and "ETA:" in res.stdout
    summary = json.loads((run / "summary.json").read_text())
    evals = [v for _, v in sorted(summary["eval_losses"].items(), key=lambda kv: int(kv[0]))]
    assert len(evals) >= 6, evals
    # The same held-out batches and noise at every evaluation: only the model changes.
    assert all(b < a for a, b in zip(evals, evals[1:])), evals
    sample = (run / "sample.txt").read_text()
    assert "untrained (iteration 0)" in sample and f"trained (iteration {iters})" in sample
    assert sample.count("The for statement is used to") == 3  # command line + two samples
    return evals


def test_default_run_short(tmp_path):
    res, run = run_default(tmp_path, iters=30)
    evals = check_run(res, run, 30)
    assert evals[-1] < evals[0] - 0.5, evals


def test_readme_commands_parse():
    """The commands and the block the slow test runs and compares are where it looks for them."""
    train, generate, shown = readme_commands()
    assert train == "torchrun --nproc-per-node 2 -m megatron_csbp.train"
    assert "--load runs/default/checkpoints" in generate
    assert shown.startswith("[checkpoint runs/default/checkpoints iteration 600; ") and shown.endswith("\n")


@pytest.mark.quick
def test_readme_opens_with_its_title_then_the_two_commands():
    """Issue 41: the README opened with a code block above its title. The title, a short "what it is", then
    the first code block: the install-and-train line and the test command (.ci/run runs "the README's test
    command"), and the quick tier named beside it."""
    text = open(README).read()
    assert text.startswith("# megatron-csbp\n\nA megatron-core plugin that trains block diffusion language models")
    head = text[:text.index("```bash\n")]
    assert head.count("\n\n") == 2 and "```" not in head and "\n#" not in head[1:]  # title, one paragraph
    block = text[len(head) + 8:]
    assert block[:block.index("```")].splitlines()[-1] == "python -m pytest -q"
    assert "`python -m pytest -q -m quick`" in text[:text.index("## ")]


@pytest.mark.slow
def test_default_run_full(tmp_path):
    """README.md's commands as written, from a fresh folder: the run's claims, then `generate`
    prints exactly README.md's block."""
    res, run = run_default(tmp_path, readme=True)
    evals = check_run(res, run, 600)
    print("held-out NELBO:", evals)
    assert evals[-1] <= 4.8, evals
    _, generate, shown = readme_commands()
    argv = shlex.split(generate)
    assert argv[:3] == ["python", "-m", "megatron_csbp.generate"]
    out = subprocess.run([sys.executable] + argv[1:], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == shown, f"README.md shows:\n{shown}\ngenerate printed:\n{out.stdout}"
