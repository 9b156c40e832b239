"""``nested_marginals``: SFRs on nested inducing inputs (``select_inducing(m)``) predicted from one pass, against
each model's own ``predictive_grid(..., marginal=True)`` (which computes its own cross-Grams) and the dense SFR
formula; the passes through the network counted; the checks of the arguments."""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch

from ntkgp.models.sfr import SFR, nested_marginals
from tests.helpers import rel_err
from tests.models.sfr.problems import DELTA, Dense, problem, sfr_formula
from tests.models.sfr.test_sfr_marginal_grid import point_blocks

prior_grid = importlib.import_module("ntkgp.models.sfr.prior_grid")
Z_IDX = torch.tensor([0, 3, 5, 8, 13, 17, 1, 10])


@pytest.mark.parametrize("coupling", ["joint", "independent"])
@pytest.mark.parametrize("kind,c,mean", [("softmax", 3, "zero"), ("gaussian", 2, "linearized")])
def test_nested_marginals_equal_each_models_own_and_the_dense_formula(kind, c, mean, coupling):
    net, x, y, lik, xs = problem(kind, c, n=20)
    big = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA, prior_mean=mean,
              output_coupling=coupling)
    small, smaller = big.select_inducing(6), big.select_inducing(3)
    values = [torch.stack([DELTA, 0.3 * DELTA]), None, [2.0]]
    got = nested_marginals([small, big, smaller], xs, [values[1], values[0], values[2]], chunk_size=2)
    assert [len(g) for g in got] == [1, 2, 1]
    for model, dists, vals in [(small, got[0], None), (big, got[1], values[0]), (smaller, got[2], values[2])]:
        own = model.predictive_grid(xs, model.covar_module.prior_precision.detach()[None] if vals is None else vals,
                                    marginal=True)
        for d, o in zip(dists, own):
            # the same float64 algebra on the same cross-Grams' rows (computed by the largest model)
            assert rel_err(d.mean, o.mean) < 1e-12 and rel_err(d.covariance_matrix, o.covariance_matrix) < 1e-12
    m = 6
    ref_mean, ref_cov = sfr_formula(Dense(net, x, y, kind, delta=DELTA), Z_IDX[:m], xs, mean,
                                    independent=coupling == "independent")
    assert rel_err(got[0][0].mean.reshape(-1), ref_mean) < 1e-8
    assert rel_err(point_blocks(got[0][0].covariance_matrix, c), point_blocks(ref_cov, c)) < 1e-7


def test_one_pass_through_the_network_for_all_models():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    big = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA).eval()
    models = [big, big.select_inducing(5), big.select_inducing(2)]
    passes = []
    real_pieces = prior_grid.PredictiveTerms.pieces

    def count(terms, rows):
        passes.append(rows.shape[0])
        return real_pieces(terms, rows)

    with mock.patch.object(prior_grid.PredictiveTerms, "pieces", count):
        nested_marginals(models, xs, [[1.0, 2.0], [1.0], None], chunk_size=2)
    assert passes == [2, 2, 1]  # each chunk of the 5 points once, for all models and values


def test_invalid_arguments_name_themselves():
    net, x, y, lik, xs = problem("softmax", 3, n=20)
    big = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA)
    other = SFR(net, x, y, lik, inducing_points=x[Z_IDX[[1, 0, 2]]], prior_precision=DELTA)
    cases = [
        (dict(models=big), TypeError, "models"),
        (dict(models=[]), TypeError, "models"),
        (dict(models=[big, "sfr"]), TypeError, r"models\[1\]"),
        (dict(models=[big, other]), ValueError, r"models\[1\]: its inducing points"),
        (dict(models=[big, big.select_inducing(4)], prior_precisions=[None]), ValueError, "prior_precisions"),
        (dict(models=[big, big.select_inducing(4)], prior_precisions=[None, [-1.0]]), ValueError,
         r"prior_precisions\[1\]"),
        (dict(models=[big], chunk_size=0), ValueError, "chunk_size"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            nested_marginals(x=xs, **kwargs)
    independent = SFR(net, x, y, lik, inducing_points=x[Z_IDX], prior_precision=DELTA, output_coupling="independent")
    with pytest.raises(ValueError, match="output_coupling"):
        nested_marginals([big, independent.select_inducing(3)], xs)
