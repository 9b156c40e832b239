"""Networks users write (issues 38 and 39): every network that builds gets its results, checked against dense
autograd Jacobians (tests.helpers.brute_jacobian: one ``torch.autograd.grad`` per example and output on the user's
own network), or a clear error at construction.

* recurrent layers (``nn.GRU``, ``nn.LSTM``: their forward cannot be vmapped over examples), ``weight_norm``
  (no forward-mode derivative), ``nn.TransformerEncoder`` (fused fast path and flash attention without forward AD):
  the NTK Gram, the evidence, NTKGP's predictive and SFR against the dense references, 1e-10 in float64 (the same
  sums in another order: κ·ε with κ ≲ 1e4 for these small problems), and a float32 network against its float64
  copy;
* a parameter the forward never uses: zero Jacobian columns, the predictive of the network without it;
* an uninitialized lazy module: a ``ValueError`` at construction naming it.
"""

import copy

import gpytorch
import pytest
import torch
from torch import nn

import ntkgp
from ntkgp.ntk import NetworkCore, NTKEngine
from tests.helpers import (
    brute_jacobian,
    dense_glm_predictive,
    dense_laplace,
    float32_gram_tolerance,
    float32_laplace_tolerances,
    float32_roundings,
    reference_log_prob,
    rel_err,
)

TOKENS = 3  # sequence length of the sequence models' inputs (flat rows of TOKENS · features)


class Recurrent(nn.Module):
    def __init__(self, cell: type, d: int = 2, hidden: int = 3, c: int = 2) -> None:
        super().__init__()
        self.rnn, self.head, self.d = cell(d, hidden, batch_first=True), nn.Linear(hidden, c), d

    def forward(self, x):
        out = self.rnn(x.reshape(x.shape[0], TOKENS, self.d))[0]
        return self.head(out[:, -1])


class Encoder(nn.Module):
    """A TransformerEncoder classifier on float sequences (an ``nn.Embedding`` front would take token ids)."""

    def __init__(self, d: int = 4, c: int = 2) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head, self.d = nn.Linear(d, c), d

    def forward(self, x):
        return self.head(self.encoder(x.reshape(x.shape[0], TOKENS, self.d)).mean(1))


class WeightNormed(nn.Module):
    def __init__(self, d: int = 6, c: int = 2) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(d, 4))
        self.b = nn.Linear(4, c)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Unused(nn.Module):
    def __init__(self, d: int = 6, c: int = 2, extra: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 4), nn.Linear(4, c)
        if extra:
            self.spare = nn.Linear(5, 5)  # never called by forward

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


NETWORKS = {
    "gru": lambda: Recurrent(nn.GRU),
    "lstm": lambda: Recurrent(nn.LSTM),
    "transformer": lambda: Encoder(),
    "weight_norm": lambda: WeightNormed(),
    "unused": lambda: Unused(),
}
WIDTH = {"gru": 2 * TOKENS, "lstm": 2 * TOKENS, "transformer": 4 * TOKENS, "weight_norm": 6, "unused": 6}
DELTA = 0.7


def build(name: str, dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    net = NETWORKS[name]().to(dtype).eval()
    x = torch.randn(6, WIDTH[name], dtype=dtype)
    y = torch.randn(6, 2, dtype=dtype)
    return net, x, y


def likelihood(dtype=torch.float64):
    lik = gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2, rank=0, has_global_noise=False).to(dtype)
    lik.task_noises = torch.tensor([0.2, 0.5], dtype=dtype)
    return lik


@pytest.mark.parametrize("name", list(NETWORKS))
def test_the_gram_matches_dense_autograd(name):
    net, x, _ = build(name)
    x2 = torch.randn(4, x.shape[1], dtype=torch.float64)
    j1, _ = brute_jacobian(net, x)
    j2, _ = brute_jacobian(net, x2)
    engine = NTKEngine(net, prior_structure="network")
    gram = engine.group_grams(x, x2)[0]
    assert rel_err(gram, j1 @ j2.T) < 1e-10
    assert rel_err(engine.jacobian(x), j1) < 1e-10
    u = torch.randn(j1.shape[1], dtype=torch.float64)  # J u by the network's route (forward mode or reverse twice)
    tangent = engine.core.unflatten(u)
    assert rel_err(engine.jvp(x, tangent), j1 @ u) < 1e-10


