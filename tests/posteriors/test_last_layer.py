"""Last-layer posteriors from features (full, KFAC, diagonal; GGN and EF) against dense brute force: autograd
Jacobians row by row, torch.distributions likelihood terms, explicit Kronecker products, explicit inverses and
log-determinants, the evidence written out term by term (float64, 1e-10); the δ- and noise-gradients of the evidence
against finite differences; the Jacobian route for heads that are not the layer's output; float32 against float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from ntkgp.laplace.weight_space import LastLayerDiagLaplace, LastLayerKFACLaplace, laplace_posterior
from ntkgp.likelihoods import SoftmaxLikelihood, hessian
from tests.helpers import (
    EPS32,
    assert_unchanged,
    float32_precision_error,
    float32_roundings,
    mlp,
    reference_terms,
    snapshot,
)
from tests.posteriors.reference import (
    DTYPE,
    LIKELIHOODS,
    check_against,
    close,
    dense_curvature,
    likelihood_case,
    targets,
)
from ntkgp.laplace import PassOptions

STRUCTURES = ["full_ggn", "full_ef", "kfac", "diag_ggn", "diag_ef"]
NAMES = ["4.weight", "4.bias"]


def problem(name: str, head: nn.Module | None = None):
    lik, c, log_prob = likelihood_case(name)
    net = mlp(3, 5, c, depth=2, seed=4)
    if head is not None:
        net.append(head)
    x = torch.randn(11, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    x_test = torch.randn(5, 3, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    return lik, c, log_prob, net, x, targets(name, 11), x_test


def parameter_order(c: int, d: int) -> torch.Tensor:
    """Flat position of each Kronecker entry (o, i) of [W | b]: weight row-major, then the bias (written here)."""
    return torch.tensor([o * d + i if i < d else c * d + o for o in range(c) for i in range(d + 1)])


def reference_precision(structure, net, x, y, log_prob, delta_cols) -> torch.Tensor:
    if structure.startswith("full"):
        h = dense_curvature(net, x, y, log_prob, structure[5:], NAMES)
    elif structure.startswith("diag"):
        h = torch.diag(dense_curvature(net, x, y, log_prob, structure[5:], NAMES).diagonal())
    else:  # KFAC: G = mean Λ_n (autograd Hessians), A = Σ φ̃ φ̃ᵀ from the body's outputs
        with torch.no_grad():
            phi = net[:-1](x)
            f = net(x)
        phi = torch.cat([phi, torch.ones(x.shape[0], 1, dtype=DTYPE)], dim=1)
        _, lam = reference_terms(log_prob, f, y)
        c, d = f.shape[1], phi.shape[1] - 1
        order = parameter_order(c, d)
        h = torch.zeros(c * (d + 1), c * (d + 1), dtype=DTYPE)
        h[order[:, None], order[None, :]] = torch.kron(lam.mean(0), phi.T @ phi)
    return h + torch.diag(delta_cols)


def reference_evidence(net, x, y, log_prob, precision, delta_cols) -> torch.Tensor:
    """log p(y|θ*) − ½ Σ δ θ² + ½ Σ log δ − ½ log|H + P0| over the layer's coordinates."""
    with torch.no_grad():
        f = net(x)
    params = dict(net.named_parameters())
    theta = torch.cat([params[n].detach().reshape(-1) for n in NAMES])
    return (log_prob(f, y).sum() - 0.5 * (delta_cols * theta.square()).sum() + 0.5 * delta_cols.log().sum()
            - 0.5 * torch.logdet(precision))


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("name", LIKELIHOODS)
def test_last_layer_structures_equal_dense_brute_force(name, structure):
    lik, c, log_prob, net, x, y, x_test = problem(name)
    kfac = structure == "kfac"
    delta = torch.tensor([1.7], dtype=DTYPE) if kfac else torch.tensor([0.3, 4.0], dtype=DTYPE)
    before = snapshot(net)
    posterior = laplace_posterior(net, x, y, lik, structure=structure, subset="last_layer", prior_precision=delta,
                                  prior_structure="layer" if kfac else "parameter", options=PassOptions(batch_size=4))
    assert posterior.names == NAMES and posterior.layer == "4"
    assert posterior.feature_layer is not None  # one forward pass: the feature route
    delta_cols = delta.expand(6 * c) if kfac else torch.cat([delta[0].expand(5 * c), delta[1].expand(c)])
    precision = reference_precision(structure, net, x, y, log_prob, delta_cols)
    check_against(posterior, net, x_test, precision, NAMES)
    close(posterior.log_marginal_likelihood(delta), reference_evidence(net, x, y, log_prob, precision, delta_cols))
    assert_unchanged(net, before)


