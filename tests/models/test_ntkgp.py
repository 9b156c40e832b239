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
    float32_laplace_tolerances,
    mlp,
    reference_log_prob,
    rel_err,
    snapshot,
)
from tests.problems import KINDS, make_problem


def delta_columns(net, delta):
    pg = resolve_groups(net)
    return delta.expand(pg.num_groups)[column_groups(net, dict(zip(pg.names, pg.group_of)))]


@pytest.mark.parametrize("kind", KINDS)
def test_predictive_equals_dense_glm(kind):
    net, x, y, lik, log_prob = make_problem(kind)
    delta = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta, predictive_mean="gp")
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
        assert rel_err(model.predictive_distribution(x_test).mean.reshape(-1).detach(), mean_ref) < 1e-8


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
    updated = model.condition_on(x[10:], y[10:], iterate=False)  # one-step sites: exactly the union
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
    net64, x, y, lik64, log_prob = make_problem("softmax4", n=20)
    net32 = mlp(d_out=4, dtype=torch.float32)
    assert all(torch.equal(a.double(), b) for a, b in zip(net32.parameters(), net64.parameters()))
    lik32 = SoftmaxLikelihood(num_classes=4)
    e64 = ntkgp.NTKGP(net64, x, y, lik64).log_marginal_likelihood()
    e32 = ntkgp.NTKGP(net32, x.float(), y, lik32).log_marginal_likelihood()
    # the error model of float32_laplace_tolerances (ε32·κ of H, κ measured on the dense float64 GGN)
    tol = float32_laplace_tolerances(net64, x, y, log_prob, x[:2], gaussian=False)["evidence"]
    assert tol < 1e-2 * abs(e64.item())  # a meaningful bound: a 1 % error fails
    assert e32.dtype == torch.float32 and abs(e32.double().item() - e64.item()) < tol


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
    """``model.predictive_distribution(x)`` (what eval-mode ``LaplaceNTKGP`` calls return) keeps the covariance lazy."""
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
        variance = model.predictive_distribution(x_test).variance
        assert calls == [(12, None), (50, 12)]
        reference = model(x_test).covariance_matrix.diagonal()
    assert torch.allclose(variance.reshape(-1), reference, rtol=1e-9, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------
# Caches are never stale: every route of changing a hyperparameter or the network, in eval mode.

ROUTES = ["setter", "data", "load_state_dict", "optimizer", "network"]


def _change(model, route):
    kernel, lik = model.covar_module, model.likelihood
    if route == "setter":
        kernel.prior_precision = kernel.prior_precision.detach() * 1.7
        if hasattr(lik, "task_noises"):
            lik.task_noises = lik.task_noises.detach() * 1.3
        elif hasattr(lik, "noise"):
            lik.noise = lik.noise.detach() * 1.3
        if hasattr(lik, "temperature"):
            lik.temperature = lik.temperature.detach() * 1.3
    elif route == "data":
        kernel.raw_prior_precision.data.add_(0.4)
        for p in lik.parameters():
            p.data.add_(0.2)
    elif route == "load_state_dict":
        state = model.state_dict()
        for k in state:
            if k.rpartition(".")[2].startswith("raw_"):
                state[k] = state[k] + 0.3
        model.load_state_dict(state)
    elif route == "optimizer":
        params = list(model.hyperparameters())
        optimizer = torch.optim.SGD(params, lr=0.25)
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        for p in params:
            p.grad = None
    else:
        model.net[0].weight.data.mul_(1.1)  # a change no version counter sees


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
def test_predictions_follow_every_change_in_eval_mode(kind, route):
    import copy

    net, x, y, lik, _ = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)).eval()
    x_test = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        before = model(x_test)
        before.mean, before.variance  # fill every cache
        model.log_marginal_likelihood()
    _change(model, route)
    fresh = ntkgp.NTKGP(net, x, y, copy.deepcopy(model.likelihood),
                        prior_precision=model.covar_module.prior_precision.detach().clone()).eval()
    with torch.no_grad():
        after, reference = model(x_test), fresh(x_test)
        assert rel_err(before.mean, reference.mean) > 1e-6  # the change matters
        assert rel_err(after.mean, reference.mean) < 1e-10
        assert rel_err(after.variance, reference.variance) < 1e-10
        assert rel_err(after.covariance_matrix, reference.covariance_matrix) < 1e-10
        assert rel_err(model.log_marginal_likelihood(), fresh.log_marginal_likelihood()) < 1e-10


