"""``benchmarks/gpu_scale.py`` (the GPU figures of issue 11) runs end to end at its ``--small`` sizes on the CPU, so
that the prepared GPU checks (``scripts/gpu_checks.sh``) do not first break on a GPU machine."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_scale_small_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_scale.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_scale.py"), "--small", "--device", "cpu",
                    "--json", str(out)], check=True, cwd=REPO, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    cases = {(r["coupling"], r["statistics"]): r for r in report["sfr"]}
    assert set(cases) == {("independent", None), ("joint", "per_group"), ("joint", "combined")}
    assert all(r["finite"] and r["formula_mib"] is not None for k, r in cases.items() if k[0] == "joint")
    # combined statistics at the δ of the pass give the per-group evidence (float32 rounding)
    per_group, combined = cases[("joint", "per_group")]["evidence"], cases[("joint", "combined")]["evidence"]
    assert abs(per_group - combined) <= 1e-3 * abs(per_group)
    assert report["gram"]["max_rel_difference"] < 1e-4