@pytest.mark.parametrize("name", ["gru", "transformer", "weight_norm", "unused"])
def test_evidence_predictive_and_sfr_match_the_dense_laplace(name):
    net, x, y = build(name)
    lik = likelihood()
    x_test = torch.randn(3, x.shape[1], dtype=torch.float64)
    log_prob = lambda f, yy: reference_log_prob("gaussian", f, yy, lik.task_noises.detach())
    columns = sum(p.numel() for p in net.parameters())
    dense = dense_laplace(net, x, y, log_prob, torch.full((columns,), DELTA, dtype=torch.float64))
    mean_ref, cov_ref = dense_glm_predictive(net, x_test, dense)

    model = ntkgp.NTKGP(net, x, y, copy.deepcopy(lik), prior_precision=DELTA, prior_structure="network")
    assert rel_err(model.log_marginal_likelihood().detach(), dense["evidence"]) < 1e-10
    with torch.no_grad():
        pred = model.eval()(x_test)
    assert rel_err(pred.mean.reshape(-1), mean_ref) < 1e-10
    assert rel_err(pred.covariance_matrix, cov_ref) < 1e-10

    # SFR with every training input as an inducing input is the exact GP posterior of the linearized network
    sfr = ntkgp.SFR(net, x, y, copy.deepcopy(lik), inducing_points=x, prior_precision=DELTA,
                    prior_structure="network").eval()
    with torch.no_grad():
        pred = sfr(x_test)
    assert rel_err(pred.mean.reshape(-1), mean_ref) < 1e-9
    assert rel_err(pred.covariance_matrix, cov_ref) < 1e-9


@pytest.mark.parametrize("name", ["gru", pytest.param("transformer", marks=pytest.mark.slow), "weight_norm"])
def test_float32_networks_agree_with_their_float64_copy(name):
    net, x, y = build(name)
    net32 = copy.deepcopy(net).float()
    x_test = torch.randn(3, x.shape[1], dtype=torch.float64)
    preds, sfrs, evidences, grams = {}, {}, {}, {}
    for dtype, network in ((torch.float64, net), (torch.float32, net32)):
        xd, yd = x.to(dtype), y.to(dtype)
        grams[dtype] = NTKEngine(network).group_grams(xd).double()
        model = ntkgp.NTKGP(network, xd, yd, likelihood(dtype), prior_precision=DELTA, prior_structure="network")
        evidences[dtype] = model.log_marginal_likelihood().detach().double()
        sfr = ntkgp.SFR(network, xd, yd, likelihood(dtype), inducing_points=xd, prior_precision=DELTA,
                        prior_structure="network").eval()
        with torch.no_grad():
            preds[dtype] = model.eval()(x_test.to(dtype))
            sfrs[dtype] = sfr(x_test.to(dtype))
    # sequential roundings: a recurrent cell's two stages at every step, attention's scores, softmax and weighted
    # sum between its projections (tests.helpers.float32_roundings)
    layers = {"gru": 2 * TOKENS + 1, "transformer": None, "weight_norm": None}[name]
    if name == "transformer":
        layers = sum(1 for m in net.modules() if any(True for _ in m.parameters(recurse=False))) + 3
    roundings = float32_roundings(net, layers)
    # the Gram: entries are sums of products of float32 Jacobian entries (tests.helpers.float32_gram_tolerance)
    diagonal = grams[torch.float64].diagonal(dim1=-2, dim2=-1)
    assert (grams[torch.float32] - grams[torch.float64]).norm() <= float32_gram_tolerance(net, diagonal,
                                                                                           roundings=roundings)
    # the evidence and both predictives (SFR with every input inducing is the same GP posterior): the error model
    # of tests.helpers.float32_laplace_tolerances, ε32·κ of H measured on dense float64 Jacobians
    log_prob = lambda f, yy: reference_log_prob("gaussian", f, yy, torch.tensor([0.2, 0.5], dtype=torch.float64))
    tol = float32_laplace_tolerances(net, x, y, log_prob, x_test, delta=DELTA, roundings=roundings)
    assert max(tol["mean"], tol["variance"], tol["evidence"] / abs(evidences[torch.float64].item())) < 1e-2
    assert abs(evidences[torch.float32] - evidences[torch.float64]).item() <= tol["evidence"]
    for got in (preds, sfrs):
        assert rel_err(got[torch.float32].mean.double(), got[torch.float64].mean) <= tol["mean"]
        assert rel_err(got[torch.float32].variance.double(), got[torch.float64].variance) <= tol["variance"]


