"""SFR.update: the one-step update equals building on the union with the same Z, without rereading old data."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ntkgp.models.sfr import SFR
from tests.helpers import rel_err
from tests.models.sfr.problems import DELTA, dense_moments, problem
from ntkgp.models import SFRInducingOptions, SFRMemoryOptions


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
    # the condition of the docs' claim: every inducing direction kept (8·C joint, 8 per output independent)
    full = 8 * c if coupling == "joint" else 8
    assert model.inducing_rank.tolist() == union.inducing_rank.tolist() == [full] * (1 if coupling == "joint" else c)


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
    ref = SFR(net, x, y, lik, num_inducing=8, inducing=SFRInducingOptions(seed=3))
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    streamed = SFR(net, loader, None, lik, num_inducing=8, inducing=SFRInducingOptions(seed=3),
                   memory=SFRMemoryOptions(batch_size=3))
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


@pytest.mark.parametrize("kind,c,iterate", [("gaussian", 1, False), ("softmax", 3, True), ("softmax", 3, False)])
def test_update_refuses_new_data_that_require_grad_before_any_change(kind, c, iterate):
    """The guarantees table: SFR.update is not differentiable in the new inputs, so inputs that require grad raise
    NotImplementedError (a gradient through them would be silently zero), and the model is unchanged."""
    net, x, y, lik, xs = problem(kind, c, n=20)
    sfr = SFR(net, x[:14], y[:14], lik, num_inducing=6, prior_precision=DELTA)
    before = dense_moments(sfr(xs))
    precision = sfr.dual_statistics.precision.clone()
    x_new = x[14:].clone().requires_grad_(True)
    batches = [(x[14:17], y[14:17]), (x_new[3:], y[17:])]  # the second batch requires grad
    for args in ((x_new, y[14:]), (batches, None)):
        with pytest.raises(NotImplementedError, match="x_new requires grad"):
            sfr.update(*args, iterate=iterate)
    assert torch.equal(sfr.dual_statistics.precision, precision) and sfr.num_data == 14
    after = dense_moments(sfr(xs))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    sfr.update(x_new.detach(), y[14:], iterate=iterate)  # as the message says
    assert sfr.num_data == 20
