"""`python -m megatron_csbp.train --help` (issue 41: 501 lines, --seq-length, --lr, --save, --load without a
word): every flag has a help text and its default, in Megatron-LM's groups (the titles and membership of the
installed Megatron-LM tag's own parser), under a one-line usage."""
import os
import subprocess
import sys

import pytest

from megatron_csbp.config.options import GROUPS, OPTIONS
from megatron_csbp.training.arguments import build_parser
from megatron_csbp.utils.megatron_lm_path import find, missing_message

#: Megatron-LM's group titles that moved between its tags (core_v0.19.0's name -> core_v0.16.1's)
RENAMED = {"distributed init": "distributed"}


@pytest.mark.quick
def test_every_flag_has_help_and_its_default(capsys):
    assert all(o.help and o.help.strip() for o in OPTIONS), [o.flag for o in OPTIONS if not o.help]
    assert all(o.off_help for o in OPTIONS if o.off), [o.off for o in OPTIONS if o.off and not o.off_help]
    parser = build_parser()
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert [a.option_strings for a in actions if not (a.help or "").strip()] == []  # the objectives' flags too
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    assert text.splitlines()[0] == ("usage: torchrun --nproc-per-node N -m megatron_csbp.train [Megatron-LM flags] "
                                    "[block-diffusion flags]")
    entries = {}  # flag -> its help entry (the flag's lines up to the next flag)
    for line in text.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif line.startswith("    ") and entries:
            entries[flag] += " " + line.strip()
    for flag in ("--seq-length", "--lr", "--save", "--load"):
        assert entries[flag].split(None, 2)[2].strip(), entries[flag]
    for a in actions:
        assert "default" in " ".join(entries[a.option_strings[0]].split()), entries[a.option_strings[0]]
    assert "--lr X                peak learning rate (default: 0.003)" in text


@pytest.mark.skipif(not find(), reason=missing_message())
def test_groups_are_megatron_lm_s():
    code = ("import argparse, sys\nsys.argv = ['x']\nimport megatron.training.arguments as A\n"
            "p = argparse.ArgumentParser(conflict_handler='resolve')\n"
            "for n in dir(A):\n    if n.startswith('_add_') and n.endswith('_args'): getattr(A, n)(p)\n"
            "for g in p._action_groups:\n    for a in g._group_actions:\n"
            "        for s in a.option_strings: print(g.title + '|' + s)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=find(), capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=find()))
    assert out.returncode == 0, out.stderr[-3000:]
    megatron = {}
    for line in out.stdout.splitlines():
        if "|" in line:
            title, flag = line.rsplit("|", 1)
            megatron.setdefault(flag, RENAMED.get(title, title))
    theirs = [o for o in OPTIONS if o.group != "bd" and any(f in megatron for f in o.flags + (o.off,))]
    assert len(theirs) > 100
    assert {o.flag: GROUPS[o.group] for o in theirs} == {
        o.flag: next(megatron[f] for f in o.flags + (o.off,) if f in megatron) for o in theirs}
    parser = build_parser()
    assert [g.title for g in parser._action_groups][2:] == list(GROUPS.values())  # after argparse's two
