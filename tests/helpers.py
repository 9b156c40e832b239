"""Independent reference computations and small networks shared by the tests."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn


def mlp(d_in: int = 3, width: int = 7, d_out: int = 1, depth: int = 2, dtype=torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.Tanh()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers).to(dtype)


class SmallCNN(nn.Module):
    """Conv → BatchNorm → ReLU → pooling → Linear, on (N, 1, 6, 6) images."""

    def __init__(self, c_out: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3 * 2 * 2, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(nn.functional.avg_pool2d(h, 2).flatten(1))


def small_cnn(c_out: int = 2, dtype=torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = SmallCNN(c_out).to(dtype)
    net.train()
    with torch.no_grad():  # give the BatchNorm statistics non-trivial values, then freeze them
        for _ in range(3):
            net(torch.randn(16, 1, 6, 6, dtype=dtype))
    net.bn.weight.data.uniform_(0.5, 1.5)
    net.bn.bias.data.uniform_(-0.5, 0.5)
    return net.eval()


def brute_jacobian(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """``J`` (N·C, P) row by row with ``torch.autograd.grad``; columns over trainable parameters in order."""
    net = copy.deepcopy(net)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        f = net(x[i : i + 1])[0]
        for c in range(f.shape[0]):
            grads = torch.autograd.grad(f[c], [p for _, p in named], retain_graph=True, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, (_, p) in zip(grads, named)]))
    return torch.stack(rows).detach(), [n for n, _ in named]


def column_groups(net: nn.Module, labels: dict[str, int]) -> torch.Tensor:
    """Group index per Jacobian column from a name → group map (independent of ntkgp's grouping code)."""
    cols = [torch.full((p.numel(),), labels[n]) for n, p in net.named_parameters() if p.requires_grad]
    return torch.cat(cols)


def brute_gram(net: nn.Module, x1: torch.Tensor, x2: torch.Tensor, delta: torch.Tensor, labels: dict[str, int]) -> torch.Tensor:
    """``Σ_g δ_g⁻¹ J_g(x1) J_g(x2)ᵀ`` from brute-force Jacobians."""
    j1, _ = brute_jacobian(net, x1)
    j2, _ = brute_jacobian(net, x2)
    w = delta.reciprocal()[column_groups(net, labels)]
    return (j1 * w) @ j2.T


def snapshot(net: nn.Module) -> dict:
    """Everything about a network that ntkgp must leave unchanged."""
    return {
        "state": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "requires_grad": {n: p.requires_grad for n, p in net.named_parameters()},
        "training": {n: m.training for n, m in net.named_modules()},
        "dtypes": {n: p.dtype for n, p in net.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()},
        "hooks": sum(len(m._forward_hooks) + len(m._backward_hooks) for m in net.modules()),
    }


def assert_unchanged(net: nn.Module, before: dict) -> None:
    after = snapshot(net)
    assert after["requires_grad"] == before["requires_grad"]
    assert after["training"] == before["training"]
    assert after["dtypes"] == before["dtypes"]
    assert after["hooks"] == before["hooks"]
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k
    for k, v in before["grads"].items():
        assert (after["grads"][k] is None) == (v is None), k


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def reference_log_prob(kind: str, f: torch.Tensor, y: torch.Tensor, noise=None, temperature: float = 1.0) -> torch.Tensor:
    """Per-example log p(y|f) from torch.distributions, written independently of ntkgp.likelihoods."""
    if kind == "gaussian":
        return torch.distributions.Normal(f, noise.sqrt()).log_prob(y.reshape(f.shape)).sum(-1)
    if kind == "logistic":
        return torch.distributions.Bernoulli(logits=f[..., 0]).log_prob(y.reshape(-1).to(f)) / temperature
    if kind == "softmax":
        return torch.distributions.Categorical(logits=f).log_prob(y.reshape(-1)) / temperature
    raise ValueError(kind)


def reference_terms(log_prob, f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example g = ∇f log p and Λ = −∇²f log p by autograd."""
    gs, lams = [], []
    for n in range(f.shape[0]):
        def fn(fn_, n=n):
            return log_prob(fn_.unsqueeze(0), y[n : n + 1]).sum()
        gs.append(torch.autograd.functional.jacobian(fn, f[n]))
        lams.append(-torch.autograd.functional.hessian(fn, f[n]))
    return torch.stack(gs), torch.stack(lams)


def dense_laplace(net, x, y, log_prob, delta_cols: torch.Tensor, curvature: str = "ggn") -> dict:
    """The weight-space Laplace-GGN quantities with dense P×P matrices (the reference for ntkgp)."""
    j, _ = brute_jacobian(net, x)
    with torch.no_grad():
        f = net(x)
    n, c = f.shape
    g, lam = reference_terms(log_prob, f, y)
    jn = j.reshape(n, c, -1)
    if curvature == "ggn":
        curv = torch.einsum("ncp,ncd,ndq->pq", jn, lam, jn)
    else:
        grads = torch.einsum("nc,ncp->np", g, jn)
        curv = grads.T @ grads
    h = curv + torch.diag(delta_cols)
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.requires_grad])
    evidence = (
        log_prob(f, y).sum()
        - 0.5 * (delta_cols * theta**2).sum()
        + 0.5 * delta_cols.log().sum()
        - 0.5 * torch.linalg.slogdet(h)[1]
    )
    grad_joint = torch.einsum("nc,ncp->p", g, jn) - delta_cols * theta
    return {"evidence": evidence, "H": h, "step": torch.linalg.solve(h, grad_joint), "f": f}


def dense_glm_predictive(net, x_test, laplace: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean f(x*) + J*(θ_post − θ*) and covariance J* H⁻¹ J*ᵀ (interleaved), from dense matrices."""
    j, _ = brute_jacobian(net, x_test)
    with torch.no_grad():
        f = net(x_test)
    mean = f.reshape(-1) + j @ laplace["step"]
    cov = j @ torch.linalg.solve(laplace["H"], j.T)
    return mean, cov


def attains_optimum(grid: torch.Tensor, values: torch.Tensor, chosen: torch.Tensor, maximize: bool = True) -> bool:
    """Whether ``chosen`` (a point of ``grid``) attains the optimum of the reference ``values`` on the grid up to
    float64 rounding (1e-9 relative: the library and the reference are two computations of the same objective, so
    grid points tied to that precision may be chosen either way); the argmax itself is not compared bit for bit."""
    values = values.detach().reshape(-1)
    hit = (grid == chosen.reshape(()))
    if not bool(hit.any()):
        return False
    best = values.max() if maximize else values.min()
    slack = 1e-9 * (1 + best.abs())
    value = values[hit][0]
    return bool(value >= best - slack) if maximize else bool(value <= best + slack)


EPS32 = torch.finfo(torch.float32).eps


def float32_roundings(net: nn.Module, layers: int | None = None) -> float:
    r"""The growth factor :math:`r = 2L + 2 + \log_2 P` of a float32 network's outputs and Jacobian rows (``L``
    parametrized layers, ``P`` parameters): a rounding forward and one backward through each layer, the weights and
    inputs rounded once more, and a blocked or pairwise sum over ``P`` products (:math:`\log_2 P` roundings). A
    float32 evaluation gives :math:`|\Delta J_n| \le r\epsilon\lVert J_n\rVert` per row and
    :math:`|\Delta f_n| \le r\epsilon(|f_n| + \lVert J_n\rVert\lVert\theta\rVert)` per output (the last layer's
    sum :math:`|W||h| + |b|` is bounded by its Jacobian row times the weights, which covers a cancelling sum).
    ``layers`` overrides ``L`` for a network that applies its modules several times in sequence (a recurrent
    cell once per step, attention's products and softmax between its projections)."""
    if layers is None:
        layers = sum(1 for m in net.modules() if any(True for _ in m.parameters(recurse=False)))
    params = sum(p.numel() for p in net.parameters())
    return 2 * layers + 2 + math.log2(params)


@torch.enable_grad()  # the dense references use autograd, also when called under torch.no_grad()
def float32_laplace_tolerances(net: nn.Module, x, y, log_prob, x_test, delta: float = 1.0,
                               gaussian: bool = True, mode: bool = False, roundings: float | None = None) -> dict:
    r"""First-order bounds on how far a float32 Laplace-GGN / GLM model (NTKGP in either space, a weight-space
    posterior) may be from the same model on a float64 copy of ``net``, with every quantity measured on dense
    float64 references (:func:`brute_jacobian`, :func:`dense_laplace`): ``mean`` and ``variance`` are relative
    (normwise over the test points), ``evidence`` is absolute.

    Error model (ε = ε32 = 2⁻²³, ``r`` from :func:`float32_roundings` unless ``roundings`` is given): the float32
    model computes with :math:`J + \Delta J` (each row within :math:`r\epsilon` of its norm, so
    :math:`\lVert\Delta J\rVert \le r\epsilon\lVert J\rVert_F`) and :math:`f + \Delta f` as in
    :func:`float32_roundings`; its sites move with ``f``: :math:`\Delta g = -\Lambda\Delta f`, and for softmax or
    logistic sites every entry of :math:`\Lambda` is a product of two probabilities, each moved relatively by at most
    :math:`2\max|\Delta f|`, so :math:`\lVert\Delta\Lambda\rVert \le 8\max|\Delta f|\,\lVert\Lambda\rVert`
    (Gershgorin: :math:`|\Lambda|` has row sums :math:`2\Lambda_{cc}`). Hence, for
    :math:`H = J^\top\Lambda J + \delta I` (``n = min(NC, P)`` the dimension factorized in float32, with backward
    error :math:`(n + 1)\epsilon\lVert H\rVert`; the sum over the ``NC`` rows adds :math:`\log_2(NC)` roundings):

    :math:`\lVert\Delta H\rVert \le \sum_n\lVert\Lambda_n\rVert\lVert J_n\rVert_F^2(2r\epsilon +
    8\max_c|\Delta f_{nc}| + \log_2(NC)\,\epsilon) + (n + 1)\epsilon\lVert H\rVert` (per example: a confident
    prediction has a small :math:`\Lambda_n`), all measured here; :math:`\kappa = \lVert J^\top\Lambda J\rVert/\lambda_{\min}(H)` is reported. With the gain
    :math:`G = J_* H^{-1}` and the step :math:`s = H^{-1}u`, :math:`u = J^\top g - \delta\theta`
    (:math:`J_*\Delta s = G(\Delta u - \Delta H s)`):

    - mean :math:`f_* + J_* s`: :math:`\lVert\Delta f_*\rVert + r\epsilon\lVert J_*\rVert_F\lVert s\rVert +
      \lVert G\Delta H s\rVert + r\epsilon\lVert G\rVert\lVert J\rVert_F\lVert g\rVert +
      \lVert G J^\top\Lambda\rVert\lVert\Delta f\rVert`, with :math:`\lVert G\Delta H s\rVert` bounded per example
      (:math:`\Delta H s = \sum_n \Delta J_n^\top\Lambda_n J_n s + J_n^\top\Lambda_n\Delta J_n s +
      J_n^\top\Delta\Lambda_n J_n s` through :math:`\lVert G\rVert`, :math:`\lVert G J_n^\top\rVert` and
      :math:`J_n s`, plus the sum's and the factorization's roundings times :math:`\lVert G\rVert\lVert s\rVert`);
    - variance :math:`G_i J_{*i}^\top` at test point ``i``: :math:`2r\epsilon\lVert J_{*i}\rVert\lVert G_i\rVert +
      \lVert\Delta H\rVert\lVert G_i\rVert^2`;
    - evidence: :math:`\lVert g\rVert\lVert\Delta f\rVert + \tfrac12 n\lVert\Delta H\rVert/\lambda_{\min}(H)`
      (the data fit moves with ``f``; :math:`|\Delta\log\det H| = |\operatorname{tr}(H^{-1}\Delta H)|`).

    With ``mode=True`` the sites are those at the mode of the linearized model's log joint (Newton iterated here in
    float64, as ``condition_on(..., iterate=True)``): the mode moves by :math:`H^{-1}` times the perturbation of
    the gradient, the same terms with :math:`s` the step to the mode and :math:`g, \Lambda, H` taken there.

    Each is a worst case over the directions of the roundings, so it holds on any CPU and thread count; a test also
    asserts that the bound is small (below 1e-2), so that an error of 1e-2 from a real bug still fails."""
    net = copy.deepcopy(net).double()
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.requires_grad])
    j, _ = brute_jacobian(net, x)
    j_test, _ = brute_jacobian(net, x_test)
    with torch.no_grad():
        out, f_test = net(x), net(x_test).reshape(-1)
    f = out.reshape(-1)
    step = torch.zeros_like(theta)  # s = θ_post − θ*: one Newton step, or Newton iterated to the mode
    for _ in range(50 if mode else 1):
        g, lam = reference_terms(log_prob, (f + j @ step).reshape(out.shape), y)
        lam_blocks = torch.block_diag(*lam)
        hessian = j.T @ lam_blocks @ j + delta * torch.eye(theta.numel(), dtype=torch.float64)
        update = torch.linalg.solve(hessian, j.T @ g.reshape(-1) - delta * (theta + step))
        step = step + update
        if update.norm() <= 1e-13 * (1 + step.norm()):
            break
    if mode:
        g, lam = reference_terms(log_prob, (f + j @ step).reshape(out.shape), y)
        lam_blocks = torch.block_diag(*lam)
        hessian = j.T @ lam_blocks @ j + delta * torch.eye(theta.numel(), dtype=torch.float64)
    mean = f_test + j_test @ step
    gain = torch.linalg.solve(hessian, j_test.T).T  # J* H⁻¹
    variance = (gain * j_test).sum(-1)
    params = theta.numel()
    theta = theta.norm()
    eps, r = EPS32, float32_roundings(net) if roundings is None else roundings
    n = min(j.shape[0], params)
    norm_f = lambda t: torch.linalg.matrix_norm(t).item()  # Frobenius
    norm_2 = lambda t: torch.linalg.matrix_norm(t, ord=2).item()
    data, lam_min = norm_2(j.T @ lam_blocks @ j), torch.linalg.eigvalsh(hessian)[0].item()
    kappa = data / lam_min
    step_vector, s_norm = step, step.norm().item()
    # |Δf| per output row, at the sites (f, or f + J s at the mode), and its largest value
    rows = f.abs() + j.norm(dim=-1) * (theta + (s_norm if mode else 0.0))
    df = r * eps * rows.norm().item()
    df_test = r * eps * (f_test.abs() + j_test.norm(dim=-1) * theta).norm().item()
    # ‖ΔH‖: the Jacobian's rows, the sites (ΔΛ ≤ 4·2 max|Δf| ‖Λ‖ for softmax or logistic sites), the sum over the
    # N·C rows and the float32 factorization's backward error
    per_example = (torch.linalg.matrix_norm(lam, ord=2)  # ‖Λ_n‖ ‖J_n‖_F² (2rε + 8 max_c|Δf_nc| + log2(NC) ε)
                   * j.reshape(*lam.shape[:2], -1).square().sum((1, 2))
                   * (2 * r * eps + (0.0 if gaussian else 8 * r * eps) * rows.reshape(lam.shape[:2]).amax(-1)
                      + math.log2(j.shape[0]) * eps))
    dh = per_example.sum().item() + (n + 1) * eps * (data + delta)
    # ‖G ΔH s‖ per example: ΔH s = Σ_n ΔJ_nᵀΛ_nJ_n s + J_nᵀΛ_nΔJ_n s + J_nᵀΔΛ_nJ_n s, plus the sum's and the
    # factorization's roundings
    shape = lam.shape[:2]
    j_n = j.reshape(*shape, -1)
    out_s = (j @ step_vector).reshape(shape)  # J_n s
    lam_n = torch.linalg.matrix_norm(lam, ord=2)
    gain_n = torch.linalg.matrix_norm((gain @ j.T).reshape(gain.shape[0], *shape).permute(1, 0, 2), ord=2)  # ‖G J_nᵀ‖
    row_f = j_n.square().sum((1, 2)).sqrt()  # ‖J_n‖_F
    sites_n = (0.0 if gaussian else 8 * r * eps) * rows.reshape(shape).amax(-1)
    g_dh_s = (norm_2(gain) * r * eps * row_f * (lam @ out_s[..., None]).squeeze(-1).norm(dim=-1)
              + gain_n * lam_n * (r * eps * row_f * s_norm + sites_n * out_s.norm(dim=-1))).sum().item()
    g_dh_s += norm_2(gain) * (math.log2(j.shape[0]) * eps * (lam_n * row_f.square()).sum().item()
                              + (n + 1) * eps * (data + delta)) * s_norm
    d_mean = (df_test + r * eps * norm_f(j_test) * s_norm
              + g_dh_s + norm_2(gain) * r * eps * norm_f(j) * g.norm().item()
              + norm_2(gain @ j.T @ lam_blocks) * df)
    d_variance = 2 * r * eps * j_test.norm(dim=-1) * gain.norm(dim=-1) + dh * gain.norm(dim=-1).square()
    return {
        "mean": d_mean / mean.norm().item(),
        "variance": (d_variance.norm() / variance.norm()).item(),
        "evidence": g.norm().item() * df + 0.5 * n * dh / lam_min,
        "condition": kappa,
    }