@pytest.mark.parametrize("structure", ["full_ggn", "kfac", "diag_ef"])
@pytest.mark.parametrize("name", ["multitask", "softmax"])
def test_evidence_gradients_match_finite_differences(name, structure):
    lik, _, _, net, x, y, _ = problem(name)
    kfac = structure == "kfac"
    posterior = laplace_posterior(net, x, y, lik, structure=structure, subset="last_layer",
                                  prior_structure="layer" if kfac else "parameter")
    delta = torch.tensor([0.8] if kfac else [0.6, 2.2], dtype=DTYPE, requires_grad=True)
    posterior.log_marginal_likelihood(delta).backward()
    h = 1e-6
    for g in range(delta.shape[0]):
        step = torch.zeros_like(delta).index_fill_(0, torch.tensor(g), h)
        with torch.no_grad():
            up, down = posterior.log_marginal_likelihood(delta + step), posterior.log_marginal_likelihood(delta - step)
            fd = (up - down) / (2 * h)
        assert abs(delta.grad[g].item() - fd.item()) <= 1e-6 * (1 + abs(fd.item()))  # O(h²) + rounding/h
    if name == "softmax":
        lik.learn_temperature = True
    raw = lik.raw_task_noises if name == "multitask" else lik.raw_temperature
    (grad,) = torch.autograd.grad(posterior.log_marginal_likelihood(delta.detach()), raw)
    for i in range(raw.numel()):
        values = []
        for sign in (1, -1):
            with torch.no_grad():
                raw.view(-1)[i] += sign * h
                values.append(posterior.log_marginal_likelihood(delta.detach()).item())
                raw.view(-1)[i] -= sign * h
        fd = (values[0] - values[1]) / (2 * h)
        assert abs(grad.reshape(-1)[i].item() - fd) <= 1e-6 * (1 + abs(fd))


class Double(nn.Module):
    """A head after the last layer: f = 2 z (∂f/∂z = 2I, not I)."""

    def forward(self, z):
        return 2 * z


@pytest.mark.parametrize("structure", ["full_ggn", "full_ef", "diag_ggn", "diag_ef"])
def test_a_head_after_the_layer_takes_per_example_jacobians(structure):
    lik, c, log_prob, net, x, y, x_test = problem("softmax", head=Double())
    posterior = laplace_posterior(net, x, y, lik, structure=structure, subset="last_layer",
                                  prior_precision=torch.tensor([0.3, 4.0], dtype=DTYPE), prior_structure="parameter")
    assert posterior.feature_layer is None and posterior.names == NAMES
    delta_cols = torch.cat([torch.full((5 * c,), 0.3, dtype=DTYPE), torch.full((c,), 4.0, dtype=DTYPE)])
    precision = reference_precision(structure, net, x, y, log_prob, delta_cols)
    check_against(posterior, net, x_test, precision, NAMES)
    close(posterior.log_marginal_likelihood(), reference_evidence(net, x, y, log_prob, precision, delta_cols))
    with pytest.raises(ValueError, match="kfac"):
        laplace_posterior(net, x, y, lik, structure="kfac", subset="last_layer")


def test_a_head_that_differs_on_a_later_batch_raises():
    """ReLU after the layer: the identity on the first batch (every z > 0), not on the second."""
    net = nn.Sequential(nn.Linear(2, 1), nn.ReLU()).double()
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 0.0]]))
        net[0].bias.zero_()
    x = torch.cat([torch.rand(4, 2, dtype=DTYPE) + 0.5, -torch.rand(4, 2, dtype=DTYPE) - 0.5])
    lik, _, _ = likelihood_case("gaussian")
    with pytest.raises(ValueError, match="not the output of its last layer"):
        laplace_posterior(net, x, torch.randn(8, 1, dtype=DTYPE), lik, structure="diag_ggn", subset="last_layer",
                          options=PassOptions(batch_size=4))


