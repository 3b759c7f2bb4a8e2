"""No test binds a fixed port: two test sessions on one machine (a developer's and CI's) would meet on
it (issue 41: 4 of the 10 Megatron-LM tests failed that way). Ranks spawned by tests/distributed.py
take a free port (retried on a collision), every torchrun a test starts is --standalone (tests/conftest.py)."""
import os
import re

import pytest

pytestmark = pytest.mark.quick

TESTS = os.path.dirname(os.path.abspath(__file__))
#: a port given as a literal: --master-port N, MASTER_PORT=N / "N", master_port: N, port + N, or torch's 29xxx
FIXED = re.compile(r"(?i)(master[-_]?port\W{0,8}\d|\bport\s*[+]\s*\d|\b29\d{3}\b)")
#: (file, line text) that name a port without binding it, with the reason
ALLOWED = {("test_launch.py", "--rdzv-endpoint $head_node_ip:29500"): "the text of an sbatch script for a cluster"}


def _sources():
    for root, _, names in os.walk(TESTS):
        for name in names:
            if name.endswith((".py", ".sh")) and name != os.path.basename(__file__):
                yield os.path.join(root, name)


def test_no_fixed_port_in_the_tests():
    found = []
    for path in _sources():
        with open(path) as f:
            for no, line in enumerate(f, 1):
                if FIXED.search(line) and not any(os.path.basename(path) == name and text in line
                                                  for name, text in ALLOWED):
                    found.append(f"{os.path.relpath(path, TESTS)}:{no}: {line.strip()}")
    assert not found, "fixed ports (use a free one: megatron_csbp.parallel.spawn.free_port, torchrun --standalone):\n" \
        + "\n".join(found)


def test_every_torchrun_of_the_tests_is_standalone():
    assert os.environ.get("PET_STANDALONE") == "1"  # tests/conftest.py; torchrun reads it as --standalone
