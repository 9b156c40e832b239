r"""A first-order error model of a float32 SFR against the same SFR on a float64 copy of the network, on a dense
float64 reference written independently of ntkgp (Jacobians by ``torch.func``, Cholesky, dense solves).

**What the float32 model computes.** SFR forms the features of its inducing inputs ``Z`` on a float64 copy of the
network and keeps them in float64; the float32 features of the data and test points are promoted and contracted
against them in float64, and every sum and solve is float64 (ntkgp/models/sfr/system_grams.py). So the float32
model *is* the float64 model evaluated at rounded inputs: the Jacobian rows of the data and test points
:math:`J_n + \Delta J_n`, the network outputs :math:`f + \Delta f` and the offsets :math:`o = J\theta^*` (the
linearized prior mean) :math:`o + \Delta o`, with (:func:`tests.helpers.float32_roundings`, ``r = 2L + 2 + log2 P``)

.. math::
    \lVert\Delta J_{\text{row}}\rVert \le r\epsilon\lVert J_{\text{row}}\rVert, \quad
    |\Delta f| \le r\epsilon\big(|f| + \textstyle\sum_p|J_p\theta_p|\big), \quad
    |\Delta o| \le r\epsilon\textstyle\sum_p|J_p\theta_p|

the sites moving with ``f`` (:math:`\Delta g = -\Lambda\Delta f`; softmax, :math:`\Lambda = \operatorname{diag}p -
pp^\top` with :math:`\Delta p = \Lambda\Delta f`: :math:`\lVert\Delta\Lambda\rVert \le 3\lVert\Delta p\rVert \le
3\lVert\Lambda\rVert\lVert\Delta f\rVert`), and each result rounded once to float32 (:math:`\epsilon|\cdot|`).
:math:`J(Z)` carries no float32 rounding. (:math:`\sum_p|J_p\theta_p|` is what each layer's rounded products
:math:`|W||a| + |b|` sum to once carried to the output by :math:`|\partial f/\partial z|`; it is at most
:math:`\lVert J\rVert\lVert\theta\rVert`.) Both models also round in their float64 algebra: :math:`K_{ZZ}`'s
Cholesky moves :math:`V` by up to :math:`K\epsilon_{64}\kappa(K_{ZZ})\lVert v\rVert`, counted twice as one more
perturbation of the rows (:math:`2K\epsilon_{64}\kappa(K_{ZZ})` added to :math:`r\epsilon`; negligible unless
:math:`K_{ZZ}` is nearly singular).

**Propagation.** With :math:`Q = L^{-1}J_Z` (:math:`LL^\top = K_{ZZ}`; orthonormal rows), :math:`V_n = QJ_n^\top`,
:math:`S = I + \sum_n V_n\Lambda_nV_n^\top` (:math:`\ge I`), :math:`\beta = S^{-1}\sum_n V_n\rho_n` (:math:`\rho_n`
the site residual), :math:`c_n = V_n^\top\beta`, and at a test row :math:`v = QJ_x^\top`, :math:`u = S^{-1}v`,
:math:`w_n = V_n^\top u`: the mean is :math:`f - o + v^\top\beta` and the variance :math:`K_{xx} - v^\top v +
v^\top u`. A perturbation of a row moves :math:`V` by at most its norm (``Q`` has orthonormal rows): no condition
number of :math:`K_{ZZ}` enters, only :math:`S`'s (through :math:`\beta`, ``u``, :math:`w_n`, measured here).
To first order, per test row,

.. math::
    |\Delta\mu| \le |\Delta f - \Delta o| + r\epsilon\lVert J_x\rVert\lVert\beta\rVert + \sum_n r\epsilon
    \lVert J_n\rVert_F\big(\lVert u\rVert\lVert\rho_n - \Lambda_nc_n\rVert + \lVert\Lambda_nw_n\rVert\lVert\beta\rVert\big)
    + \lVert w_n\rVert\lVert\Delta\Lambda_n\rVert\lVert o_n - c_n\rVert + \lVert\Lambda_nw_n\rVert
    |\Delta o_n - \Delta f_n|,

    |\Delta\sigma^2| \le 2r\epsilon\lVert J_x\rVert\sqrt{K_{xx} - \lVert v\rVert^2 + \lVert u\rVert^2} + \sum_n
    2r\epsilon\lVert J_n\rVert_F\lVert u\rVert\lVert\Lambda_nw_n\rVert + \lVert\Delta\Lambda_n\rVert\lVert w_n\rVert^2

(the variance's own test-row term is :math:`2\Delta J_x(J_x^\top - Q^\top(v - u))`, whose two parts are orthogonal),
and for the collapsed evidence :math:`c_0 + \tfrac12 h^\top S^{-1}h - \tfrac12\log|S| - \tfrac12\sum_n
\operatorname{tr}(\Lambda_n(K_{nn} - V_n^\top V_n))` the same per-point terms (:func:`_system`); the sites enter
through the fit's residuals :math:`g_n + \Lambda_n(o_n - c_n)` and :math:`o_n - c_n`, not the outputs' size. Each
is a worst case over the directions of the roundings, so it holds on any CPU and thread count; it is far above the
typical error (the roundings rarely align, and ``r`` counts every rounding at its largest), so a test also asserts
that the bounds are below 1 % of the values, and that a 1 % error fails them.
"""