# ---------------------------------------------------------------------------------------------------------
# Fantasy models, dtypes, batches


@pytest.mark.parametrize("kind", KINDS)
def test_get_fantasy_model_for_every_variant(kind):
    net, x, y, lik, _ = make_problem(kind, n=16)
    model = ntkgp.NTKGP(net, x[:10], y[:10], lik).eval()
    fantasy = model.get_fantasy_model(x[10:], y[10:])
    # classification: the default of condition_on (iterated sites), checked against the brute-force mode in
    # tests/models/test_iterated_sites.py; Gaussian: exactly the model on the union
    if kind.startswith("regression"):
        union = ntkgp.NTKGP(net, x, y, lik).eval()
    else:
        union = model.condition_on(x[10:], y[10:], iterate=True)
    x_test = torch.randn(5, 3, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(fantasy(x_test).mean, union(x_test).mean) < 1e-10
        assert rel_err(fantasy(x_test).covariance_matrix, union(x_test).covariance_matrix) < 1e-10
    assert type(fantasy) is type(model) and fantasy.net is net and not fantasy.training
    with pytest.raises(NotImplementedError, match="noise"):
        model.get_fantasy_model(x[10:], y[10:], noise=torch.ones(6))


def test_batched_fantasies_are_refused():
    net, x, y, lik, _ = make_problem("regression1", n=16)
    model = ntkgp.NTKGP(net, x[:10], y[:10], lik).eval()
    with pytest.raises(NotImplementedError, match="batched fantasies"):
        model.get_fantasy_model(x[10:], y[10:].expand(3, 6))
    with pytest.raises(ValueError, match=r"targets must have shape \(M,\) or \(M, 1\)"):  # (M, 2): a wrong shape
        model.get_fantasy_model(x[10:], y[10:, None].expand(6, 2))


def test_model_dtype_conversion_then_predicting():
    import copy

    net32 = mlp(d_out=4, dtype=torch.float32)
    net64 = copy.deepcopy(net32).double()
    torch.manual_seed(0)
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.randint(0, 4, (12,))
    x_test = torch.randn(5, 3, dtype=torch.float64)
    model = ntkgp.NTKGP(net32, x, y, SoftmaxLikelihood(num_classes=4)).eval()  # float64 data, float32 network
    assert model.dtype == torch.float32 and model.train_x.dtype == torch.float32
    with torch.no_grad():
        pred32 = model(x_test)
        reference = ntkgp.NTKGP(net64, x, y, SoftmaxLikelihood(num_classes=4).double()).eval()(x_test)
        # float32 Jacobians (and, before model.double(), float32 algebra): the error model of
        # float32_laplace_tolerances, with κ of H measured on the dense float64 GGN
        tol = float32_laplace_tolerances(net64, x, y, lambda f, yy: reference_log_prob("softmax", f, yy), x_test,
                                         gaussian=False)
        assert max(tol["mean"], tol["variance"]) < 1e-2  # a meaningful bound: a 1 % error fails
        assert pred32.mean.dtype == torch.float32 and rel_err(pred32.mean.double(), reference.mean) < tol["mean"]
        model.double()  # float64 algebra on float32 Jacobians
        pred = model(x_test)
        assert pred.mean.dtype == torch.float64 and rel_err(pred.variance, reference.variance) < tol["variance"]
        model.float()
        assert model(x_test).mean.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in net32.parameters())
    net, x, y, lik, log_prob = make_problem("regression2")
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    with torch.no_grad():
        reference = model(x_test)
        model.float()
        pred = model(x_test)
    # float64 Jacobians rounded once, float32 algebra: within the same error model (r ≥ 1 rounding per entry)
    tol = float32_laplace_tolerances(net, x, y, log_prob, x_test)["mean"]
    assert tol < 1e-2 and pred.mean.dtype == torch.float32 and rel_err(pred.mean.double(), reference.mean) < tol
    assert all(p.dtype == torch.float64 for p in net.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_batched_test_inputs_give_one_joint_per_batch_element(kind):
    net, x, y, lik, _ = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    x_test = torch.randn(2, 3, 4, 3, dtype=torch.float64)
    with torch.no_grad():
        pred = model(x_test)
        c = model.num_outputs
        assert pred.mean.shape == ((2, 3, 4) if c == 1 else (2, 3, 4, c))
        assert pred.covariance_matrix.shape == (2, 3, 4 * c, 4 * c)
        for i in range(2):
            for j in range(3):
                single = model.predictive_distribution(x_test[i, j])
                assert rel_err(pred.mean[i, j], single.mean) < 1e-12
                assert rel_err(pred.covariance_matrix[i, j], single.covariance_matrix) < 1e-12
                assert rel_err(pred.variance[i, j], single.variance) < 1e-12


def test_batched_image_inputs():
    from tests.helpers import small_cnn

    net = small_cnn(c_out=3)
    torch.manual_seed(0)
    x, y = torch.randn(8, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    model = ntkgp.NTKGP(net, x, y, SoftmaxLikelihood(num_classes=3)).eval()
    x_test = torch.randn(2, 4, 1, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        pred = model(x_test)
        flat = model(x_test.flatten(-3))
        single = model(x_test[1])
    assert pred.mean.shape == (2, 4, 3)
    assert torch.equal(pred.mean, flat.mean)
    assert rel_err(pred.mean[1], single.mean) < 1e-12 and rel_err(pred.variance[1], single.variance) < 1e-12


# ---------------------------------------------------------------------------------------------------------
# Input gradients against central finite differences


@pytest.mark.parametrize("c", [1, 3])
def test_input_gradients_of_mean_and_variance_match_finite_differences(c):
    torch.manual_seed(0)
    net = mlp(d_in=2, width=6, d_out=c, depth=1)
    x = torch.randn(10, 2, dtype=torch.float64)
    if c == 1:
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.2
        y = torch.randn(10, dtype=torch.float64)
    else:
        lik, y = SoftmaxLikelihood(num_classes=3), torch.randint(0, 3, (10,))
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=0.7).eval()
    x_test = torch.randn(4, 2, dtype=torch.float64)
    weights = torch.randn(4 * c, dtype=torch.float64)

    def objective(xt):
        pred = model(xt)
        return (pred.mean.reshape(-1) * weights).sum() + (pred.variance.reshape(-1) * weights.cos()).sum()

    xg = x_test.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(objective(xg), xg)
    assert x_test.grad is None
    fd = torch.zeros_like(x_test)
    eps = 1e-6
    with torch.no_grad():
        for i in range(4):
            for j in range(2):
                up, down = x_test.clone(), x_test.clone()
                up[i, j] += eps
                down[i, j] -= eps
                fd[i, j] = (objective(up) - objective(down)) / (2 * eps)
    assert rel_err(grad, fd) < 1e-6
    # the f(x) term of the mean carries its gradient: d mean / dx is not that of the GP correction alone
    xg = x_test.clone().requires_grad_(True)
    mean = model(xg).mean.sum()
    (g_mean,) = torch.autograd.grad(mean, xg)
    assert g_mean.abs().max() > 0


# ---------------------------------------------------------------------------------------------------------
# Chunked prediction and the posterior signature


@pytest.mark.parametrize("kind", ["regression2", "softmax4"])
def test_chunked_prediction_equals_one_chunk_and_bounds_the_cross_gram(kind):
    from ntkgp.likelihoods import output_covariance_blocks

    net, x, y, lik, _ = make_problem(kind)
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    x_test = torch.randn(11, 3, dtype=torch.float64)
    engine = model.covar_module.engine
    original, rows = engine.group_grams, []

    def spy(x1, x2=None):
        if x2 is not None:
            rows.append(x1.shape[0])
        return original(x1, x2)

    with torch.no_grad():
        whole = model.predictive_distribution(x_test, chunk_size=100)
        engine.group_grams = spy
        model.covar_module.clear_cache()
        chunked = model.predictive_distribution(x_test, chunk_size=3)
        mean, variance = chunked.mean, chunked.variance
        blocks = output_covariance_blocks(chunked)
        assert rows and max(rows) <= 3
        engine.group_grams = original
        dense = chunked.covariance_matrix
    c = model.num_outputs
    reference = whole.covariance_matrix
    assert rel_err(mean, whole.mean) < 1e-12 and rel_err(variance, whole.variance) < 1e-12
    assert rel_err(dense, reference) < 1e-12
    ref_blocks = reference.reshape(11, c, 11, c).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    assert rel_err(blocks, ref_blocks) < 1e-12
    v = torch.randn(11 * c, 2, dtype=torch.float64)
    assert rel_err(chunked.lazy_covariance_matrix @ v, reference @ v) < 1e-12
    entries = chunked.lazy_covariance_matrix[torch.tensor([0, 5, 7]), torch.tensor([3, 1, 20])]
    assert rel_err(entries, reference[[0, 5, 7], [3, 1, 20]]) < 1e-12


def test_mc_class_probabilities_of_a_softmax_ntkgp():
    net, x, y, lik, _ = make_problem("softmax4")
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    with torch.no_grad():
        probs = model.likelihood(model(torch.randn(6, 3, dtype=torch.float64)), link_approx="mc").probs
    assert probs.shape == (6, 4) and torch.allclose(probs.sum(-1), torch.ones(6, dtype=torch.float64))


def test_predictive_distribution_takes_botorch_keywords():
    net, x, y, lik, _ = make_problem("regression2")
    model = ntkgp.NTKGP(net, x, y, lik).eval()
    x_test = torch.randn(3, 5, 3, dtype=torch.float64)
    with torch.no_grad():
        full = model.predictive_distribution(x_test)
        noisy = model.predictive_distribution(X=x_test, output_indices=None, observation_noise=True)
        first = model.predictive_distribution(x_test, output_indices=[1])
        given = model.predictive_distribution(x_test, observation_noise=torch.full((3, 5, 2), 0.1, dtype=torch.float64))
    noise = lik.task_noises.detach()
    assert rel_err(noisy.variance, full.variance + noise) < 1e-12
    assert rel_err(given.variance, full.variance + 0.1) < 1e-12
    assert type(first) is gpytorch.distributions.MultivariateNormal and first.mean.shape == (3, 5)
    assert rel_err(first.mean, full.mean[..., 1]) < 1e-12
    assert rel_err(first.covariance_matrix, full.covariance_matrix[:, 1::2, 1::2]) < 1e-12
    with pytest.raises(TypeError, match="unexpected"):
        model.predictive_distribution(x_test, bogus=1)
    with pytest.raises(ValueError, match="output_indices"):
        model.predictive_distribution(x_test, output_indices=[2])
    with pytest.raises(ValueError, match="chunk_size"):
        model.predictive_distribution(x_test, chunk_size=0)
    binary, xb, yb, likb, _ = make_problem("binary")
    with pytest.raises(ValueError, match="observation_noise"):
        ntkgp.NTKGP(binary, xb, yb, likb).eval().predictive_distribution(x_test, observation_noise=True)


def test_inputs_are_validated_before_anything_is_built():
    net, x, y, lik, _ = make_problem("softmax4", n=16)
    with pytest.raises(ValueError, match="train_x of .*int64 does not fit"):  # ids are not cast: no Embedding here
        ntkgp.NTKGP(net, x.long(), y, lik)
    with pytest.raises(ValueError, match="train_x"):
        ntkgp.NTKGP(net, x[:, 0], y, lik)
    with pytest.raises(ValueError, match="train_x"):
        ntkgp.NTKGP(net, x[:, :2], y, lik)  # the network takes 3 features
    with pytest.raises(ValueError, match="prediction_chunk_size"):
        ntkgp.NTKGP(net, x, y, lik, prediction_chunk_size=0)
    model = ntkgp.NTKGP(net, x[:10], y[:10], lik).eval()
    bad = x[10:].clone()
    bad[3, 1] = float("nan")
    before = bad.clone()
    with pytest.raises(ValueError, match="x_new"):
        model.condition_on(bad, y[10:])
    assert torch.equal(bad.isnan(), before.isnan())
    with pytest.raises(ValueError, match="x_new"):
        model.condition_on(x[10:, :2], y[10:])
    with pytest.raises(ValueError, match="y_new"):
        model.condition_on(x[10:], y[:3])
    with pytest.raises(ValueError, match="X"):
        model.predictive_distribution(torch.randn(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="X of .*int64 does not fit"):
        model.predictive_distribution(torch.ones(4, 3, dtype=torch.long))



def test_train_mode_is_the_prior():
    """docs/ntkgp.md: train-mode calls give the prior; an ExactNTKGP only at its training inputs."""
    x_other = torch.randn(4, 3, dtype=torch.float64)
    for kind in ("regression1", "softmax4"):
        net, x, y, lik, _ = make_problem(kind)
        model = ntkgp.NTKGP(net, x, y, lik).train()
        with torch.no_grad():
            prior = model.forward(x_other)
            kernel = model.covar_module(x_other).to_dense()
            mean = model.mean_module(x_other)
            assert torch.equal(prior.covariance_matrix, kernel) and torch.equal(prior.mean, mean)
            at_train = model(x)
            assert torch.allclose(at_train.covariance_matrix, model.covar_module(x).to_dense())
            if kind == "regression1":
                with pytest.raises(RuntimeError, match="training inputs"):
                    model(x_other)
            else:
                assert torch.equal(model(x_other).mean, mean)
