r"""The predictive mean of :class:`~ntkgp.NTKGP`: the network output plus the linearized model's Newton step.

The posterior mean of the linearized network :math:`f_{lin}(x;\theta) = f(x;\theta^*) + J(x)(\theta - \theta^*)`
under Gaussian sites is :math:`f_{lin}` at :math:`\theta^* + s`, with the Newton step

.. math::
    s = H^{-1} u, \qquad u = J_X^\top r - P_0 \theta^*, \qquad H = P_0 + J_X^\top \Lambda J_X,

where :math:`r_n = \Lambda_n (\hat f_n - f_n) + g_n` is the sites' natural parameter *relative to the network's
outputs* :math:`f_n = f(x_n;\theta^*)` (:math:`\hat f_n` the site location, :math:`g_n` and :math:`\Lambda_n` the
likelihood's gradient and curvature there; for sites at the network's outputs :math:`r = g`, and for a Gaussian
likelihood :math:`J_X^\top r = J_X^\top \Sigma^{-1}(y - f(X;\theta^*))`). So

.. math::
    \mu(x_*) = f(x_*;\theta^*) + J(x_*)\, s,

the network output plus a correction. It equals the GP form
:math:`m(x_*) + K_{*X}(I + \Lambda K_{XX})^{-1}(\Lambda(\hat f - m_X) + \hat g)` with the linearized prior mean
:math:`m = f - J\theta^*` (docs/math.md, "GLM predictive"), but never forms that difference: the GP form adds
and removes :math:`\Lambda J\theta^*`, numbers of size :math:`\lVert J\theta^*\rVert/\sigma^2` that cancel to
the size of the correction, which in float32 with a small noise lost every digit of the mean. Here :math:`u`
is the gradient of the log joint at :math:`\theta^*` (small near a MAP), and only the solve with :math:`H` is
exposed to rounding:

* weight space: :math:`s = P_0^{-1/2} R^{-1} R^{-\top} P_0^{-1/2} u` with the site posterior's factor
  :math:`R^\top R = I + W^\top W` (formed in float64 for lower-precision models), products with the kernel's
  cached Jacobian :math:`J_X` (summed in float64 for lower-precision models, a block of rows at a time);
* function space (Woodbury): :math:`s = a - P_0^{-1} J_X^\top L B^{-1} L^\top J_X a`, :math:`a = P_0^{-1} u`,
  with :math:`B = I + L^\top K_{XX} L = R R^\top`; two vector-Jacobian and one Jacobian-vector product over
  the training inputs, never a Jacobian. The Woodbury form is not backward stable (it subtracts nearly all of
  :math:`a` from itself where the data dominate the prior), so for a lower-precision model the step is refined
  with the residual of :math:`H` itself, :math:`s \leftarrow s + \mathrm{W}(u - H s)` (:math:`\mathrm{W}` the
  Woodbury solve; :math:`H s = P_0 s + J_X^\top \Lambda J_X s`: each refinement two more Jacobian-vector and
  two more vector-Jacobian products), **until the residual stops falling** (at most :data:`MAX_REFINEMENTS`
  times; the iterate of the smallest residual is kept). Each refinement contracts the error by the relative
  error of :math:`\mathrm{W}`, about :math:`\epsilon\kappa` times a constant that depends on the CPU's float32
  arithmetic (a fixed number of refinements reached float32 accuracy on one machine and not on another); run
  to the residual's rounding floor, the step is backward stable on every machine, at about the weight-space
  solve's accuracy.

At test points the mean costs one forward-mode pass (:math:`f` and :math:`J s` together), no cross-Gram.

**Accuracy.** Both solves see the condition number :math:`\kappa = \lambda_{max}` of the factorized matrix
(:math:`B` or :math:`I + W^\top W`, eigenvalues :math:`\ge 1`). The error of the mean relative to its size
:math:`\max|f(X)| + \max|J_X s|` is estimated as

.. math::
    e = c\,\epsilon\,\kappa\,\frac{\max|J_X s|}{\max|f(X)| + \max|J_X s|},

(:data:`ERROR_CONSTANTS`: measured on trained MLPs and CNNs, float32 against float64), and
:func:`newton_step` warns with a ``NumericalWarning`` naming the remedy when :math:`e >` :data:`ERROR_LIMIT`.
Near a MAP the step, and with it the error, vanishes; the weight-space solve is as accurate as the float32
Jacobians themselves allow, the refined function-space solve within about ten times that (unrefined it was
up to a thousand times less accurate).

**Where results stop meaning anything.** When :math:`\epsilon\kappa \ge 1` the identity in :math:`B` (the
prior, relative to the data term :math:`\Lambda^{1/2}K\Lambda^{1/2}` that grows as :math:`1/(\delta\sigma^2)`)
is below the rounding of the factorized matrix: the whole predictive, variance included, no longer depends
on the prior precision as it should (a float64 model with :math:`\delta = 10^{-16}` predicts as with
:math:`\delta = 10^{-12}`). :func:`newton_step` then warns, naming the prior precision from which on the
prior is resolved (about :math:`10^{2}\,\epsilon\kappa\,\max\delta`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from gpytorch.likelihoods import Likelihood
from linear_operator.utils.warnings import NumericalWarning

from ...kernels import NTKKernel
from ...laplace.function_space import SitePosterior
from ...laplace.function_space.algebra import block_apply
from ...likelihoods import gradient, hessian
from ...ntk import NTKEngine
from ...options import Space

__all__ = [
    "ERROR_CONSTANTS",
    "ERROR_LIMIT",
    "MAX_REFINEMENTS",
    "condition_number",
    "newton_step",
    "relative_error",
    "shifted_outputs",
]

#: :math:`c` of the error estimate per space: the largest ratio of the measured float32 error to
#: :math:`\epsilon\kappa\max|J_X s|`, with margin (weight space 0.0007 to 0.018, function space refined until
#: the residual stops falling 0.0013 to 0.030; trained MLP/CNN regressions, noise 1e-4 to 1e-2; docs/ntkgp.md,
#: "float32").
ERROR_CONSTANTS = {Space.WEIGHT: 0.02, Space.FUNCTION: 0.06}
#: The estimated relative error of the mean above which :func:`newton_step` warns (three digits).
ERROR_LIMIT = 1e-3
#: The most refinement steps of the function-space Newton step of a lower-precision model, which stop earlier
#: once the residual stops falling (each two more Jacobian-vector and two more vector-Jacobian products over the
#: training inputs: H s and a Woodbury solve; none in float64, where the Woodbury form loses only
#: ``0.3 · ε · κ`` of the mean). Where ε·κ approaches 1 the refinement stalls and the error estimate warns.
MAX_REFINEMENTS = 20


def flat_parameters(engine: NTKEngine, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-parameter tensors as one vector ``(P,)`` in the engine's column order."""
    return torch.cat([tensors[name].reshape(-1) for name in engine.groups.names])


