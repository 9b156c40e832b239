"""Property-based tests of train_marglik (2 epochs), compute_curvature and the metrics (see tests/fuzz/common.py).

Every network kind is drawn with every structure (BatchNorm in eval mode and KFAC on the CNN included). A call
that succeeds is checked against the brute-force Laplace evidence of tests/fuzz/reference.py at the weights and
hyperparameters it returns (full and diagonal GGN / empirical Fisher: equal; KFAC, whose factors the reference
does not rebuild: at most the brute-force log joint, as for any positive semi-definite curvature)."""

from __future__ import annotations

import copy
import math

import gpytorch
import torch
from hypothesis import given
from hypothesis import strategies as st

from ntkgp import metrics
from ntkgp.laplace.weight_space import compute_curvature
from ntkgp.training import train_marglik
from tests.fuzz import reference
from tests.fuzz.common import (
    ACCEPTED_INPUT_CORRUPTIONS,
    ACCEPTED_LABEL_CORRUPTIONS,
    INPUT_CORRUPTIONS,
    LABEL_CORRUPTIONS,
    check_call,
    corrupt_inputs,
    corrupt_labels,
    dtypes,
    fuzz_settings,
    inputs,
    labels,
    make_network,
    networks,
)
from tests.fuzz.test_fuzz_models import likelihood
from tests.helpers import EPS32, float32_roundings

BAD_ARGUMENTS = {
    "epochs": [0, 1.5, -1],
    "batch_size": [0, 2.5, -2],
    "hyper_lr": [0.0, -1.0, float("nan"), float("inf")],
    "lr": [0.0, float("nan")],
    "structure": ["ggn", "kfc", 3],
    "prior_precision": [0.0, -1.0, float("nan")],
    "frequency": [0, 0.5],
    "hyper_steps": [-1, 1.5],
}


@st.composite
def training_problem(draw, structures):
    lik_kind = draw(st.sampled_from(["gaussian", "logistic", "softmax"]))
    outputs = {"gaussian": 1, "logistic": 1, "softmax": 2}[lik_kind]
    dtype = draw(dtypes)
    kind = draw(networks)
    network = make_network(kind, outputs, dtype, seed=draw(st.integers(0, 2)))
    n = draw(st.integers(3, 6))
    x, y = inputs(network, n, dtype, 20), labels(lik_kind, n, outputs, dtype, 21)
    structure = draw(st.sampled_from(structures))
    corruption = draw(st.sampled_from([None, None, "train_x", "train_y", *BAD_ARGUMENTS]))
    kwargs, names, accepted, detail = {}, [], False, None
    if corruption == "train_x":
        detail = draw(st.sampled_from([k for k in INPUT_CORRUPTIONS if k != "empty"]))
        x, accepted = corrupt_inputs(x, detail, draw(st.integers(0, 5))), detail in ACCEPTED_INPUT_CORRUPTIONS
        names = ["train_x", "x"]
    elif corruption == "train_y":
        detail = draw(st.sampled_from(LABEL_CORRUPTIONS))
        y = corrupt_labels(y, detail, lik_kind, outputs, draw(st.integers(0, 5)))
        accepted, names = detail in ACCEPTED_LABEL_CORRUPTIONS, ["train_y", "y"]
    elif corruption is not None:
        kwargs[corruption] = draw(st.sampled_from(BAD_ARGUMENTS[corruption]))
        names = [corruption]
    return network, x, y, likelihood(lik_kind, outputs, dtype), structure, kwargs, corruption, names, accepted


@fuzz_settings(12)
@given(problem=training_problem(["full_ggn", "full_ef", "kfac", "diag_ggn", "diag_ef"]))
def test_train_marglik(problem):
    network, x, y, lik, structure, kwargs, corruption, names, accepted = problem
    options = {
        "structure": structure,
        "epochs": 2,
        "burn_in": 0,
        "frequency": 1,
        "hyper_steps": 2,
        "progress": False,
    }
    if structure != "kfac":
        options["prior_structure"] = "network"
    options.update(kwargs)
    result = check_call(
        lambda: train_marglik(network.net, x, y, lik, **options),
        network.net,
        [x, y],
        corruption,
        names,
        accepted,
        trains=True,
    )
    if result is None:  # a corrupted call, refused as check_call requires
        return
    structure = options["structure"]
    prior_structure = options.get("prior_structure", "layer")
    for p in network.net.parameters():
        assert bool(torch.isfinite(p).all())
    delta = result.prior_precision
    assert bool(torch.isfinite(delta).all() and (delta > 0).all())
    assert math.isfinite(result.log_evidence) and result.best_epoch in (1, 2)
    _check_evidence(network, x, y, result.likelihood, structure, prior_structure, delta, result.log_evidence * len(y))


