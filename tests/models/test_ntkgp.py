"""NTKGP: the GLM predictive against dense weight-space formulas, the exact-GP behaviour, conditioning."""

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.likelihoods import LogisticLikelihood, SoftmaxLikelihood
from ntkgp.ntk import resolve_groups
from tests.helpers import (
    assert_unchanged,
    column_groups,
    dense_glm_predictive,
    dense_laplace,
    mlp,
    rel_err,
    snapshot,
)
from tests.mlls.test_laplace_ggn_evidence import KINDS, make_problem


def delta_columns(net, delta):
    pg = resolve_groups(net)
    return delta.expand(pg.num_groups)[column_groups(net, dict(zip(pg.names, pg.group_of)))]


@pytest.mark.parametrize("kind", KINDS)
def test_predictive_equals_dense_glm(kind):
    net, x, y, lik, log_prob = make_problem(kind)
    delta = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta)
    x_test = torch.randn(5, 3, dtype=torch.float64)
    mean_ref, cov_ref = dense_glm_predictive(net, x_test, dense_laplace(net, x, y, log_prob, delta_columns(net, delta)))
    model.eval()
    before = snapshot(net)
    with torch.no_grad():
        pred = model(x_test)
    assert_unchanged(net, before)
    c = net[-1].out_features
    mean = pred.mean.reshape(-1)
    cov = pred.covariance_matrix
    assert mean.shape == (5 * c,) and cov.shape == (5 * c, 5 * c)
    assert rel_err(mean, mean_ref) < 1e-8
    assert rel_err(cov, cov_ref) < 1e-8
    assert rel_err(pred.variance.reshape(-1), cov_ref.diagonal()) < 1e-8
    if kind != "regression1" and kind != "regression2":
        assert rel_err(model.posterior(x_test).mean.reshape(-1).detach(), mean_ref) < 1e-8


def test_classification_predictive_over_y_uses_probit():
    net, x, y, lik, _ = make_problem("softmax4")
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    x_test = torch.randn(6, 3, dtype=torch.float64)
    with torch.no_grad():
        f = model(x_test)
        probs = model.likelihood(f).probs
    scaled = f.mean / torch.sqrt(1 + torch.pi / 8 * f.variance)
    assert torch.allclose(probs, torch.softmax(scaled, -1), atol=1e-12)


def test_regression_predictive_over_y_adds_noise():
    net, x, y, lik, _ = make_problem("regression1")
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    x_test = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(lik(model(x_test)).variance, model(x_test).variance + lik.noise, atol=1e-12)


def train_map(net, x, y, noise, delta, steps=300):
    """Train to a stationary point of the regularised loss −Σ log N(y; f, σ²) + ½ Σ_g δ_g ‖θ_g‖² (LBFGS)."""
    params = list(net.parameters())
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=steps, tolerance_grad=1e-12, tolerance_change=1e-16, history_size=50, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = 0.5 * ((net(x) - y) ** 2).sum() / noise + 0.5 * delta * sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    closure()
    worst = max(p.grad.abs().max().item() for p in params)
    for p in params:
        p.grad = None
    return worst


def test_exact_mll_is_the_laplace_evidence_at_a_converged_map():
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 30, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(2 * x) + 0.1 * torch.randn_like(x)
    net = mlp(d_in=1, width=8, d_out=1, depth=1)
    noise, delta = 0.05, 0.5
    grad = train_map(net, x, y, noise, delta)
    assert grad < 1e-5
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = noise
    model = ntkgp.NTKGP(net, x, y.squeeze(-1), lik, prior_precision=delta)
    exact = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    model.train()
    linearised_gp = exact(model(x), model.train_targets) * 30
    assert rel_err(linearised_gp.detach(), model.log_marginal_likelihood().detach()) < 1e-6
    # and the predictive mean is the network's own output at the MAP
    model.eval()
    x_test = torch.linspace(-3, 3, 7, dtype=torch.float64).unsqueeze(-1)
    with torch.no_grad():
        assert rel_err(model(x_test).mean, net(x_test).squeeze(-1)) < 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_condition_on_equals_model_on_the_union(kind):
    net, x, y, lik, _ = make_problem(kind, n=16)
    delta = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)
    model = ntkgp.NTKGP(net, x[:10], y[:10], lik, prior_precision=delta).eval()
    updated = model.condition_on(x[10:], y[10:])
    union = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta).eval()
    x_test = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        a, b = updated(x_test), union(x_test)
    assert rel_err(a.mean, b.mean) < 1e-10
    assert rel_err(a.covariance_matrix, b.covariance_matrix) < 1e-10
    assert rel_err(updated.log_marginal_likelihood().detach(), union.log_marginal_likelihood().detach()) < 1e-10
    assert model.num_data == 10 and updated.num_data == 16


def test_get_fantasy_model_for_regression():
    net, x, y, lik, _ = make_problem("regression1", n=16)
    model = ntkgp.NTKGP(net, x[:10], y[:10], lik).eval()
    x_test = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        model(x_test)
        fantasy = model.get_fantasy_model(x[10:], y[10:])
        union = ntkgp.NTKGP(net, x, y, lik).eval()
        assert rel_err(fantasy(x_test).mean, union(x_test).mean) < 1e-8
        assert rel_err(fantasy(x_test).variance, union(x_test).variance) < 1e-8
    assert fantasy.net is net


