"""CI's own rules (.ci/run, .ci/summary.py): a missing Megatron-LM checkout fails CI before anything
is installed, and the summary counts every skip by reason and fails on a skipped Megatron-LM test."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ci_fails_loudly_without_a_megatron_lm_checkout(tmp_path):
    env = dict(os.environ, MEGATRON_LM_CACHE=str(tmp_path / "none"), MEGATRON_LM_PATH="",
               PYTHON="false")  # nothing after the check may run: `false` as the Python would fail anyway
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert f"*** CI FAILURE: no Megatron-LM checkout in {tmp_path / 'none'}" in proc.stderr
    assert "core_v0.16.1" in proc.stderr and "MEGATRON_LM_OPTIONAL=1" in proc.stderr
    assert proc.stdout == ""  # failed first: no install, no tests


def _fake_megatron_lm(path):
    (path / "megatron" / "training").mkdir(parents=True)
    (path / "pretrain_gpt.py").write_text("")
    return str(path)


def test_ci_fails_loudly_without_the_megatron_lm_checkout_of_the_python_312_stack(tmp_path):
    env = dict(os.environ, MEGATRON_LM_CACHE=_fake_megatron_lm(tmp_path / "v016"), MEGATRON_LM_PATH="",
               MEGATRON_LM_CACHE_312=str(tmp_path / "none"), MEGATRON_LM_PATH_312="", PYTHON="false")
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert f"*** CI FAILURE: no Megatron-LM checkout in {tmp_path / 'none'}" in proc.stderr
    assert "archive core_v0.19.0 megatron/training" in proc.stderr and "megatron/legacy" not in proc.stderr
    assert proc.stdout == ""  # failed first: no install, no tests


def test_ci_fails_loudly_without_python_312(tmp_path):
    env = dict(os.environ, MEGATRON_LM_CACHE=_fake_megatron_lm(tmp_path / "v016"), MEGATRON_LM_PATH="",
               MEGATRON_LM_CACHE_312=_fake_megatron_lm(tmp_path / "v019"), MEGATRON_LM_PATH_312="",
               PYTHON_312=str(tmp_path / "no_python"), PYTHON="false")
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"*** CI FAILURE: no Python 3.12 at {tmp_path / 'no_python'} (pyenv install 3.12.1, "
                                   "or set PYTHON_312)")
    assert proc.stdout == ""


def test_summary_counts_skips_by_reason_and_fails_on_a_skipped_integration_test(tmp_path):
    d = tmp_path / "tests"
    d.mkdir()
    (d / "test_megatron_lm_x.py").write_text(
        "import pytest\n@pytest.mark.skip(reason='set MEGATRON_LM_PATH')\ndef test_a():\n    pass\n")
    (d / "test_other.py").write_text(
        "import pytest\ndef test_ok():\n    pass\n"
        "@pytest.mark.parametrize('i', [1, 2])\ndef test_te(i):\n    pytest.skip('transformer-engine not installed')\n")
    xml = tmp_path / "r.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
                    f"--rootdir={tmp_path}", f"--junitxml={xml}", str(d)], cwd=tmp_path, capture_output=True,
                   timeout=120)
    summary = [sys.executable, os.path.join(ROOT, ".ci", "summary.py"), str(xml), "--label", "default suite"]
    proc = subprocess.run(summary, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "CI summary (default suite): 4 tests: 1 passed, 0 failed, 0 errors, 3 skipped"
    assert lines[1].startswith("  skipped 2 x ") and "transformer-engine not installed" in lines[1]
    assert lines[2].startswith("  skipped 1 x ") and "set MEGATRON_LM_PATH" in lines[2]
    proc = subprocess.run(summary + ["--fail-on-skip", "test_megatron_lm_"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "CI FAILURE: 1 test(s) that CI must run were skipped: tests.test_megatron_lm_x::test_a" in proc.stderr
