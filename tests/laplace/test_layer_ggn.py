"""The dense GGN of a network of linear layers from its layer features (ggn/layer_ggn.py) against the dense
Jᵀ Λ J of torch.func.jacrev, its choice of route, and the evidence and predictive through the public API against
the Jacobian-rows route (function_space/evidence_curvature.py)."""

import gpytorch
import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import ntkgp
import ntkgp.laplace.function_space.eigen as eigen
import ntkgp.laplace.function_space.evidence_curvature as evidence_curvature
from ntkgp.laplace.ggn.layer_ggn import layer_ggn, layer_ggn_components, layer_ggn_layers
from ntkgp.laplace.ggn.scaling import output_scale, unit_hessian_sqrt
from ntkgp.likelihoods import SoftmaxLikelihood, validate_targets
from ntkgp.ntk.network import NetworkCore
from tests.helpers import float32_precision_error, rel_err


def net_of(sizes, act, bias, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b, bias=bias))
        if i + 2 < len(sizes):
            layers.append(act())
    return nn.Sequential(*layers).to(dtype)


def dense_unit_ggn(net, x, kind):
    """Σ_n J_nᵀ Λ̃_n J_n with J_n from torch.func.jacrev and Λ̃ written here: I (Gaussian, unit noise scale),
    diag(p) − p pᵀ (softmax at temperature 1); columns in the order of net.named_parameters()."""
    params = {k: v.detach() for k, v in net.named_parameters()}

    def f_of(p, xi):
        return functional_call(net, p, (xi[None],))[0]

    rows = []
    for xi in x:
        jac = jacrev(f_of)(params, xi)
        rows.append(torch.cat([jac[k].reshape(jac[k].shape[0], -1) for k in params], dim=1))
    j = torch.stack(rows)  # (N, C, P)
    with torch.no_grad():
        f = net(x)
    if kind == "gaussian":
        lam = torch.eye(f.shape[1], dtype=f.dtype).expand(f.shape[0], -1, -1)
    else:
        p = torch.softmax(f, dim=-1)
        lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("ncp,ncd,ndq->pq", j, lam, j)


def likelihood_of(kind, c):
    if kind == "gaussian":
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.3
        return lik
    return SoftmaxLikelihood(num_classes=c).double()


def targets(kind, n, c):
    torch.manual_seed(1)
    return torch.randn(n, dtype=torch.float64) if kind == "gaussian" else torch.randint(0, c, (n,))


def build(net, x, y, lik, chunk_size=5):
    core = NetworkCore(net)
    xp = core.prepare(x)
    plan = core.layer_plan(xp)
    with torch.no_grad():
        f = net(x)
    yv = validate_targets(lik, y, f.shape[1])
    root = unit_hessian_sqrt(lik, f, yv, output_scale(lik).detach().to(f))
    layers = tuple(plan.layers)  # every layer, whatever the cost rule would choose
    return core, layers, layer_ggn(core, layers, xp, root, chunk_size=chunk_size)


def with_and_without_blocks(monkeypatch, module, name, run):
    """``run()`` with ``module.name`` (a block-route hook) spied on, every call giving blocks (the route taken),
    then with it giving ``None`` (the rows route): both results and the number of calls of the first run."""
    calls = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(original(*a)) or calls[-1])
    new = run()
    assert calls and all(blocks is not None for blocks in calls)  # the block route was taken
    monkeypatch.setattr(module, name, lambda *a: None)
    return new, run(), len(calls)


CASES = [
    ("gaussian", [3, 5, 1], nn.Tanh, True),
    ("gaussian", [3, 6, 4, 1], nn.ReLU, False),
    ("softmax", [3, 5, 3], nn.Tanh, True),
    ("softmax", [4, 6, 5, 3], nn.ReLU, True),
    ("softmax", [3, 5, 4, 3], nn.Tanh, False),
]


@pytest.mark.parametrize("kind,sizes,act,bias", CASES)
def test_blocks_equal_dense_jacrev_ggn(kind, sizes, act, bias):
    net = net_of(sizes, act, bias)
    torch.manual_seed(2)
    x = torch.randn(13, sizes[0], dtype=torch.float64)  # 13 = two full chunks of 5 and one of 3
    lik = likelihood_of(kind, sizes[-1])
    core, layers, h = build(net, x, targets(kind, 13, sizes[-1]), lik)
    assert layers is not None and len(layers) == len(sizes) - 1
    dense = dense_unit_ggn(net, x, kind)
    assert rel_err(h, dense) < 1e-10
    assert torch.equal(h, h.T)


def test_float32_network_matches_its_float64_copy():
    net64 = net_of([3, 6, 4, 3], nn.Tanh, True)
    net32 = net_of([3, 6, 4, 3], nn.Tanh, True, dtype=torch.float32)
    torch.manual_seed(2)
    x = torch.randn(20, 3, dtype=torch.float64)
    y = targets("softmax", 20, 3)
    h32 = build(net32, x.float(), y, likelihood_of("softmax", 3))[2]
    dense = dense_unit_ggn(net64, x, "softmax")
    assert h32.dtype == torch.float32
    # the error model of tests.helpers.float32_precision_error (softmax sites: ‖Λ_n‖ ≤ ½)
    bound = float32_precision_error(net64, x, 0.5)["precision"]
    assert bound < 1e-2 * dense.norm()  # a meaningful bound: a 1 % error fails
    assert (h32.double() - dense).norm() <= bound