@pytest.mark.parametrize("structure", STRUCTURES)
def test_float32_agrees_with_a_float64_copy(structure):
    lik, _, _, net, x, y, x_test = problem("softmax")
    args = dict(structure=structure, subset="last_layer", prior_precision=0.5)
    p64 = laplace_posterior(net, x, y, lik, **args)
    p32 = laplace_posterior(copy.deepcopy(net).float(), x.float(), y, copy.deepcopy(lik).float(), **args)
    precision = p64.dense_precision()
    kappa = torch.linalg.cond(precision).item()
    evidence, p = p64.log_marginal_likelihood(), p64.num_params
    # the error model of tests.helpers.float32_precision_error (softmax sites: ‖Λ_n‖ ≤ ½ / temperature): the
    # precision's entries move by at most ‖ΔH‖_F, the GLM blocks by (2rε + ηκ) max|C| with η = ‖ΔH‖_F/‖H‖ (the
    # factorization's backward error included), the evidence by ½ P ηκ (log-determinant) + ‖g‖ ‖Δf‖ (data fit,
    # ‖g_n‖ ≤ √2 / temperature)
    lam_max = 0.5 / float(lik.temperature)
    assert (p32.dense_precision().double() - precision).abs().max() <= float32_precision_error(net, x, lam_max)["precision"]
    error = float32_precision_error(net, x, lam_max, factorized=p, delta=0.5)
    eta = error["precision"] / torch.linalg.matrix_norm(precision, ord=2).item()
    blocks = p64.glm_covariance(x_test)
    bound = 2 * float32_roundings(net) * EPS32 + eta * kappa
    assert bound < 1e-2  # a meaningful bound: a 1 % error fails
    assert (p32.glm_covariance(x_test.float()).double() - blocks).abs().max() <= bound * blocks.abs().max()
    fit = math.sqrt(2 * x.shape[0]) / float(lik.temperature) * error["outputs"]
    assert abs(p32.log_marginal_likelihood().item() - evidence.item()) <= 0.5 * p * eta * kappa + fit


@pytest.mark.parametrize("c", [200, pytest.param(1000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("cls", [LastLayerKFACLaplace, LastLayerDiagLaplace])
def test_many_classes_without_a_matrix_per_example(cls, c):
    """C = 1,000 classes: G = Σ_n Λ̃_n and diag Λ̃_n in closed form, against the full Hessians of
    ntkgp.likelihoods (the predictive's eigendecomposition of G, 1000 × 1000, makes that case slow)."""
    torch.manual_seed(0)
    n = 12
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, c)).double()
    x, y = torch.randn(n, 4, dtype=DTYPE), torch.randint(0, c, (n,))
    lik = SoftmaxLikelihood(num_classes=c).double()
    posterior = cls(net, x, y, lik, prior_precision=2.0)
    with torch.no_grad():
        lam = hessian(lik, net(x), y)  # (n, C, C)
        phi = torch.cat([net[:-1](x), torch.ones(n, 1, dtype=DTYPE)], dim=1)
    if cls is LastLayerKFACLaplace:
        block = posterior.evidence_curvature.blocks[0]
        close(block.output_factors[0], lam.mean(0))
        close(block.input_factor, phi.T @ phi)
    else:
        expected = torch.einsum("nc,ni->ci", lam.diagonal(dim1=-2, dim2=-1), phi.square())
        order = parameter_order(c, 6)
        close(posterior.precision_diagonal()[order], expected.reshape(-1) + 2.0)
    assert posterior.glm_covariance(x[:2]).shape == (2, c, c)


def test_front_door_and_options():
    lik, _, _, net, x, y, _ = problem("softmax")
    kinds = {s: type(laplace_posterior(net, x, y, lik, structure=s, subset="last_layer")).__name__ for s in STRUCTURES}
    assert kinds == {"full_ggn": "LastLayerLaplace", "full_ef": "LastLayerLaplace", "kfac": "LastLayerKFACLaplace",
                     "diag_ggn": "LastLayerDiagLaplace", "diag_ef": "LastLayerDiagLaplace"}
    posterior = laplace_posterior(net, x, y, lik, structure="diag_ggn", subset="last_layer", layer="2")
    assert posterior.names == ["2.weight", "2.bias"] and posterior.feature_layer is None  # a hidden layer
    with pytest.raises(ValueError, match="prior_structure"):
        laplace_posterior(net, x, y, lik, structure="kfac", subset="last_layer", prior_structure="parameter")
    with pytest.raises(AttributeError, match="build a new"):
        posterior.layer = "4"


@pytest.mark.parametrize("structure", ["full_ggn", "kfac", "diag_ef"])
def test_a_state_dict_restores_the_posterior_without_a_pass(structure):
    lik, _, _, net, x, y, x_test = problem("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure=structure, subset="last_layer", prior_precision=0.7)
    restored = type(posterior).from_state_dict(posterior.state_dict(), net, lik)
    assert restored.layer == "4" and restored.names == NAMES
    close(restored.glm_covariance(x_test), posterior.glm_covariance(x_test))
    assert restored.feature_layer is not None  # decided at the first prediction
    close(restored.log_marginal_likelihood(), posterior.log_marginal_likelihood())
