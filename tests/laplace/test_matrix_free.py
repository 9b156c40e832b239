"""The matrix-free evidence: NTK products against brute-force Jacobians, the operators' products and bilinear
derivatives against dense autograd, the Nyström preconditioner, and the CG/SLQ evidence and gradient against the
dense Cholesky route within stated Monte Carlo/CG tolerances that tighten with the settings."""

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.laplace.function_space import (
    EvidenceOptions,
    LaplaceSiteOperator,
    MatrixFreeNTKOperator,
    NTKProducts,
    evidence_method,
    laplace_log_marginal_likelihood,
    matrix_free_log_det,
)
from ntkgp.laplace.function_space.evidence import curvature_factor
from ntkgp.ntk import NTKEngine
from tests.helpers import assert_unchanged, brute_jacobian, mlp, rel_err, small_cnn, snapshot
from tests.problems import learnable_problem as make_problem

DELTA = torch.tensor([0.5, 2.0, 4.0], dtype=torch.float64)

#: Settings from loose to tight, and the tolerances the tight ones meet (relative errors, mean over 3 seeds).
LOOSE = {"num_probes": 4, "cg_tolerance": 1.0, "preconditioner_rank": 0, "lanczos_iterations": 10}
MEDIUM = {"num_probes": 16, "cg_tolerance": 1e-2, "preconditioner_rank": 10, "lanczos_iterations": 20}
TIGHT = {"num_probes": 64, "cg_tolerance": 1e-4, "preconditioner_rank": 20, "lanczos_iterations": 40}
VALUE_TOL, GRAD_TOL = 1e-3, 1e-2


def networks():
    torch.manual_seed(0)
    return {
        "mlp-structured": (mlp(d_out=3), "auto", torch.randn(9, 3, dtype=torch.float64)),
        "mlp-contraction": (mlp(d_out=3), "contraction", torch.randn(9, 3, dtype=torch.float64)),
        "cnn": (small_cnn(3), "auto", torch.randn(7, 1, 6, 6, dtype=torch.float64)),
    }


@pytest.mark.parametrize("case", ["mlp-structured", "mlp-contraction", "cnn"])
def test_products_match_brute_force_jacobians(case):
    net, strategy, x = networks()[case]
    before = snapshot(net)
    engine = NTKEngine(net, prior_structure="parameter", strategy=strategy, chunk_size=4)
    products = engine.products(x)
    if case == "mlp-structured":
        assert len(products.layers) == 3 and products.generic == []
    if case == "cnn":
        assert products.generic  # the convolution and the BatchNorm take the torch.func route
    j, _ = brute_jacobian(net, x)
    v = torch.randn(j.shape[0], 5, dtype=torch.float64)
    t = products.transpose(v)
    assert rel_err(torch.cat(t), j.T @ v) < 1e-12
    u = [torch.randn_like(ti) for ti in t]
    assert rel_err(products.apply(u), j @ torch.cat(u)) < 1e-12
    w = torch.rand(engine.num_groups, dtype=torch.float64)
    cols = engine.groups.column_groups()
    assert rel_err(products.matvec(v, w), (j * w[cols]) @ (j.T @ v)) < 1e-12
    inner = torch.zeros(engine.num_groups, dtype=torch.float64).index_add_(
        0, cols, (torch.cat(t) * torch.cat(u)).sum(-1)
    )
    assert rel_err(products.group_inner(t, u), inner) < 1e-12
    assert_unchanged(net, before)


def dense_kernel(net, x, delta, groups):
    j, _ = brute_jacobian(net, x)
    return (j * delta.reciprocal()[groups]) @ j.T


def test_kernel_operator_products_diagonal_and_derivative():
    net, _, x = networks()["mlp-structured"]
    engine = NTKEngine(net, prior_structure="layer")
    cols = engine.groups.column_groups()
    delta = DELTA.clone().requires_grad_(True)
    op = MatrixFreeNTKOperator(delta, engine.products(x))
    dense = dense_kernel(net, x, delta, cols)
    v = torch.randn(dense.shape[0], 4, dtype=torch.float64)
    assert rel_err(op.matmul(v), dense.detach() @ v) < 1e-12
    assert rel_err(op.diagonal(), dense.detach().diagonal()) < 1e-12
    left, right = torch.randn_like(v), torch.randn_like(v)
    (grad,) = op._bilinear_derivative(left, right)
    (ref,) = torch.autograd.grad((left * (dense @ right)).sum(), delta)
    assert rel_err(grad, ref) < 1e-12