@torch.enable_grad()  # the Jacobian by autograd, also when called under torch.no_grad()
def float32_precision_error(net: nn.Module, x: torch.Tensor, lam_max: float, gaussian: bool = False,
                            factorized: int = 0, delta: float = 0.0) -> dict:
    r"""A bound on :math:`\lVert\Delta H\rVert_F` for a float32 Laplace precision (or GGN)
    :math:`H = \sum_n J_n^\top\Lambda_n J_n (+ \delta I)` against float64, measured on the float64 ``net``'s dense
    Jacobian at ``x``; ``lam_max`` bounds :math:`\lVert\Lambda_n\rVert` (``1/σ²``; ½ / temperature for softmax sites,
    by Gershgorin). Where ``H`` is only a block of the parameters (a last layer), the full Jacobian bounds it.

    Error model (ε = ε32, ``r`` from :func:`float32_roundings`, rows of ``J`` within :math:`r\epsilon` of their norm):
    :math:`\lVert\Delta H\rVert_F \le (2r\epsilon + 8\max|\Delta f| + \log_2(NC)\,\epsilon)\,
    \lambda_{\max}\lVert J\rVert_F\lVert J\rVert + (\text{factorized} + 1)\epsilon\lVert H\rVert_F` — the Jacobian
    on both sides, the sites (each entry of a softmax or logistic :math:`\Lambda` is a product of two probabilities
    moved relatively by :math:`2\max|\Delta f|`, ``0`` for Gaussian sites), the blocked sum over the rows, and, for
    ``factorized`` > 0, the backward error of a float32 Cholesky of that dimension (:math:`\lVert H\rVert_F \le
    \lambda_{\max}\lVert J\rVert_F^2 + \delta\sqrt{P}`). Returns ``precision``, that bound, and ``outputs``, a bound
    on :math:`\lVert\Delta f\rVert` over the rows (:func:`float32_roundings`), for the data fit's share
    :math:`\lVert g\rVert\lVert\Delta f\rVert` of an evidence. Consequences, with
    :math:`\eta = \lVert\Delta H\rVert_F/\lVert H\rVert` and
    :math:`\kappa = \kappa(H)` measured in float64: a GLM covariance :math:`C = J_* H^{-1} J_*^\top` moves by
    :math:`|\Delta C_{ij}| \le (2r\epsilon + \eta\kappa)\max|C|` (entries are inner products of
    :math:`H^{-1/2}J_*^\top` columns), and :math:`|\Delta\log|H|| \le \dim(H)\,\eta\kappa`."""
    net = copy.deepcopy(net).double()
    x = x.double()
    j, _ = brute_jacobian(net, x)
    with torch.no_grad():
        f = net(x).reshape(-1)
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.requires_grad]).norm()
    r = float32_roundings(net)
    df_max = r * EPS32 * (f.abs() + j.norm(dim=-1) * theta).max().item()
    norm_f, norm_2 = torch.linalg.matrix_norm(j).item(), torch.linalg.matrix_norm(j, ord=2).item()
    sites = 0.0 if gaussian else 8 * df_max
    product = (2 * r * EPS32 + sites + math.log2(j.shape[0]) * EPS32) * lam_max * norm_f * norm_2
    if factorized:
        product += (factorized + 1) * EPS32 * (lam_max * norm_f**2 + delta * math.sqrt(j.shape[1]))
    return {"precision": product, "outputs": r * EPS32 * (f.norm() + norm_f * theta).item()}