def parameter_dict(engine: NTKEngine, vector: torch.Tensor) -> dict[str, torch.Tensor]:
    """A vector ``(P,)`` in column order as per-parameter tensors of the network's dtype."""
    pieces = vector.to(engine.dtype).split(list(engine.groups.numels))
    return {name: p.reshape(shape) for name, p, shape in zip(engine.groups.names, pieces, engine.groups.shapes)}


def condition_number(post: SitePosterior, iterations: int = 10) -> float:
    r""":math:`\kappa = \lambda_{max}` of the factorized matrix (:math:`B = R R^\top` or :math:`R^\top R`), whose
    smallest eigenvalue is :math:`\ge 1`: a few power iterations on the factor, :math:`O(\text{iterations}\cdot r^2)`."""
    chol = post.chol.detach()
    v = torch.ones(chol.shape[-1], dtype=chol.dtype, device=chol.device)
    value = 1.0
    for _ in range(iterations):
        w = chol @ (chol.mT @ v) if post.space is Space.FUNCTION else chol.mT @ (chol @ v)
        norm = w.norm()
        if not torch.isfinite(norm) or norm == 0:
            return float("inf") if not torch.isfinite(norm) else value
        value, v = float(norm / v.norm()), w / norm
    return max(value, 1.0)


#: Rows of the Jacobian converted to float64 at a time for the weight-space products of a lower-precision model.
_ROWS = 4096


