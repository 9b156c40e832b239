"""``benchmarks/gpu_scale.py`` (the GPU figures of issue 11) runs end to end at its ``--small`` sizes on the CPU, so
that the prepared GPU checks (``scripts/gpu_checks.sh``) do not first break on a GPU machine."""

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.helpers import EPS32

REPO = Path(__file__).resolve().parents[1]


def test_gpu_scale_small_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_scale.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_scale.py"), "--small", "--device", "cpu",
                    "--json", str(out)], check=True, cwd=REPO, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    cases = {(r["coupling"], r["statistics"]): r for r in report["sfr"]}
    assert set(cases) == {("independent", None), ("joint", "per_group"), ("joint", "combined")}
    assert all(r["finite"] and r["formula_mib"] is not None for k, r in cases.items() if k[0] == "joint")
    # combined statistics at the δ of the pass give the per-group evidence: a smoke check of the script's wiring
    # (a wrong δ moves it O(1)); the two statistics' float32 accuracy, with κ measured, is tested in
    # tests/models/sfr/test_sfr_combined_statistics.py — the random 784-256-256 network's κ is not measured here
    per_group, combined = cases[("joint", "per_group")]["evidence"], cases[("joint", "combined")]["evidence"]
    assert abs(per_group - combined) <= 1e-3 * abs(per_group)
    # two float32 Grams of the 8-50-50-1 tanh network (L = 3 layers, P = 3051 parameters), each entry within
    # rε√(K_ii K_jj) ≤ rε max|K| of the exact one, r = 2L + 2 + log2 P (tests.helpers.float32_roundings,
    # float32_gram_tolerance), so their largest difference relative to max|K| is at most 2rε (≈ 4.7e-6)
    r = 2 * 3 + 2 + math.log2(8 * 50 + 50 + 50 * 50 + 50 + 50 + 1)
    assert report["gram"]["max_rel_difference"] <= 2 * r * EPS32