def float32_gaussian_kl_tolerance(d: torch.Tensor, cov_q: torch.Tensor, cov_p: torch.Tensor, roundings: float,
                                  mean_error: float) -> float:
    r"""A first-order bound on :math:`|\Delta\,\mathrm{KL}(N(\mu_q, Q)\,\Vert\,N(\mu_p, P))|` summed over a batch of
    Gaussians (``cov_q``, ``cov_p``: ``(..., n, n)`` float64 references; ``d = μ_q − μ_p``, ``(..., n)``) when a
    float32 model forms them from float32 Jacobians.

    Error model (ε = ε32): each covariance is a Gram of Jacobian rows scaled by variances, whose entries carry
    ``r = roundings`` relative roundings, so by Cauchy–Schwarz :math:`\lVert\Delta Q\rVert_F \le 2r\epsilon
    \operatorname{tr} Q` (likewise ``P``), plus the float32 Cholesky's backward error :math:`(n+1)\epsilon
    \lVert P\rVert_F`; the mean difference moves by at most ``mean_error`` (2-norm, all Gaussians together). With
    :math:`\mathrm{KL} = \tfrac12[\operatorname{tr}(P^{-1}Q) + d^\top P^{-1} d - n + \log|P| - \log|Q|]`, its
    derivatives (the KL's condition, measured here on the float64 references) give
    :math:`|\Delta\mathrm{KL}| \le \tfrac12\lVert P^{-1} - Q^{-1}\rVert_F\lVert\Delta Q\rVert_F + \tfrac12
    \lVert P^{-1} - P^{-1}(Q + dd^\top)P^{-1}\rVert_F\lVert\Delta P\rVert_F + \lVert P^{-1}d\rVert\,\Delta d`."""
    eps, n = EPS32, cov_q.shape[-1]
    inv_p, inv_q = torch.linalg.inv(cov_p), torch.linalg.inv(cov_q)
    error_q = (2 * roundings + n + 1) * eps * torch.diagonal(cov_q, dim1=-2, dim2=-1).sum(-1)
    error_p = (2 * roundings + n + 1) * eps * torch.diagonal(cov_p, dim1=-2, dim2=-1).sum(-1)
    outer = cov_q + d[..., :, None] * d[..., None, :]
    by_q = 0.5 * torch.linalg.matrix_norm(inv_p - inv_q) * error_q
    by_p = 0.5 * torch.linalg.matrix_norm(inv_p - inv_p @ outer @ inv_p) * error_p
    by_d = (inv_p @ d[..., None]).norm() * mean_error
    return float(by_q.sum() + by_p.sum() + by_d)