def _check_evidence(network, x, y, lik, structure, prior_structure, delta, value):
    """``value`` (a total log evidence at the network's weights) against the brute-force Laplace evidence of
    tests/fuzz/reference.py (full and diagonal structures), or below the brute-force log joint (KFAC: its
    curvature is positive semi-definite, so its Occam factor is at most 1)."""
    x = torch.as_tensor(x)
    if next(network.net.parameters()).dtype == torch.float32:
        # the first-order float32 error model of _float32_evidence_tolerance (measured: 5e-5 to 5e-3 on these
        # evidences of magnitude 3 to 15; actual float32 errors 4e-8 to 5e-7); it must stay far below a 1 % error
        tolerance = _float32_evidence_tolerance(network.net, x, y, lik, structure, delta, value)
        assert tolerance < 5e-3 * max(1.0, abs(value)), (tolerance, value)
    else:
        tolerance = 1e-7 * (1 + abs(value))  # float64 against float64 (measured: below 4e-9)
    if structure == "kfac":
        assert value <= reference.log_joint(network.net, x, y, lik, prior_structure, delta) + tolerance
    else:
        expected = reference.laplace_evidence(network.net, x, y, lik, structure, prior_structure, delta)
        assert abs(value - expected) <= tolerance, (value, expected)


def _float32_evidence_tolerance(net, x, y, lik, structure, delta, value) -> float:
    r"""A first-order bound on how far a float32 network's Laplace evidence (or, for KFAC, its data fit and prior
    term) may be from the float64 reference at the same weights, with everything measured here on the float64
    reference (the error model of :func:`tests.helpers.float32_laplace_tolerances`, written out because that
    helper covers only the GGN with one δ, and these cases also have the empirical Fisher, diagonals and KFAC).

    With ε = ε32, ``r`` from :func:`float32_roundings`, per-example sites :math:`g_n = \nabla_f\log p`,
    :math:`\Lambda_n = -\nabla^2_f\log p` and :math:`|\Delta f_n| \le r\epsilon(|f_n| + \lVert J_n\rVert
    \lVert\theta\rVert)`: the curvature's per-example factor :math:`M_n` is :math:`\Lambda_n` (GGN; it moves by
    :math:`8\max|\Delta f_n|\lVert\Lambda_n\rVert` for softmax or logistic sites, 0 for Gaussian) or
    :math:`g_ng_n^\top` (empirical Fisher; it moves by :math:`2\lVert g_n\rVert\lVert\Lambda_n\rVert
    \lVert\Delta f_n\rVert` since :math:`\Delta g_n = -\Lambda_n\Delta f_n`), so
    :math:`\lVert\Delta H\rVert \le \sum_n\lVert J_n\rVert_F^2((2r + \log_2 NC)\epsilon\lVert M_n\rVert
    + \lVert\Delta M_n\rVert) + (n + 1)\epsilon(\lVert H\rVert + \delta_{\max})`; a diagonal's entries
    satisfy :math:`|\Delta H_{ii}| \le \lVert\Delta H\rVert` and :math:`H_{ii} + \delta \ge \lambda_{\min}`.
    KFAC's factors are sums of outer products of the same rounded activations and backpropagated gradients that
    form the Jacobian rows, and its log-determinant (:math:`\ge 0` exactly) is bounded the same way with the
    GGN's :math:`\lVert H\rVert`. The evidence then moves by at most :math:`\lVert g\rVert\lVert\Delta f\rVert
    + \tfrac12 n\lVert\Delta H\rVert/\lambda_{\min}(H + P_0)` (:math:`n = \min(NC, P)` for a full structure,
    the dimension factorized; :math:`|\Delta\log\det| = |\operatorname{tr}((H + P_0)^{-1}\Delta H)|`, and a
    diagonal's :math:`\sum_i|\Delta H_{ii}|` is within the per-example sum), plus the float32 roundings of the
    terms summed into it: :math:`(\log_2(N + P) + 4)\epsilon` times the sum of their magnitudes (the log
    likelihoods with their constants and largest logit, the prior term, the log-determinants of :math:`H + P_0` and
    of :math:`P_0`, the value). δ per group (``prior_structure="layer"``) enters through :math:`\lambda_{\min}
    \ge \delta_{\min}` (the conservative side: a smaller δ only enlarges the bound) and :math:`\delta_{\max}` in the
    factorization's error."""
    eps, r = EPS32, float32_roundings(net)
    x64 = x.double()
    jac, _ = reference.jacobian(net, x64)  # (N·C, P), float64, trainable weights
    net64 = copy.deepcopy(net).double()
    with torch.no_grad():
        f = net64(x64).reshape(x.shape[0], -1)
    n_data, c = f.shape
    jn = jac.reshape(n_data, c, -1)
    theta = torch.cat([p.detach().double().reshape(-1) for p in net64.parameters() if p.requires_grad])

    def point(fn: torch.Tensor, i: int) -> torch.Tensor:
        return reference.log_likelihoods(lik, fn[None], y.reshape(y.shape[0], -1)[i : i + 1]).sum()

    g = torch.stack([torch.func.grad(point)(f[i], i) for i in range(n_data)])  # (N, C)
    lam = torch.stack([-torch.func.hessian(point)(f[i], i) for i in range(n_data)])  # (N, C, C)
    log_p = reference.log_likelihoods(lik, f, y)
    gaussian = isinstance(lik, gpytorch.likelihoods.GaussianLikelihood)
    df = r * eps * (f.abs() + jn.norm(dim=-1) * theta.norm())  # (N, C): |Δf_nc|
    lam_n = torch.linalg.matrix_norm(lam, ord=2)
    if structure.endswith("_ef"):
        factor = g[:, :, None] * g[:, None, :]
        d_factor = 2 * g.norm(dim=-1) * lam_n * df.norm(dim=-1)
    else:  # GGN (full, diagonal, KFAC)
        factor = lam
        d_factor = (0.0 if gaussian else 8.0) * df.amax(-1) * lam_n
    row_f2 = jn.square().sum((1, 2))  # ‖J_n‖_F²
    curvature = torch.einsum("ncp,ncd,ndq->pq", jn, factor, jn)
    delta = delta.detach().double().reshape(-1)
    d_min, d_max = delta.min().item(), delta.max().item()
    dim = min(n_data * c, theta.numel())
    norm_h = torch.linalg.matrix_norm(curvature, ord=2).item()
    dh = (row_f2 * ((2 * r + math.log2(n_data * c)) * eps * torch.linalg.matrix_norm(factor, ord=2) + d_factor)
          ).sum().item() + (dim + 1) * eps * (norm_h + d_max)
    full = structure.startswith("full")
    lam_min = d_min + (torch.linalg.eigvalsh(curvature)[0].clamp_min(0).item() if full else 0.0)
    # magnitudes of the terms the float32 value sums (each carries a few relative roundings)
    if gaussian:
        constants = 0.5 * abs(math.log(2 * math.pi * lik.noise.item())) * n_data
    else:
        constants = f.abs().amax(-1).sum().item()
    log_det = torch.linalg.slogdet(curvature + d_min * torch.eye(theta.numel(), dtype=torch.float64))[1].item()
    magnitude = (log_p.abs().sum().item() + constants + 0.5 * d_max * theta.square().sum().item()
                 + 0.5 * (abs(log_det) + theta.numel() * abs(math.log(d_min))) + abs(value))
    roundings = (math.log2(n_data + theta.numel()) + 4) * eps * magnitude
    return (g.norm() * df.norm()).item() + 0.5 * dim * dh / lam_min + roundings


