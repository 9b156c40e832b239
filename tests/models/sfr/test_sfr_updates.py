"""SFR.update: the one-step update equals building on the union with the same Z, without rereading old data."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ntkgp.models.sfr import SFR
from tests.helpers import rel_err
from tests.models.sfr.problems import DELTA, dense_moments, problem


@pytest.mark.parametrize("kind,c,coupling", [("gaussian", 1, "joint"), ("softmax", 3, "joint"), ("softmax", 3, "independent")])
def test_update_equals_building_on_the_union_and_never_rereads_old_data(kind, c, coupling):
    net, x, y, lik, xs = problem(kind, c, n=30)
    z = x[:8].clone()
    union = SFR(net, x, y, lik, inducing_points=z, output_coupling=coupling, prior_precision=DELTA)
    old_x, old_y = x[:18].clone(), y[:18].clone()
    one_pass = (pair for pair in [(old_x, old_y)])  # a generator: can be read only once
    model = SFR(net, one_pass, None, lik, inducing_points=z, output_coupling=coupling, prior_precision=DELTA)
    model(xs)  # factorizations are cached before the update and must be refreshed by it
    old_x.fill_(float("nan"))  # SFR must not hold on to (or re-read) the old data
    model.update(x[18:], y[18:], iterate=False)  # one-step sites: the update is exactly the union
    (m1, c1), (m2, c2) = dense_moments(model(xs)), dense_moments(union(xs))
    assert rel_err(m1, m2) < 1e-8 and rel_err(c1, c2) < 1e-8
    assert model.num_data == 30

def test_several_updates_equal_one():
    net, x, y, lik, xs = problem("softmax", 3, n=30)
    kw = {"inducing_points": x[:8], "prior_precision": DELTA}
    one = SFR(net, x[:10], y[:10], lik, **kw).update(x[10:], y[10:], iterate=False)
    several = SFR(net, x[:10], y[:10], lik, **kw)
    loader = DataLoader(TensorDataset(x[10:22], y[10:22]), batch_size=5)
    several.update(loader, iterate=False).update(x[22:26], y[22:26], iterate=False).update(x[26:], y[26:], iterate=False)
    (m1, c1), (m2, c2) = dense_moments(one(xs)), dense_moments(several(xs))
    assert rel_err(m1, m2) < 1e-10 and rel_err(c1, c2) < 1e-10

def test_dataloader_and_small_batches_equal_tensors():
    net, x, y, lik, xs = problem("softmax", 3, n=30)
    ref = SFR(net, x, y, lik, num_inducing=8, seed=3)
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    streamed = SFR(net, loader, None, lik, num_inducing=8, seed=3, batch_size=3)
    assert torch.equal(streamed.inducing_points, ref.inducing_points)
    (m1, c1), (m2, c2) = dense_moments(ref(xs)), dense_moments(streamed(xs))
    assert rel_err(m1, m2) < 1e-10 and rel_err(c1, c2) < 1e-10

def test_update_and_noise_change_reuse_the_inducing_factorization():
    from ntkgp.models.sfr import factorization as sfr_factorization

    net, x, y, lik, xs = problem("gaussian", 1, n=30)
    kw = {"inducing_points": x[:8], "prior_precision": DELTA}
    sfr = SFR(net, x[:20], y[:20], lik, **kw)
    sfr(xs)
    with mock.patch.object(sfr_factorization, "inducing_factors", side_effect=AssertionError("K_ZZ refactorized")):
        sfr.update(x[20:], y[20:])
        sfr.likelihood.noise = sfr.likelihood.noise * 2
        updated = dense_moments(sfr(xs))
    union = SFR(net, x, y, lik, **kw)
    union.likelihood.noise = sfr.likelihood.noise
    (m1, c1), (m2, c2) = updated, dense_moments(union(xs))
    assert rel_err(m1, m2) < 1e-8 and rel_err(c1, c2) < 1e-8
    with mock.patch.object(sfr_factorization, "inducing_factors", wraps=sfr_factorization.inducing_factors) as spy:
        sfr.covar_module.prior_precision = 2 * DELTA  # new δ: K_ZZ is refactorized
        sfr(xs)
    assert spy.call_count == 1