def float32_gram_tolerance(net: nn.Module, diagonal: torch.Tensor, other: torch.Tensor | None = None,
                           roundings: float | None = None) -> float:
    r"""A bound on :math:`\lVert K_{32} - K_{64}\rVert_F` for a float32 NTK Gram (of a float32 copy of ``net``)
    against float64, from the float64 Gram's diagonals ``(..., n)`` of the two input sets (``other`` = ``diagonal``
    for a square Gram); leading dimensions (groups, outputs) are summed over.

    Error model: each entry :math:`K_{ij} = \sum_p J_{ip} J_{jp} / \delta_p` is formed from features rounded by about
    :math:`2L\epsilon` relatively (``L`` parametrized layers, a rounding forward and one backward through each; the
    weights and inputs rounded once more) and summed over ``P`` products with blocked or pairwise accumulation
    (:math:`\log_2 P` roundings), so by Cauchy–Schwarz :math:`|\Delta K_{ij}| \le r\epsilon\sqrt{K_{ii}K_{jj}}`
    with :math:`r = 2L + 2 + \log_2 P`, and :math:`\lVert\Delta K\rVert_F \le r\epsilon\sqrt{\operatorname{tr}_1
    \operatorname{tr}_2}` per block."""
    roundings = float32_roundings(net) if roundings is None else roundings
    other = diagonal if other is None else other
    traces = (diagonal.clamp_min(0).sum(-1) * other.clamp_min(0).sum(-1)).sqrt()
    return float(roundings * torch.finfo(torch.float32).eps * traces.sum())
