"""The weight-space site posterior from the evidence's cached GGN (``I + WᵀW`` without the Gram of the rows W):
its predictive against the function-space posterior (the other exact form, from the Gram of the kernel) after
every change of the network, δ and the noise or temperature; float32 keeps the rows formed in float64."""

import pytest
import torch

import ntkgp
from ntkgp.laplace.function_space import site_posterior as site_module
from tests.helpers import rel_err
from tests.problems import LEARNABLE_KINDS as KINDS
from tests.problems import learnable_problem as make_problem


def _predict(model, x_test):
    model.eval()
    with torch.no_grad():
        out = model(x_test)
        return out.mean.detach().clone(), out.variance.detach().clone()


@pytest.mark.parametrize("kind", KINDS)
def test_the_reused_precision_matches_function_space_after_every_change(kind, monkeypatch):
    net, x, y, lik = make_problem(kind, n=10)
    weight = ntkgp.NTKGP(net, x, y, lik, prior_precision=[0.8, 1.5, 0.6], prior_structure="layer", space="weight")
    function = ntkgp.NTKGP(net, x, y, lik, prior_precision=[0.8, 1.5, 0.6], prior_structure="layer", space="function")
    calls = []
    original = site_module.evidence_curvature
    monkeypatch.setattr(site_module, "evidence_curvature", lambda *a, **k: calls.append(1) or original(*a, **k))
    x_test = torch.randn(7, x.shape[1], dtype=x.dtype, generator=torch.Generator().manual_seed(5))
    first = next(p for p in net.parameters() if p.requires_grad)
    raw_likelihood = [p for p in lik.parameters() if p.requires_grad]

    def set_delta(value):
        for model in (weight, function):
            model.covar_module.prior_precision = torch.tensor(value, dtype=torch.float64)

    for change in (lambda: None, lambda: first.data.mul_(1.2), lambda: set_delta([2.0, 0.3, 1.1]),
                   lambda: raw_likelihood[0].data.add_(0.25)):
        change()
        count = len(calls)
        mean_w, var_w = _predict(weight, x_test)
        assert len(calls) > count  # the weight-space posterior took its precision from the cached curvature
        mean_f, var_f = _predict(function, x_test)
        assert rel_err(mean_w, mean_f) < 1e-8
        assert rel_err(var_w, var_f) < 1e-8
        assert (var_w > 0).all()


def test_float32_forms_the_rows_in_float64(monkeypatch):
    net, x, y, lik = make_problem("regression1", n=10, dtype=torch.float32)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0, space="weight").eval()
    calls = []
    monkeypatch.setattr(site_module, "evidence_curvature", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        assert (model(x[:3]).variance > 0).all()
    assert not calls


def test_one_delta_keeps_the_rows():
    """One δ: the evidence's eigen route holds no P × P curvature, so the posterior forms I + WᵀW from the rows
    (no curvature is built for it)."""
    net, x, y, lik = make_problem("softmax3", n=10)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0, prior_structure="network", space="weight")
    reference = ntkgp.NTKGP(net, x, y, lik, prior_precision=1.0, prior_structure="network", space="function")
    x_test = torch.randn(4, x.shape[1], dtype=x.dtype, generator=torch.Generator().manual_seed(6))
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(site_module, "evidence_curvature", lambda *a, **k: calls.append(1))
        mean, var = _predict(model, x_test)
    assert not calls
    mean_f, var_f = _predict(reference, x_test)
    assert rel_err(mean, mean_f) < 1e-8 and rel_err(var, var_f) < 1e-8
