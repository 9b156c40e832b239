"""The log-determinant of the exact evidence (ggn/exact_log_det.py) at sizes past the blocks of the
triangular inverse (ntkgp.linalg.triangular_inverse): value against torch.logdet of the dense matrix, gradients
in the coefficients and the row scales against autograd through torch.logdet and against central finite
differences; and the weight-space evidence of a network with P > 128 and one δ per tensor against the dense brute
force."""

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.laplace.ggn.exact_log_det import scaled_log_det
from ntkgp.linalg import TRIANGULAR_BLOCK, triangular_inverse
from tests.helpers import mlp, rel_err

from .test_evidence_curvature import brute_evidence


@pytest.mark.parametrize("n", [1, 7, TRIANGULAR_BLOCK, TRIANGULAR_BLOCK + 1, 301])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_triangular_inverse_equals_the_dense_inverse(n, dtype):
    torch.manual_seed(n)
    a = torch.randn(2, n, n, dtype=torch.float64)
    factor = torch.linalg.cholesky(a @ a.mT + n * torch.eye(n, dtype=torch.float64))
    expected = torch.linalg.inv(factor)
    noisy_upper = factor.to(dtype) + torch.ones(n, n, dtype=dtype).triu(1)  # the upper triangle is not read
    got = triangular_inverse(noisy_upper)
    assert got.dtype == dtype
    assert bool((got.triu(1) == 0).all())
    assert rel_err(got.double(), expected) < (1e-13 if dtype == torch.float64 else 1e-5)