def _wide(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """float64 for a lower-precision ``dtype`` (except on devices without it), else ``dtype``."""
    if torch.finfo(dtype).eps > torch.finfo(torch.float64).eps and device.type != "mps":
        return torch.float64
    return dtype


def newton_step(
    kernel: NTKKernel, likelihood: Likelihood, x: torch.Tensor, f: torch.Tensor, y: torch.Tensor, post: SitePosterior
) -> torch.Tensor:
    r"""The Newton step :math:`s = H^{-1}(J_X^\top r - P_0\theta^*)` ``(P,)`` in the posterior's dtype (see above).

    Args:
        kernel: the NTK kernel (its engine gives the products, its prior precisions :math:`P_0`).
        likelihood: the likelihood of the sites.
        x: training inputs ``(N, D)`` as the kernel takes them.
        f: the network's outputs at ``x``, ``(N, C)``.
        y: validated targets.
        post: the site posterior at ``x`` (its factor, its sites and the space it was factorized in).

    Warns:
        NumericalWarning: when the estimated relative error of the mean (:func:`relative_error`) exceeds
            :data:`ERROR_LIMIT`.
    """
    engine = kernel.engine
    dtype = post.dtype
    sites = f if post.sites is None else post.sites.to(f)
    lam = hessian(likelihood, sites, y).to(dtype)
    natural = (lam @ (sites - f).to(dtype).unsqueeze(-1)).squeeze(-1) + gradient(likelihood, sites, y).to(dtype)
    theta = flat_parameters(engine, engine.params()).to(dtype)
    precision = kernel.column_weights(1.0).to(dtype)
    if post.space is Space.WEIGHT:  # the Jacobian J_X is at hand (the kernel's cache): products are matmuls
        jac = kernel.jacobian(x)
        work = _wide(dtype, jac.device)  # float64 sums for lower precisions, as the factor was formed
        r = natural.reshape(-1).to(work)
        u = sum(j.to(work).mT @ r[start : start + len(j)] for start, j in zip(range(0, len(jac), _ROWS), jac.split(_ROWS)))
        u = u - precision.to(work) * theta.to(work)
        scale, chol = post.root_scale.to(work), post.chol.to(work)
        half = torch.linalg.solve_triangular(chol.mT, (scale * u).unsqueeze(-1), upper=False)
        step = (scale * torch.linalg.solve_triangular(chol, half, upper=True).squeeze(-1)).to(dtype)
        correction = lambda: (jac.to(dtype) @ step.detach()).abs().max()  # noqa: E731
    else:  # no Jacobian: two vector-Jacobian and one Jacobian-vector product over the training inputs
        u = flat_parameters(engine, engine.vjp(x, natural.reshape(-1))).to(dtype) - precision * theta

        def woodbury(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            a = b / precision
            z = engine.jvp(x, parameter_dict(engine, a)).to(dtype)
            solved = torch.cholesky_solve(block_apply(post.factor, z, transpose=True).unsqueeze(-1), post.chol)
            v = block_apply(post.factor, solved.squeeze(-1))
            return a - flat_parameters(engine, engine.vjp(x, v.to(engine.dtype))).to(dtype) / precision, z, v

        def residual(s: torch.Tensor) -> torch.Tensor:  # u - H s, H s = P0 s + J_Xᵀ Λ J_X s
            js = engine.jvp(x, parameter_dict(engine, s)).to(dtype).reshape(lam.shape[:-1])
            return u - precision * s - flat_parameters(
                engine, engine.vjp(x, (lam @ js.unsqueeze(-1)).reshape(-1).to(engine.dtype))).to(dtype)

        step, z, v = woodbury(u)
        if dtype != _wide(dtype, z.device):  # not backward stable: refine until the residual stops falling
            step = _refine(step, residual, lambda b: woodbury(b)[0])
        # J_X s = z - K_XX v, from the cached Gram: only the size matters here
        correction = lambda: (z - kernel(x).to_dense().to(dtype) @ v).detach().abs().max()  # noqa: E731
    with torch.no_grad():
        kappa = condition_number(post)
        delta = float(kernel.prior_precision.detach().max())
        eps = torch.finfo(dtype).eps
        if eps * kappa >= 1:
            warnings.warn(
                f"the prior is below the rounding of the site posterior: its matrix has condition number {kappa:.1e} "
                f">= 1/eps of {dtype}, so the predictive (mean and variance) no longer depends on the prior precision "
                f"as it should; results are meaningful for prior precisions above about {1e2 * eps * kappa * delta:.1e} "
                "(or a larger noise)" + (", or in float64" if eps > torch.finfo(torch.float64).eps else ""),
                NumericalWarning,
                stacklevel=4,
            )
            return step
        error = relative_error(post, kappa, float(correction()), float(f.detach().abs().max()))
    if error > ERROR_LIMIT:
        _warn(post, dtype, kappa, error)
    return step


def _refine(
    step: torch.Tensor, residual: Callable[[torch.Tensor], torch.Tensor], solve: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    r"""Iterative refinement :math:`s \leftarrow s + \mathrm{W}(u - H s)` while :math:`\lVert u - H s\rVert`
    falls (at most :data:`MAX_REFINEMENTS` steps): the iterate of the smallest residual."""
    best, best_norm = step, float("inf")
    for refinements in range(MAX_REFINEMENTS + 1):
        r = residual(step)
        norm = float(r.detach().norm())
        if not norm < best_norm:  # stopped falling (or not finite): the rounding floor is reached
            break
        best, best_norm = step, norm
        if refinements < MAX_REFINEMENTS:
            step = step + solve(r)
    return best


def relative_error(post: SitePosterior, kappa: float, correction: float, outputs: float) -> float:
    r"""The estimated relative error :math:`e` of the mean (above) for the condition number :math:`\kappa`, the
    correction's size :math:`\max|J_X s|` and the outputs' :math:`\max|f(X)|`."""
    share = correction / max(outputs + correction, torch.finfo(torch.float64).tiny)
    return ERROR_CONSTANTS[post.space] * torch.finfo(post.dtype).eps * kappa * share


def _warn(post: SitePosterior, dtype: torch.dtype, kappa: float, error: float) -> None:
    eps = torch.finfo(dtype).eps
    remedy = (
        "compute in float64 (a float64 copy of the network: copy.deepcopy(net).double())"
        if eps > torch.finfo(torch.float64).eps
        else "raise the prior precision or the noise"
    )
    if post.space is Space.FUNCTION:
        remedy += ", or use space='weight'"
    warnings.warn(
        f"the predictive mean may be inaccurate: its Newton step is solved in {post.space.value} space with a matrix "
        f"of condition number {kappa:.1e} in {dtype} (eps = {eps:.1e}), an estimated relative error "
        f"of {error:.1e} (> {ERROR_LIMIT:g}); {remedy}",
        NumericalWarning,
        stacklevel=4,
    )


def shifted_outputs(engine: NTKEngine, x: torch.Tensor, step: dict[str, torch.Tensor]) -> torch.Tensor:
    r""":math:`f(x;\theta^*) + J(x)\,s` ``(n, C)`` in one forward-mode pass (no Jacobian; the caller chunks the test
    points), in the network's dtype; with a graph to ``x`` when it requires grad (and to ``step`` when it carries
    one)."""
    x = engine.prepare(x, "X")
    f, push = engine.core.value_and_jvp(x, step)  # on ntkgp's private copy; reverse mode where forward AD fails
    return f + push