@fuzz_settings(15)
@given(
    problem=training_problem(["kfac", "diag_ggn", "diag_ef"]),
    delta=st.sampled_from([1.0, 0.0, float("nan"), "2", True]),
)
def test_compute_curvature(problem, delta):
    network, x, y, lik, structure, kwargs, corruption, names, accepted = problem
    if corruption not in (None, "train_x", "train_y", "structure"):
        corruption, names = None, []
    if corruption == "structure":
        structure = kwargs.pop("structure")
        names = ["structure"]
    prior_structure = "layer"
    curvature = check_call(
        lambda: compute_curvature(
            network.net,
            x,
            y,
            lik,
            structure,
            prior_structure=prior_structure,
            batch_size=2,
            input_shape=network.input_shape,
        ),
        network.net,
        [x, y],
        corruption,
        [*names, "x", "y"],
        accepted,
    )
    if curvature is None:  # a corrupted call, refused as check_call requires
        return
    bad = None if delta == 1.0 and delta is not True else "prior_precision"
    check_call(lambda: curvature.log_marginal_likelihood(delta, lik), network.net, [], bad, ["prior_precision"])
    # whatever delta was drawn, the curvature's evidence at δ = 1 against the brute-force one
    value = check_call(lambda: curvature.log_marginal_likelihood(1.0, lik).detach(), network.net, [], None)
    groups = len(set(reference.group_labels(network.net, prior_structure)[1]))
    _check_evidence(network, x, y, lik, structure, prior_structure, torch.ones(groups), float(value))