def test_site_operator_products_and_bilinear_derivative():
    net, _, x = networks()["mlp-structured"]
    engine = NTKEngine(net, prior_structure="layer")
    cols = engine.groups.column_groups()
    n = x.shape[0]
    factor = torch.randn(n, 3, 3, dtype=torch.float64, requires_grad=True)  # any (N, C, k) blocks
    delta = DELTA.clone().requires_grad_(True)
    op = LaplaceSiteOperator(factor, delta, engine.products(x))
    big_l = torch.block_diag(*factor)  # (N·C, N·k), independent of ntkgp's block algebra
    dense = torch.eye(3 * n, dtype=torch.float64) + big_l.T @ dense_kernel(net, x, delta, cols) @ big_l
    v = torch.randn(3 * n, 6, dtype=torch.float64)
    assert rel_err(op.matmul(v), dense.detach() @ v) < 1e-12
    assert rel_err(op.diagonal(), dense.detach().diagonal()) < 1e-12
    left, right = torch.randn_like(v), torch.randn_like(v)
    grads = op._bilinear_derivative(left, right)
    refs = torch.autograd.grad((left * (dense @ right)).sum(), [factor, delta])
    for g, r in zip(grads, refs):
        assert rel_err(g, r) < 1e-12


def test_nystrom_preconditioner():
    net, _, x = networks()["mlp-structured"]
    engine = NTKEngine(net, prior_structure="layer")
    n = x.shape[0]
    factor = torch.randn(n, 3, 3, dtype=torch.float64)
    products = engine.products(x)
    generator = torch.Generator().manual_seed(0)
    dense = LaplaceSiteOperator(factor, DELTA, products).to_dense()
    # full rank: P = B (up to the shift)
    full = LaplaceSiteOperator(
        factor, DELTA, products, preconditioner_rank=3 * n, generator=generator
    ).nystrom()
    assert rel_err(full.log_det(), torch.linalg.slogdet(dense)[1]) < 1e-8
    # low rank: I ⪯ P ⪯ B, and the closure solves with P
    low = LaplaceSiteOperator(factor, DELTA, products, preconditioner_rank=5, generator=generator).nystrom()
    p = low.to_dense()
    assert torch.linalg.eigvalsh(p).min() > 1 - 1e-10
    assert torch.linalg.eigvalsh(dense - p).min() > -1e-8 * dense.diagonal().max()
    rhs = torch.randn(3 * n, 2, dtype=torch.float64)
    assert rel_err(low.solve_closure()(rhs), torch.linalg.solve(p, rhs)) < 1e-10
    assert rel_err(low.log_det(), torch.linalg.slogdet(p)[1]) < 1e-10


def errors(model, settings, seeds=range(3)):
    """Mean relative errors of the matrix-free value and gradient against the Cholesky route."""
    params = [p for p in model.hyperparameters() if p.requires_grad]
    ref = model.log_marginal_likelihood(method="cholesky")
    ref_grads = torch.autograd.grad(ref, params)
    value_errors, grad_errors = [], []
    for seed in seeds:
        value = model.log_marginal_likelihood(
            method="matrix_free", options=EvidenceOptions(seed=seed, **settings)
        )
        grads = torch.autograd.grad(value, params)
        value_errors.append(rel_err(value.detach(), ref.detach()))
        grad_errors.append(max(rel_err(g, r) for g, r in zip(grads, ref_grads)))
    return sum(value_errors) / len(value_errors), sum(grad_errors) / len(grad_errors)


@pytest.mark.parametrize("kind", ["regression1", "softmax3"])
def test_evidence_and_gradient_agree_with_cholesky_and_tighten(kind):
    net, x, y, lik = make_problem(kind, n=40)
    model = ntkgp.NTKGP(
        net, x, y, lik, prior_precision=DELTA
    )  # per-layer δ and a learnable noise/temperature
    assert len([p for p in model.hyperparameters() if p.requires_grad]) == 2
    loose, medium, tight = (errors(model, s) for s in (LOOSE, MEDIUM, TIGHT))
    assert tight[0] < VALUE_TOL and tight[1] < GRAD_TOL
    assert tight[0] < medium[0] < loose[0]
    assert tight[1] < medium[1] < loose[1]