from __future__ import annotations

import copy
import math

import torch

from tests.helpers import EPS32, float32_roundings, reference_log_prob, reference_terms


def dense_jacobian(net, x):
    """``J`` ``(N·C, P)`` of the float64 ``net`` (eval mode) by ``torch.func.jacrev`` per example (rows ``n·C + c``,
    columns over the parameters in order): written with torch.func alone, independently of ntkgp."""
    params = {k: v.detach() for k, v in net.named_parameters()}
    buffers = {k: v.detach() for k, v in net.named_buffers()}

    def one(p, xi):
        return torch.func.functional_call(net, (p, buffers), (xi.unsqueeze(0),))[0]

    jac = torch.func.vmap(torch.func.jacrev(one), in_dims=(None, 0))(params, x)
    n, c = x.shape[0], next(iter(jac.values())).shape[1]
    return torch.cat([jac[k].reshape(n, c, -1) for k in params], dim=-1).reshape(n * c, -1)


def _system(jz, jx, jt, lam, g, o, d_lam, shift, re):
    r"""One system (joint: all outputs; independent: one output's rows). ``jz`` ``(K, P)``, ``jx`` ``(N, c, P)``,
    ``jt`` ``(n, c, P)`` (weighted Jacobians), the sites ``lam`` ``(N, c, c)`` and ``g`` ``(N, c)``, the offsets ``o``
    ``(N, c)`` (:math:`\rho_n = \Lambda_n o_n + g_n`); ``d_lam`` ``(N,)`` bounds ``‖ΔΛ_n‖``, ``shift`` ``(N, c)``
    bounds :math:`|\Delta o_n - \Delta f_n|`; ``re`` = rε. Returns the correction ``v·β``, the variance and their
    bounds per test row ``(n, c)``, and the evidence's part that moves with the data's roundings and its bound.

    The sites' perturbations enter the mean as :math:`u^\top\sum_n V_n(\Delta\rho_n - \Delta\Lambda_n c_n) =
    \sum_n w_n^\top(\Delta\Lambda_n(o_n - c_n) + \Lambda_n(\Delta o_n - \Delta f_n))`, and the evidence (with
    :math:`c_0`'s) as :math:`(g_n + \Lambda_n(o_n - c_n))^\top(\Delta f_n - \Delta o_n) - \tfrac12(o_n -
    c_n)^\top\Delta\Lambda_n(o_n - c_n)`: residuals of the fit, not the outputs' size."""
    rho = torch.einsum("nab,nb->na", lam, o) + g
    kzz = jz @ jz.T
    chol = torch.linalg.cholesky(kzz)
    q = torch.linalg.solve_triangular(chol, jz, upper=False)  # orthonormal rows
    # the float64 algebra of either model: K_ZZ's Cholesky (backward error K·ε₆₄‖K_ZZ‖) moves V = L⁻¹K_Zx by up to
    # K·ε₆₄·κ(K_ZZ)‖v‖, twice over the two models; counted as a perturbation of the rows like the features'
    inverse = torch.linalg.solve_triangular(chol, torch.eye(kzz.shape[0], dtype=kzz.dtype), upper=False)
    kzz_condition = (kzz.trace() * inverse.square().sum()).item()  # tr K_ZZ · tr K_ZZ⁻¹ ≥ κ(K_ZZ)
    re = re + 2 * kzz.shape[0] * torch.finfo(torch.float64).eps * kzz_condition
    vx, vt = jx @ q.T, jt @ q.T  # V_nᵀ (N, c, K), v_iᵀ (n, c, K)
    size = q.shape[0]
    s = torch.eye(size, dtype=q.dtype) + torch.einsum("nck,ncd,ndl->kl", vx, lam, vx)
    h = torch.einsum("nck,nc->k", vx, rho)
    beta = torch.linalg.solve(s, h)
    c_n = vx @ beta  # (N, c)
    n, c = jt.shape[:2]
    u = torch.linalg.solve(s, vt.reshape(n * c, size).T).T.reshape(n, c, size)
    w = torch.einsum("Nak,ick->Naic", vx, u)  # w_n(i) = V_nᵀu_i, (N, c, n, c)
    a_n = jx.square().sum((1, 2)).sqrt()  # ‖J_n‖_F
    b_i = jt.norm(dim=-1)  # ‖J_x‖ per test row
    u_norm, beta_norm = u.norm(dim=-1), beta.norm()
    lam_w = torch.einsum("Nab,Nbic->Naic", lam, w).norm(dim=1)  # ‖Λ_n w_n‖ (N, n, c)
    w_norm = w.norm(dim=1)
    fit = rho - torch.einsum("Nab,Nb->Na", lam, c_n)  # ρ_n − Λ_n c_n = g_n + Λ_n(o_n − c_n)
    resid, gap = fit.norm(dim=-1), (o - c_n).norm(dim=-1)
    shift_norm = shift.norm(dim=-1)
    mean_bound = re * b_i * beta_norm + torch.einsum(
        "N,Nic->ic", re * a_n, u_norm[None] * resid[:, None, None] + lam_w * beta_norm
    ) + torch.einsum("Nic,N->ic", w_norm, d_lam * gap) + torch.einsum("Nic,N->ic", lam_w, shift_norm)
    k_xx = jt.square().sum(-1)
    nystrom = (jt - vt @ q).square().sum(-1)  # K_xx − ‖v‖², formed without cancellation
    variance = nystrom + (vt * u).sum(-1)
    var_bound = 2 * re * b_i * (nystrom + u_norm.square()).sqrt() + torch.einsum(
        "N,Nic->ic", 2 * re * a_n, u_norm[None] * lam_w
    ) + torch.einsum("N,Nic->ic", d_lam, w_norm.square())
    # evidence: ½hᵀS⁻¹h − ½log|S| − ½Σ tr(Λ_n Res_n)
    res_n = (jx - vx @ q)  # (N, c, P): rows of J_n(I − QᵀQ)
    res_tr = res_n.square().sum((1, 2))
    lam_norm = torch.linalg.matrix_norm(lam, ord=2)
    s_inv_v = torch.linalg.solve(s, vx.reshape(-1, size).T).T.reshape(vx.shape)  # (S⁻¹V_n)ᵀ (N, c, K)
    kernel = 0.5 * h @ beta - 0.5 * torch.linalg.slogdet(s)[1] - 0.5 * torch.einsum(
        "Nab,Nbp,Nap->", lam, res_n, res_n)  # c₀ is added by the caller
    ev_bound = (re * a_n * beta_norm * resid  # βᵀΔV(ρ − Λc): ΔJ in ½hᵀS⁻¹h
                + resid * shift_norm + 0.5 * d_lam * gap.square()  # the sites' and c₀'s share
                + re * a_n * torch.linalg.matrix_norm(lam @ s_inv_v)  # ½tr(S⁻¹ΔS)
                + 0.5 * d_lam * (vx * s_inv_v).sum((1, 2))
                + re * a_n * lam_norm * res_tr.sqrt() + 0.5 * d_lam * res_tr)  # ½Σ tr(Λ_n ΔRes_n)
    return {"correction": vt @ beta, "variance": variance, "k_xx": k_xx, "mean_bound": mean_bound,
            "variance_bound": var_bound, "evidence": kernel.item(), "evidence_bound": ev_bound.sum().item(),
            "condition": torch.linalg.matrix_norm(s).item(), "kzz_condition": kzz_condition}  # ‖S‖_F ≥ κ(S)