def test_unused_parameters_get_the_prior_alone():
    """The network with a spare layer predicts as the same network without it (its columns are zero: the data says
    nothing about it), with any prior structure."""
    net, x, y = build("unused")
    without = Unused(extra=False).double().eval()
    without.load_state_dict({k: v for k, v in net.state_dict().items() if not k.startswith("spare")})
    x_test = torch.randn(3, x.shape[1], dtype=torch.float64)
    j, names = brute_jacobian(net, x)
    spare = torch.cat([torch.full((p.numel(),), n.startswith("spare")) for n, p in net.named_parameters()])
    assert torch.equal(NTKEngine(net).jacobian(x)[:, spare], torch.zeros_like(j[:, spare]))
    preds = []
    for network in (net, without):
        model = ntkgp.NTKGP(network, x, y, likelihood(), prior_precision=DELTA).eval()
        with torch.no_grad():
            pred = model(x_test)
        preds.append((pred.mean, pred.covariance_matrix))
    assert rel_err(preds[0][0], preds[1][0]) < 1e-12 and rel_err(preds[0][1], preds[1][1]) < 1e-12


@pytest.mark.parametrize("entry", ["NTKGP", "SFR", "NTKKernel", "laplace_posterior"])
def test_an_uninitialized_lazy_module_is_refused_at_construction(entry):
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LazyLinear(2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    build_it = {
        "NTKGP": lambda: ntkgp.NTKGP(net, x, y, likelihood()),
        "SFR": lambda: ntkgp.SFR(net, x, y, likelihood(), num_inducing=3),
        "NTKKernel": lambda: ntkgp.NTKKernel(net),
        "laplace_posterior": lambda: ntkgp.laplace.laplace_posterior(net, x, y, likelihood()),
    }[entry]
    with pytest.raises(ValueError, match=r"uninitialized lazy module '2' \(LazyLinear.*run one batch through"):
        build_it()
    net(x[:1])  # initialized: it builds
    assert NetworkCore(net).num_params == 3 * 4 + 4 + 4 * 2 + 2


def test_the_routes_found_for_each_network():
    """What the probe finds (ntkgp.ntk.autodiff): the routes that differ from the default, per network."""
    found = {}
    for name in NETWORKS:
        net, x, _ = build(name)
        core = NetworkCore(net)
        found[name] = core.autodiff(core.prepare(x))
    assert not found["gru"].vectorized and not found["lstm"].vectorized  # their forward is not vmappable
    assert not found["weight_norm"].forward_mode  # no forward-mode derivative: reverse over reverse
    assert found["transformer"].kernels  # the math attention kernels
    assert found["unused"].forward_mode and found["unused"].vectorized and not found["unused"].kernels


class _NoTransforms(torch.autograd.Function):
    """An autograd Function written the old way (no ``setup_context``): ``torch.func`` cannot transform it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (1 - x.tanh() ** 2)


class Opaque(nn.Module):
    def forward(self, x):
        return _NoTransforms.apply(x)


def test_a_network_no_route_differentiates_is_refused_at_construction_naming_the_module():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), Opaque(), nn.Linear(4, 2)).double().eval()
    x = torch.randn(5, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"cannot be differentiated by ntkgp: .* in module '1' \(Opaque\)"):
        ntkgp.NTKGP(net, x, torch.randn(5, 2, dtype=torch.float64), likelihood())