def test_more_probes_alone_shrink_the_error():
    net, x, y, lik = make_problem("softmax3", n=40)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    few = errors(model, {"num_probes": 4, "cg_tolerance": 1e-3, "preconditioner_rank": 0})
    many = errors(model, {"num_probes": 256, "cg_tolerance": 1e-3, "preconditioner_rank": 0})
    assert many[0] < few[0] and many[1] < few[1]
    assert many[1] < 0.5 * few[1]  # ~1/√t: 8× fewer errors expected, half is asserted


def test_auto_goes_matrix_free_beyond_the_memory_limit(monkeypatch):
    net, x, y, lik = make_problem("binary", n=30)
    before = snapshot(net)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    options = EvidenceOptions(dense_memory_limit=0, seed=0, **TIGHT)
    assert evidence_method(model.covar_module, lik, x, model.train_outputs, options=options) == "matrix_free"
    from ntkgp.laplace.function_space import evidence

    calls = []
    original = evidence.matrix_free_log_det
    monkeypatch.setattr(evidence, "matrix_free_log_det", lambda *a, **k: calls.append(1) or original(*a, **k))
    value = model.log_marginal_likelihood(options=options)
    assert calls == [1]
    assert rel_err(value.detach(), model.log_marginal_likelihood(method="cholesky").detach()) < VALUE_TOL
    assert_unchanged(net, before)


def test_a_seed_reproduces_value_and_gradient():
    net, x, y, lik = make_problem("softmax3", n=20)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    params = [p for p in model.hyperparameters() if p.requires_grad]
    runs = []
    for _ in range(2):
        value = model.log_marginal_likelihood(method="matrix_free", options=EvidenceOptions(seed=3, **MEDIUM))
        runs.append([value.detach(), *torch.autograd.grad(value, params)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_gpytorch_settings_are_used_when_options_leave_them_open():
    net, x, y, lik = make_problem("regression1", n=30)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    factor = curvature_factor(lik, model.train_outputs, model.train_y)
    kernel = model.covar_module
    seen = []
    original = LaplaceSiteOperator._probe_vectors_and_norms

    def spy(self):
        probes = original(self)
        seen.append((probes[0].shape[-1], self.preconditioner_rank))
        return probes

    LaplaceSiteOperator._probe_vectors_and_norms = spy
    try:
        with gpytorch.settings.num_trace_samples(7), gpytorch.settings.max_preconditioner_size(3):
            matrix_free_log_det(kernel, x, factor, EvidenceOptions(seed=0))
        matrix_free_log_det(kernel, x, factor, EvidenceOptions(seed=0, num_probes=5, preconditioner_rank=2))
    finally:
        LaplaceSiteOperator._probe_vectors_and_norms = original
    assert seen == [(7, 3), (5, 2)]


def test_float32_runs_and_is_close():
    net, x, y, lik = make_problem("softmax3", n=30, dtype=torch.float32)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA.float())
    ref = model.log_marginal_likelihood(method="cholesky")
    value = model.log_marginal_likelihood(method="matrix_free", options=EvidenceOptions(seed=0, **TIGHT))
    assert value.dtype == torch.float32
    assert rel_err(value.detach(), ref.detach()) < 1e-2


def test_invalid_uses_are_named():
    net, x, y, lik = make_problem("regression1", n=10)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    kernel, f = model.covar_module, model.train_outputs
    x_grad = x.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="x requires grad"):
        laplace_log_marginal_likelihood(kernel, lik, x_grad, f, model.train_y, method="matrix_free")
    with pytest.raises(ValueError, match="factor"):
        matrix_free_log_det(kernel, x, torch.ones(3, 1, 1, dtype=torch.float64))
    for field, bad in [
        ("num_probes", 0),
        ("cg_tolerance", -1.0),
        ("preconditioner_rank", -1),
        ("seed", 1.5),
        ("dense_memory_limit", -1),
        ("lanczos_iterations", True),
    ]:
        with pytest.raises(ValueError, match=field):
            EvidenceOptions(**{field: bad})


def test_empirical_fisher_sites():
    net, x, y, lik = make_problem("softmax3", n=40)
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=DELTA)
    params = [p for p in model.hyperparameters() if p.requires_grad]
    ref = model.log_marginal_likelihood(curvature="ef", method="cholesky")
    ref_grads = torch.autograd.grad(ref, params)
    options = EvidenceOptions(seed=0, **TIGHT)
    value = model.log_marginal_likelihood(curvature="ef", method="matrix_free", options=options)
    grads = torch.autograd.grad(value, params)
    assert rel_err(value.detach(), ref.detach()) < VALUE_TOL
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < GRAD_TOL
