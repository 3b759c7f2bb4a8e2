"""The Megatron-LM lookup (megatron_csbp/utils/megatron_lm_path.py): the tests and
examples/megatron_lm/pretrain_bdlm.py find the cache directory of docs/megatron-lm.md for the installed
megatron-core without an environment variable; MEGATRON_LM_PATH overrides; when nothing is found one
line says how to get it. No Megatron-LM needed (the directories are built here)."""
import os
import subprocess
import sys

import pytest

from megatron_csbp.utils import megatron_lm_path as lookup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_checkout(path):
    os.makedirs(os.path.join(path, "megatron", "training"))
    open(os.path.join(path, "megatron", "training", "__init__.py"), "w").close()
    open(os.path.join(path, "pretrain_gpt.py"), "w").close()
    return str(path)


def test_tag_of_each_megatron_core_version():
    assert lookup.tag_for("0.16.1") == "core_v0.16.1"
    assert lookup.tag_for("0.19.2") == lookup.tag_for("0.19.0") == "core_v0.19.0"  # no core_v0.19.2 tag
    assert lookup.tag_for("0.21.0") == "core_v0.21.0"
    assert "megatron/legacy" in lookup.archive_paths("core_v0.16.1")
    assert "megatron/legacy" not in lookup.archive_paths("core_v0.19.0")  # the tag has none


def test_cache_found_without_variable_and_variable_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MEGATRON_LM_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    version = lookup.megatron_core_version()
    cache = tmp_path / ".cache" / "megatron-csbp" / f"megatron-lm-{lookup.tag_for(version)}"
    assert lookup.find() is None
    line = lookup.missing_message()
    assert "\n" not in line and f"archive {lookup.tag_for(version)} " in line and str(cache) in line
    fake_checkout(cache)
    assert lookup.find() == str(cache) == lookup.find(cwd=True)
    here = fake_checkout(tmp_path / "clone")
    monkeypatch.chdir(here)
    assert lookup.find(cwd=True) == here and lookup.find() == str(cache)  # the script's cwd checkout first
    other = fake_checkout(tmp_path / "other")
    monkeypatch.setenv("MEGATRON_LM_PATH", other)
    assert lookup.find() == lookup.find(cwd=True) == other
    monkeypatch.setenv("MEGATRON_LM_PATH", str(tmp_path / "nothing"))
    assert lookup.find() is None and "MEGATRON_LM_PATH=" in lookup.missing_message()


def test_script_says_how_to_get_megatron_lm_in_one_line(tmp_path):
    """Before: `ModuleNotFoundError: No module named 'megatron.training'` (issue 34)."""
    env = dict(os.environ, HOME=str(tmp_path), PYTHONPATH=ROOT)
    env.pop("MEGATRON_LM_PATH", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "megatron_lm", "pretrain_bdlm.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: Megatron-LM's training package for megatron-core ")
    assert proc.stderr.count("\n") == 1 and "git -C /tmp/Megatron-LM archive core_v" in proc.stderr
    cli = subprocess.run([sys.executable, "-m", "megatron_csbp.utils.megatron_lm_path"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1 and cli.stderr == proc.stderr
