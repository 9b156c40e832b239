"""Data parallelism: 2 ``gloo`` processes, each with half the data, against one process on all the data.

One start of the two processes runs every scenario of :mod:`tests.distributed.scenarios` on both ranks;
the single-process results are computed here first. Every tensor must agree to 1e-10
(float64), relative to its magnitude, on both ranks.
"""

from __future__ import annotations

import gpytorch
import pytest
import torch

from tests.distributed import scenarios
from tests.distributed.launch import run
from tests.helpers import mlp

WORLD = 2


@pytest.fixture(scope="module")
def results():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        # one process first: the forked ranks then find torch's lazily imported modules loaded
        single = {name: getattr(scenarios, f"{name}_results")(None, WORLD) for name in ("sfr", "curvature", "marglik")}
        ranks = run("tests.distributed.scenarios:everything", WORLD, timeout=600)
    finally:
        torch.set_default_dtype(default)
    return single, ranks


def assert_same(reference, other, path=""):
    if isinstance(reference, dict):
        assert set(reference) <= set(other), path
        for key in reference:
            assert_same(reference[key], other[key], f"{path}/{key}")
    elif torch.is_tensor(reference):
        assert other.shape == reference.shape and other.dtype == reference.dtype, path
        scale = max(1.0, reference.abs().max().item()) if reference.numel() else 1.0
        error = (other - reference).abs().max().item() if reference.numel() else 0.0
        assert error <= 1e-10 * scale, f"{path}: max abs difference {error:.3g} (scale {scale:.3g})"
    else:
        assert other == reference, path


@pytest.mark.parametrize("case", ["joint", "joint_updated", "greedy"])
def test_sfr_statistics_predictions_and_update_match_one_process(results, case):
    single, ranks = results
    for rank in ranks:
        assert_same(single["sfr"][case], rank["sfr"][case], f"sfr/{case}")


@pytest.mark.parametrize("likelihood", ["softmax", "gaussian"])
@pytest.mark.parametrize("structure", ["kfac", "diag_ggn", "diag_ef"])
def test_curvature_and_evidence_match_one_process(results, likelihood, structure):
    single, ranks = results
    key = f"{likelihood}_{structure}"
    for rank in ranks:
        assert_same(single["curvature"][key], rank["curvature"][key], f"curvature/{key}")


@pytest.mark.parametrize("structure", ["full_ggn", "full_ef", "kfac"])
def test_train_marglik_full_batch_matches_one_process(results, structure):
    single, ranks = results
    assert len(single["marglik"][structure]["history"]) == 2  # rounds at epochs 4 and 6
    for rank in ranks:
        assert_same(single["marglik"][structure], rank["marglik"][structure], f"marglik/{structure}")


def test_train_marglik_minibatches_leave_the_ranks_identical(results):
    _, ranks = results
    first, second = (r["marglik"]["minibatch"] for r in ranks)
    for key in ("weights", "prior_precision", "noise", "history", "train_loss"):
        assert torch.equal(first[key], second[key]), key
    assert torch.isfinite(first["history"]).all()


def test_failures_raise_on_every_rank(results):
    _, ranks = results
    bad, good = ranks[1]["failures"], ranks[0]["failures"]
    for case in ("curvature_nan", "sfr_nan", "update_nan"):
        assert bad[case].startswith("ValueError") and "NaN" in bad[case], bad[case]
        assert good[case].startswith("RuntimeError") and "another rank" in good[case], good[case]
    assert bad["update_count"] == good["update_count"] == 20
    for rank in ranks:  # the iterated update is not data-parallel: refused on every rank, before any collective
        assert rank["failures"]["update_iterate"].startswith("ValueError: iterate=True is not data-parallel")
    for case in ("sfr_weights", "kfac_weights"):
        for rank in ranks:
            assert rank["failures"][case].startswith("ValueError") and "differ between ranks" in rank["failures"][case]
    for case in ("sfr_dtype", "kfac_dtype", "marglik_dtype", "sfr_z_shape"):  # checked before any collective of mismatched sizes
        for rank in ranks:
            message = rank["failures"][case]
            assert message.startswith("ValueError") and "in number, shape, dtype" in message, message
    # targets of another float dtype on one rank: the union's evidence up to the targets' float32 rounding. Error
    # model: a Gaussian GGN (and so its log-determinant) does not depend on y, and y_n rounded to float32
    # (|Δy_n| ≤ ε32|y_n|) moves the data fit −Σ(y_n − f_n)²/2σ² by at most ε32 Σ|y_n − f_n||y_n|/σ² (first order,
    # measured here on the scenario's float64 network and data, over all targets), plus the float64 agreement of
    # the two routes that this file asserts for every other quantity (1e-10 relative)
    xr, yr = scenarios._data(20, 2, seed=19)
    reg = mlp(d_in=2, width=4, d_out=1, depth=1, seed=20)
    noise = gpytorch.likelihoods.GaussianLikelihood().double().noise.item()
    with torch.no_grad():
        fit = ((yr - reg(xr).squeeze(-1)).abs() * yr.abs()).sum().item() / noise
    for rank in ranks:
        mixed, union = rank["failures"]["mixed_target_dtype"]
        bound = torch.finfo(torch.float32).eps * fit + 1e-10 * abs(union)
        assert abs(mixed - union) <= bound, (mixed, union, bound)
        assert bound < 1e-2 * abs(union)  # a 1e-2 bug still fails
    assert all(r["failures"]["after"] == WORLD for r in ranks)