def dense_problem(r, k, seed=0):
    torch.manual_seed(seed)
    roots = [torch.randn(r, r // 2 + 3, dtype=torch.float64) for _ in range(k)]
    matrices = torch.stack([q @ q.T for q in roots])
    coefficients = torch.rand(k, dtype=torch.float64) + 0.5
    root = torch.rand(r, dtype=torch.float64) + 0.2
    return coefficients, root, matrices


def brute(coefficients, root, matrices):
    m = torch.einsum("k,kpq->pq", coefficients, matrices)
    return torch.logdet(torch.eye(m.shape[0], dtype=m.dtype) + root[:, None] * m * root[None, :])


@pytest.mark.parametrize("k", [1, 2])
def test_value_and_gradients_equal_autograd_through_logdet_past_the_blocks(k):
    c, r, m = dense_problem(2 * TRIANGULAR_BLOCK + 45, k)
    c1, r1 = c.clone().requires_grad_(), r.clone().requires_grad_()
    c2, r2 = c.clone().requires_grad_(), r.clone().requires_grad_()
    value = scaled_log_det(c1, r1, m)
    reference = brute(c2, r2, m)
    assert rel_err(value.detach(), reference.detach()) < 1e-12
    got = torch.autograd.grad(value, [c1, r1])
    expected = torch.autograd.grad(reference, [c2, r2])
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-10


@pytest.mark.parametrize("k", [1, 3])
def test_without_a_root_value_and_coefficient_gradients_equal_autograd_through_logdet(k):
    """``root=None`` is D_r = I: the uniform root a caller folds into the coefficients."""
    c, _, m = dense_problem(TRIANGULAR_BLOCK + 31, k, seed=5)
    c1, c2 = c.clone().requires_grad_(), c.clone().requires_grad_()
    value = scaled_log_det(c1, None, m)
    reference = brute(c2, torch.ones(m.shape[-1], dtype=m.dtype), m)
    assert rel_err(value.detach(), reference.detach()) < 1e-12
    (got,), (expected,) = torch.autograd.grad(value, [c1]), torch.autograd.grad(reference, [c2])
    assert rel_err(got, expected) < 1e-10


def test_gradients_equal_central_finite_differences():
    c, r, m = dense_problem(TRIANGULAR_BLOCK + 60, 1, seed=3)
    c1, r1 = c.clone().requires_grad_(), r.clone().requires_grad_()
    grad_c, grad_r = torch.autograd.grad(scaled_log_det(c1, r1, m), [c1, r1])
    h = 1e-6
    fd_c = (brute(c + h, r, m) - brute(c - h, r, m)) / (2 * h)
    assert abs(grad_c.item() - fd_c.item()) < 1e-6 * abs(fd_c.item())
    for i in (0, 77, r.shape[0] - 1):
        e = torch.zeros_like(r)
        e[i] = h
        fd = (brute(c, r + e, m) - brute(c, r - e, m)) / (2 * h)
        assert abs(grad_r[i].item() - fd.item()) < 1e-6 * max(abs(fd.item()), 1e-3)


def test_coefficient_gradient_with_almost_no_curvature_takes_no_difference_of_near_equal_numbers():
    c, r, m = dense_problem(TRIANGULAR_BLOCK + 20, 1, seed=5)
    c = c * 1e-9  # B = I + O(1e-7): R − tr B⁻¹ would cancel; the route takes ⟨B⁻¹, M⟩ instead
    c1, c2 = c.clone().requires_grad_(), c.clone().requires_grad_()
    got = torch.autograd.grad(scaled_log_det(c1, r, m), c1)[0]
    expected = torch.autograd.grad(brute(c2, r, m), c2)[0]
    assert rel_err(got, expected) < 1e-10


@pytest.mark.parametrize("gaussian", [True, False])
def test_weight_space_evidence_with_one_delta_per_tensor_past_the_blocks_equals_the_brute_force(gaussian):
    net = mlp(d_in=4, width=12, d_out=1, depth=2)  # P = 60 + 156 + 13 = 229 > TRIANGULAR_BLOCK
    torch.manual_seed(1)
    x = torch.randn(300, 4, dtype=torch.float64)  # N·C = 300 > P: weight space
    if gaussian:
        lik = gpytorch.likelihoods.GaussianLikelihood().double()
        lik.noise = 0.2
        y = torch.randn(300, dtype=torch.float64)
        scale = lambda: lik.noise.reshape(1).reciprocal()  # noqa: E731
    else:
        lik = ntkgp.likelihoods.LogisticLikelihood(temperature=0.8, learn_temperature=True).double()
        y = (torch.rand(300) > 0.5).double()
        scale = lambda: lik.temperature.reshape(1).reciprocal()  # noqa: E731
    delta = torch.tensor([0.5, 2.0, 4.0, 1.5, 3.0, 0.7], dtype=torch.float64)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=delta, prior_structure="parameter")
    raw = [p for p in [*model.covar_module.parameters(), *lik.parameters()] if p.requires_grad]
    value = model.log_marginal_likelihood(space="weight", method="cholesky")
    reference = brute_evidence(net, x, y, "gaussian" if gaussian else "logistic",
                               model.covar_module.prior_precision, scale(), "ggn", "parameter")
    assert rel_err(value.detach(), reference.detach()) < 1e-10
    for g, e in zip(torch.autograd.grad(value, raw), torch.autograd.grad(reference, raw)):
        assert rel_err(g, e) < 1e-9


@pytest.mark.parametrize("kind", ["gaussian2", "logistic"])
@pytest.mark.parametrize("fisher", [False, True])
def test_components_summed_over_many_chunks_equal_the_dense_sum(monkeypatch, kind, fisher):
    """FullCurvature.from_jacobian in chunks of 5 examples, with Gram blocks of 4 columns (several panels, a
    ragged last one): the components against the per-example sum of outer products written here."""
    import ntkgp.linalg as linalg
    from ntkgp.laplace.weight_space import FullCurvature
    from ntkgp.laplace.ggn.scaling import output_scale, unit_gradient, unit_hessian_sqrt
    from ntkgp.ntk import resolve_groups

    from .test_evidence_curvature import problem

    monkeypatch.setattr(linalg, "GRAM_BLOCK", 4)
    net, x, y, lik = problem(kind)
    from tests.helpers import brute_jacobian

    j, _ = brute_jacobian(net, x)
    with torch.no_grad():
        f = net(x)
    n, c = f.shape
    yy = y.reshape(n, -1) if kind != "logistic" else y
    s0 = output_scale(lik).detach()
    groups = resolve_groups(net)
    got = FullCurvature.from_jacobian(groups, torch.ones(groups.num_groups, dtype=torch.float64), j, lik, f, yy,
                                      s0, fisher, chunk_size=5).components
    jn = j.reshape(n, c, -1)
    if fisher:
        g = unit_gradient(lik, f, yy, s0)
        if c > 1:
            expected = torch.einsum("na,nap,nb,nbq->abpq", g, jn, g, jn).flatten(0, 1)
        else:
            rows = torch.einsum("nc,ncp->np", g, jn)
            expected = (rows.T @ rows)[None]
    elif c > 1:
        expected = torch.einsum("ncp,ncq->cpq", jn, jn)
    else:
        root = unit_hessian_sqrt(lik, f, yy, s0)
        rows = torch.einsum("ncp,ncm->nmp", jn, root).reshape(-1, jn.shape[-1])
        expected = (rows.T @ rows)[None]
    if not (fisher and c > 1):  # the per-output EF's components D_ab are transposes of D_ba
        assert torch.equal(got, got.mT)
    assert rel_err(got, expected) < 1e-13
