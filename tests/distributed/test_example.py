"""examples/distributed_sfr.py under ``torchrun`` with 2 gloo processes (slow: two fresh interpreters)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_example_runs_under_torchrun_and_ranks_agree():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "examples" / "distributed_sfr.py"), "--num-train", "200", "--epochs", "30",
               "--num-inducing", "16"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checksums = re.findall(r"rank (\d)/2: \d+ of 200 points here, statistics checksum (\S+)", done.stdout)
    assert sorted(r for r, _ in checksums) == ["0", "1"]
    assert len({c for _, c in checksums}) == 1
    assert "backend gloo, 2 rank(s)" in done.stdout