METRIC_CORRUPTIONS = [
    None,
    "nan",
    "shape",
    "negative_var",
    "labels_out",
    "labels_fraction",
    "empty",
    "integer",
    "list",
]


@fuzz_settings(40)
@given(data=st.data())
def test_metrics(data):
    n, c = data.draw(st.integers(1, 5)), data.draw(st.integers(2, 4))
    dtype = data.draw(dtypes)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 9)))
    probs = torch.softmax(torch.randn(n, c, generator=g), -1).to(dtype)
    y_cls = torch.randint(0, c, (n,), generator=g)
    mean, var, y_reg = (
        torch.randn(n, generator=g).to(dtype),
        torch.rand(n, generator=g).to(dtype) + 0.1,
        torch.randn(n).to(dtype),
    )
    corruption = data.draw(st.sampled_from(METRIC_CORRUPTIONS))
    name = None
    if corruption == "nan":
        name = data.draw(st.sampled_from(["probs", "mean", "var", "y"]))
        target = {"probs": probs, "mean": mean, "var": var, "y": y_reg}[name].clone()
        target.reshape(-1)[0] = float("nan")
        probs, mean, var, y_reg = [
            target if k == name else v
            for k, v in (("probs", probs), ("mean", mean), ("var", var), ("y", y_reg))
        ]
    elif corruption == "shape":
        name, y_cls, y_reg = "y", torch.cat([y_cls, y_cls]), torch.cat([y_reg, y_reg])
    elif corruption == "negative_var":
        name, var = "var", -var
    elif corruption == "labels_out":
        name, y_cls = "y", y_cls.clone().fill_(c)
    elif corruption == "labels_fraction":
        name, y_cls = "y", y_cls.to(dtype) + 0.5
    elif corruption == "empty":
        name, probs, y_cls, mean, var, y_reg = "all", probs[:0], y_cls[:0], mean[:0], var[:0], y_reg[:0]
    metric = data.draw(
        st.sampled_from(
            [
                "gaussian_nlpd",
                "rmse",
                "categorical_nlpd",
                "accuracy",
                "expected_calibration_error",
                "brier_score",
                "predictive_entropy",
            ]
        )
    )
    regression = metric in ("gaussian_nlpd", "rmse")
    if corruption == "integer":
        name, probs, mean = ("mean" if regression else "probs"), (probs > 0.5).long(), mean.long()
    elif corruption == "list":
        name, probs, mean = ("mean" if regression else "probs"), probs.tolist(), mean.tolist()
    calls = {
        "gaussian_nlpd": lambda: metrics.gaussian_nlpd(mean, var, y_reg),
        "rmse": lambda: metrics.rmse(mean, y_reg),
        "categorical_nlpd": lambda: metrics.categorical_nlpd(probs, y_cls),
        "accuracy": lambda: metrics.accuracy(probs, y_cls),
        "expected_calibration_error": lambda: metrics.expected_calibration_error(probs, y_cls),
        "brier_score": lambda: metrics.brier_score(probs, y_cls),
        "predictive_entropy": lambda: metrics.predictive_entropy(probs),
    }
    uses = {
        "gaussian_nlpd": {"mean", "var", "y"},
        "rmse": {"mean", "y"},
        "predictive_entropy": {"probs"},
    }.get(metric, {"probs", "y"})
    if (
        name is not None
        and name != "all"
        and name not in uses
        or (corruption in ("labels_out", "labels_fraction") and regression)
        or (
            corruption == "nan" and name == "y" and not regression
        )  # the NaN went into the regression targets
    ):
        corruption = None  # the corrupted argument is not one this metric takes
    names = {"probs": ["probs"], "mean": ["mean", "pred"], "var": ["var"], "y": ["y"]}.get(name, [])
    if corruption == "empty":
        names = ["mean", "pred", "y", "var", "probs"]
    args = [probs, mean, var, y_reg, y_cls]
    accepted = corruption == "integer" and regression  # integer predictions are numbers too
    net = torch.nn.Linear(1, 1)
    check_call(calls[metric], net, args, corruption, names, accepted)