def float32_sfr_bounds(net, x, y, z, x_test, kind: str, coupling: str = "joint", prior_mean: str = "linearized",
                       delta: float = 1.0, noise: float | None = None) -> dict:
    """The float64 SFR (dense reference, column weights ``1/delta``) and first-order bounds on how far the float32
    model may be from it, per test point and output (module doc): ``mean``, ``variance`` ``(n, C)``, the bounds
    ``mean_bound``, ``variance_bound`` ``(n, C)`` (each including the final rounding to float32), ``evidence`` and
    ``evidence_bound`` (absolute), ``condition``, an upper bound on :math:`\\kappa(S) = \\lambda_{\\max}(S)`
    (:math:`\\lVert S\\rVert_F`) over the systems, and ``kzz_condition``, one on :math:`\\kappa(K_{ZZ})`
    (:math:`\\operatorname{tr}K_{ZZ}\\operatorname{tr}K_{ZZ}^{-1}`), which enters only through the float64 algebra's
    own rounding (:math:`2K\\epsilon_{64}\\kappa(K_{ZZ})` added to :math:`r\\epsilon`).
    ``kind``: ``"gaussian"`` (``noise`` = σ²) or ``"softmax"``."""
    net = copy.deepcopy(net).double()
    x, z, x_test = x.double(), z.double(), x_test.double()
    eps, r = EPS32, float32_roundings(net)
    re = r * eps
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters() if p.requires_grad])
    jx, jz, jt = (dense_jacobian(net, inp) for inp in (x, z, x_test))
    with torch.no_grad():
        f, ft = net(x), net(x_test)
    (num, c), n = f.shape, ft.shape[0]
    linearized = prior_mean == "linearized"
    o = (jx @ theta).view(num, c) if linearized else f
    ot = (jt @ theta).view(n, c) if linearized else ft
    # |Δf| ≤ rε(|f| + Σ_p |J_p θ_p|): each layer's products rounded relatively, carried to the output by its
    # Jacobian (the sum over a linear layer's |∂f/∂z||W||a| + |∂f/∂z||b| is Σ_p |J_p θ_p| over its parameters)
    mass, mass_t = (jx.abs() @ theta.abs()).view(num, c), (jt.abs() @ theta.abs()).view(n, c)
    df, dft = re * (f.abs() + mass), re * (ft.abs() + mass_t)
    do, do_t = (re * mass, re * mass_t) if linearized else (df, dft)
    shift = df + do if linearized else torch.zeros_like(df)  # a bound on |Δf − Δo| (zero mean: o = f, the same numbers)
    if kind == "gaussian":  # log p = −(y − f)²/(2σ²): g = (y − f)/σ², Λ = 1/σ² (exact, unmoved by Δf)
        yy = y.double().view(num, c)
        g, lam = (yy - f) / noise, torch.eye(c, dtype=torch.float64).expand(num, c, c) / noise
        d_lam = torch.zeros(num, dtype=torch.float64)
        log_lik = (-0.5 * math.log(2 * math.pi * noise) - 0.5 * (yy - f).square() / noise).sum()
    else:
        log_prob = lambda fn, yn: reference_log_prob("softmax", fn, yn)
        g, lam = reference_terms(log_prob, f, y)
        d_lam = 3 * df.norm(dim=-1) * torch.linalg.matrix_norm(lam, ord=2)
        log_lik = log_prob(f, y).sum()
    if coupling == "independent":  # the diagonal of Λ_n (the public SFR code)
        lam = torch.diag_embed(lam.diagonal(dim1=-2, dim2=-1))
    # c₀ = Σ_n log p(y_n|f_n) + g_nᵀd_n − ½d_nᵀΛ_nd_n, d_n = −o_n (its share of the bound is in _system's)
    evidence = (log_lik - (g * o).sum() - 0.5 * torch.einsum("na,nab,nb->", o, lam, o)).item()
    weight = 1.0 / delta
    jx_w, jz_w, jt_w = (j * math.sqrt(weight) for j in (jx, jz, jt))
    jx_w, jt_w = jx_w.view(num, c, -1), jt_w.view(n, c, -1)
    if coupling == "joint":
        systems = [(slice(None), jz_w, jx_w, jt_w, lam, g, o, d_lam, shift)]
    else:
        jz_w = jz_w.view(-1, c, jz.shape[-1])
        systems = [(slice(k, k + 1), jz_w[:, k], jx_w[:, k : k + 1], jt_w[:, k : k + 1], lam[:, k : k + 1, k : k + 1],
                    g[:, k : k + 1], o[:, k : k + 1], d_lam, shift[:, k : k + 1]) for k in range(c)]
    mean = torch.zeros(n, c, dtype=torch.float64)
    variance, mean_bound, var_bound = torch.zeros_like(mean), torch.zeros_like(mean), torch.zeros_like(mean)
    evidence_bound, condition, kzz_condition = 0.0, 0.0, 0.0
    for cols, *args in systems:
        out = _system(*args, re)
        mean[:, cols] = (ft - ot)[:, cols] + out["correction"] if linearized else out["correction"]
        variance[:, cols], var_bound[:, cols] = out["variance"], out["variance_bound"]
        mean_bound[:, cols] = out["mean_bound"]
        evidence += out["evidence"]
        evidence_bound += out["evidence_bound"]
        condition = max(condition, out["condition"])
        kzz_condition = max(kzz_condition, out["kzz_condition"])
    if linearized:
        mean_bound += dft + do_t  # |Δf(x) − Δo(x)|
    return {
        "mean": mean, "variance": variance, "evidence": evidence, "condition": condition, "kzz_condition": kzz_condition,
        "mean_bound": mean_bound + eps * mean.abs(), "variance_bound": var_bound + eps * variance.abs(),
        "evidence_bound": evidence_bound,
    }


def probit_probability_bound(mean, variance, mean_bound, variance_bound):
    r"""A first-order bound on :math:`|\Delta p|` per entry for the probit predictive :math:`p = \operatorname{softmax}(t)`,
    :math:`t = \mu/s`, :math:`s = \sqrt{1 + \pi\sigma^2/8}`, from bounds on :math:`|\Delta\mu|` and
    :math:`|\Delta\sigma^2|` ``(n, C)``: :math:`|\Delta t| \le |\Delta\mu|/s + |\mu|\tfrac{\pi}{16}|\Delta\sigma^2|/s^3`
    and :math:`\Delta p_k = p_k(\Delta t_k - \sum_j p_j\Delta t_j)`, plus the rounding of ``p`` to float32."""
    s = (1 + math.pi / 8 * variance).sqrt()
    dt = mean_bound / s + mean.abs() * (math.pi / 16) * variance_bound / s**3
    p = torch.softmax(mean / s, dim=-1)
    return p * (dt + (p * dt).sum(-1, keepdim=True)) + EPS32 * p