def test_route_is_left_for_generic_parameters_ef_and_per_output_noises():
    class Scaled(nn.Module):  # a free parameter outside any Linear layer
        def __init__(self):
            super().__init__()
            self.body = net_of([3, 5, 2], nn.Tanh, True)
            self.gain = nn.Parameter(torch.ones(2, dtype=torch.float64))

        def forward(self, x):
            return self.body(x) * self.gain

    x = torch.randn(6, 3, dtype=torch.float64)
    generic = NetworkCore(Scaled())
    assert layer_ggn_layers(generic, generic.layer_plan(generic.prepare(x)), 1, False, False) is None
    core = NetworkCore(net_of([3, 5, 2], nn.Tanh, True))
    plan = core.layer_plan(core.prepare(x))
    assert layer_ggn_layers(core, plan, 2, False, False) is not None
    assert layer_ggn_layers(core, plan, 2, True, False) is None  # the empirical Fisher
    assert layer_ggn_layers(core, plan, 2, False, True) is None  # one component per output
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False).double()
    with torch.no_grad():
        f = core.net(x)
    assert layer_ggn_components(core, plan, x, lik, f, torch.randn(6, 2, dtype=torch.float64),
                                output_scale(lik).detach().double(), False) is None


def test_route_is_left_when_it_costs_more():
    # one output (M = 1) and tiny layers: Σ_{l≤m} P_l P_m + Σ d_out products exceed P(P+1)/2 for one row
    core = NetworkCore(net_of([1, 1, 1], nn.Tanh, True))
    x = torch.randn(4, 1, dtype=torch.float64)
    assert layer_ggn_layers(core, core.layer_plan(core.prepare(x)), 1, False, False) is None


@pytest.mark.parametrize("kind,c", [("gaussian", 1), ("softmax", 3)])
def test_evidence_and_predictive_match_the_rows_route(kind, c, monkeypatch):
    net = net_of([3, 5, 4, c], nn.Tanh, True)  # P = 44 + 5C < N·C: weight space
    torch.manual_seed(3)
    x, x_test = torch.randn(120, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    y = targets(kind, 120, c)
    delta = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)

    def run():
        lik = likelihood_of(kind, c)
        model = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta)
        model.train()
        mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model)
        value = mll(model(x), y)
        grads = torch.autograd.grad(value, [model.covar_module.raw_prior_precision])
        model.eval()
        with torch.no_grad():
            var = model(x_test).variance
        return value.detach(), grads[0], var

    new, old, _ = with_and_without_blocks(monkeypatch, evidence_curvature, "weight_space_blocks", run)
    for a, b in zip(new, old):
        assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("kind,c", [("gaussian", 1), ("softmax", 3)])
def test_one_delta_spectral_evidence_matches_the_rows_route(kind, c, monkeypatch):
    """One prior precision: the eigenvalues of the weight-space GGN (function_space/eigen.py) from the blocks."""
    net = net_of([3, 5, 4, c], nn.Tanh, True)
    torch.manual_seed(4)
    x = torch.randn(120, 3, dtype=torch.float64)
    y = targets(kind, 120, c)

    def run():
        lik = likelihood_of(kind, c)
        model = ntkgp.NTKGP(net, x, y, lik, prior_precision=0.7, prior_structure="network")
        value = model.log_marginal_likelihood()
        grad = torch.autograd.grad(value, [model.covar_module.raw_prior_precision])[0]
        return value.detach(), grad

    new, old, _ = with_and_without_blocks(monkeypatch, eigen, "blocks_of_root", run)
    for a, b in zip(new, old):
        assert rel_err(a, b) < 1e-9


@pytest.mark.parametrize("kind,c", [("gaussian", 1), ("softmax", 3)])
def test_compute_curvature_full_ggn_takes_the_blocks_batch_by_batch(kind, c, monkeypatch):
    """compute_curvature("full_ggn") (Algorithm 1's curvature) sums the blocks over batches: its dense GGN equals
    the jacrev Jᵀ Λ J, and the rows route gives the same (the route disabled)."""
    import importlib

    full = importlib.import_module("ntkgp.laplace.ggn.full_curvature")  # the module, not the function

    net = net_of([3, 6, 5, c], nn.Tanh, True)
    torch.manual_seed(4)
    x, y = torch.randn(23, 3, dtype=torch.float64), targets(kind, 23, c)
    lik = likelihood_of(kind, c)
    blocks, rows, calls = with_and_without_blocks(
        monkeypatch, full, "blocks_of_root", lambda: ntkgp.laplace.compute_curvature(net, x, y, lik, "full_ggn",
                                                                                     batch_size=10))
    assert calls == 3  # three batches, each by blocks
    dense = dense_unit_ggn(net, x, kind)
    scale = output_scale(lik).detach()[0]  # H = s · D for one component
    assert rel_err(blocks.dense(lik), scale * dense) < 1e-10
    assert rel_err(blocks.dense(lik), rows.dense(lik)) < 1e-10
    for delta in (0.3, torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)):  # one δ, one per layer
        assert rel_err(blocks.log_marginal_likelihood(delta, lik), rows.log_marginal_likelihood(delta, lik)) < 1e-10