def test_learning_noise_recovers_the_known_level():
    torch.manual_seed(1)
    x = torch.rand(150, 1, dtype=torch.float64) * 4 - 2
    true_std = 0.2
    y = torch.sin(2 * x) + true_std * torch.randn_like(x)
    net = mlp(d_in=1, width=16, d_out=1, depth=1, seed=1)
    train_map(net, x, y, true_std**2, 1.0, steps=200)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ntkgp.NTKGP(net, x, y.squeeze(-1), lik, prior_precision=1.0)
    before = snapshot(net)
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
    optimizer = torch.optim.Adam(model.hyperparameters(), lr=0.05)
    model.train()
    history = []
    for _ in range(150):
        optimizer.zero_grad()
        loss = -mll(model(x), y.squeeze(-1))
        loss.backward()
        history.append(-loss.item())
        optimizer.step()
    assert all(p.grad is None for p in net.parameters())
    assert_unchanged(net, before)
    assert history[-1] > history[0] + 0.1
    assert abs(lik.noise.sqrt().item() - true_std) / true_std < 0.15


def test_bad_inputs():
    net, x, y, lik, _ = make_problem("regression1")
    with pytest.raises(ValueError, match="train_y"):
        ntkgp.NTKGP(net, x, y[:5], lik)
    bad_y = y.clone()
    bad_y[0] = float("nan")
    with pytest.raises(ValueError, match="train_y"):
        ntkgp.NTKGP(net, x, bad_y, lik)
    with pytest.raises(ValueError, match="outputs"):
        ntkgp.NTKGP(mlp(d_out=2), x, y, lik)
    with pytest.raises(ValueError, match="train_y|label|range"):
        ntkgp.NTKGP(mlp(d_out=3), x, torch.full((12,), 3), SoftmaxLikelihood(num_classes=3))
    bad_x = x.clone()
    bad_x[2, 1] = float("inf")
    with pytest.raises(ValueError, match="train_x contains NaN or Inf"):
        ntkgp.NTKGP(net, bad_x, y, lik)
    with pytest.raises(NotImplementedError):
        ntkgp.NTKGP(net, x, y, gpytorch.likelihoods.StudentTLikelihood())

    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 1).double()

        def forward(self, inputs):
            return self.fc(inputs) / 0.0

    with pytest.raises(ValueError, match="NaN or Inf outputs"):
        ntkgp.NTKGP(Exploding(), x, y, lik)
    binary = LogisticLikelihood()
    with pytest.raises(ValueError, match="train_y"):
        ntkgp.NTKGP(net, x, torch.full((12,), 2.0, dtype=torch.float64), binary)


def test_user_tensors_are_not_modified():
    net, x, y, lik, _ = make_problem("binary")
    x32 = x.float()
    x_copy, y_copy = x32.clone(), y.clone()
    model = ntkgp.NTKGP(net, x32, y, lik)
    model.log_marginal_likelihood()
    assert x32.dtype == torch.float32 and torch.equal(x32, x_copy) and torch.equal(y, y_copy)


def test_float32_agrees_with_float64():
    net64, x, y, lik64, _ = make_problem("softmax4", n=20)
    net32 = mlp(d_out=4, dtype=torch.float32)
    lik32 = SoftmaxLikelihood(num_classes=4)
    e64 = ntkgp.NTKGP(net64, x, y, lik64).log_marginal_likelihood()
    e32 = ntkgp.NTKGP(net32, x.float(), y, lik32).log_marginal_likelihood()
    assert e32.dtype == torch.float32 and rel_err(e32.double().detach(), e64.detach()) < 1e-5


def test_images_are_flattened_for_gpytorch():
    from tests.helpers import small_cnn

    net = small_cnn(c_out=3)
    torch.manual_seed(0)
    x = torch.randn(8, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(num_classes=3)).eval()
    assert model.train_x.shape == (8, 36)
    with torch.no_grad():
        pred = model(torch.randn(2, 1, 6, 6, dtype=torch.float64))
    assert pred.mean.shape == (2, 3)


@pytest.mark.parametrize("kind", ["regression2", "softmax4"])
def test_variances_never_form_the_test_gram(kind):
    """``model.posterior(x)`` (what eval-mode ``LaplaceNTKGP`` calls return) keeps the covariance lazy."""
    net, x, y, lik, _ = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    engine = model.covar_module.engine
    original, calls = engine.group_grams, []

    def spy(x1, x2=None):
        calls.append((x1.shape[0], None if x2 is None else x2.shape[0]))
        return original(x1, x2)

    engine.group_grams = spy
    x_test = torch.randn(50, 3, dtype=torch.float64)
    with torch.no_grad():
        variance = model.posterior(x_test).variance
        assert calls == [(12, None), (50, 12)]
        reference = model(x_test).covariance_matrix.diagonal()
    assert torch.allclose(variance.reshape(-1), reference, rtol=1e-9, atol=1e-14)
