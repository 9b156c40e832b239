r"""The Laplace-GGN log marginal likelihood of a trained network, in function or weight space.

With :math:`\theta^*` fixed and the NTK kernel :math:`K = J P_0^{-1} J^\top` (docs/math.md, "Laplace-GGN
evidence"):

.. math::
    \log q(\mathcal D) = \sum_n \log p(y_n \mid f_n) - \tfrac12 \theta^{*\top} P_0 \theta^*
        - \tfrac12 \log\lvert I_{Nk} + L^\top K_{XX} L \rvert,
    \qquad L_n L_n^\top = \Lambda_n \ (\text{GGN}) \text{ or } g_n g_n^\top \ (\text{empirical Fisher}),

where the last term equals :math:`\log|H| - \log|P_0|` (matrix determinant lemma). This module is the front door
used by :meth:`ntkgp.NTKGP.log_marginal_likelihood` and :class:`ntkgp.mlls.LaplaceGGNMarginalLogLikelihood`; its
dense route at the kernel's own :math:`K_{XX}` evaluates the exact curvature objects of
:mod:`ntkgp.laplace.ggn` that :func:`ntkgp.training.train_marglik` evaluates
(:mod:`~ntkgp.laplace.function_space.evidence_curvature`): one implementation of the exact log-determinant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.lazy import LazyEvaluatedKernelTensor
from gpytorch.likelihoods import Likelihood
from linear_operator.operators import LinearOperator, RootLinearOperator

from ...caching import ValueCache
from ...kernels import NTKKernel
from ...likelihoods import gradient, hessian_sqrt, log_likelihood
from ...options import CurvatureKind, Space, choose
from ..ggn.scaling import fewest_columns, scale_size
from ..ggn.space import exact_space, site_columns
from .algebra import low_rank_log_det, site_cholesky
from .eigen import checked_spectral_evidence, eigen_problem, spectral_data, spectral_log_det
from .evidence_curvature import curvature_problem, evidence_curvature
from .matrix_free import matrix_free_log_det
from .routes import EvidenceMethod, EvidenceOptions, check_options, choose_method, dense_memory_bytes

__all__ = ["TrainingEvidence", "curvature_factor", "evidence_method", "is_kernel_covariance",
           "laplace_log_marginal_likelihood"]


def curvature_factor(
    likelihood: Likelihood, f: torch.Tensor, y: torch.Tensor, curvature: CurvatureKind | str = "ggn"
) -> torch.Tensor:
    """Blocks ``(N, C, k)`` of the factor ``L`` with ``L_n L_nᵀ`` the per-point curvature in output space.

    ``"ggn"``: ``L_n L_nᵀ = Λ_n`` with the fewest columns (k = C − 1 for a softmax, whose ``Λ_n`` has that rank,
    :func:`~ntkgp.laplace.ggn.scaling.fewest_columns`; else k = C): every quantity of the Laplace GLM
    (evidence, site posterior, predictive) depends on ``L`` only through ``L_n L_nᵀ``, and the site matrices are
    ``N·k`` square; ``"ef"``: ``L_n = g_n`` (k = 1), so that ``J_nᵀ L_n L_nᵀ J_n = G_nᵀ G_n``
    with ``G_n = g_nᵀ J_n`` the per-example gradient (the empirical Fisher).

    Raises:
        ValueError: for an unknown ``curvature``.
    """
    if choose(CurvatureKind, curvature, "curvature") is CurvatureKind.GGN:
        return fewest_columns(likelihood, f, hessian_sqrt(likelihood, f, y))
    return gradient(likelihood, f, y).unsqueeze(-1)


def prior_term(kernel: NTKKernel) -> torch.Tensor:
    r""":math:`\theta^{*\top} P_0 \theta^* = \sum_g \delta_g \lVert\theta^*_g\rVert^2` at the network's current weights."""
    norms = kernel.engine.group_sq_norms()
    return (kernel.prior_precision.to(norms) * norms).sum()


def _root(covariance: LinearOperator | None) -> torch.Tensor | None:
    """The root ``R`` of a covariance ``R Rᵀ`` when the operator has one (the kernel's weight-space form)."""
    if covariance is None:
        return None
    if hasattr(covariance, "evaluate_kernel"):
        covariance = covariance.evaluate_kernel()
    if isinstance(covariance, RootLinearOperator):
        return covariance.root.to_dense()
    return None


def _given_log_det(
    kernel: NTKKernel,
    x: torch.Tensor,
    factor: torch.Tensor,
    space: Space | str = "auto",
    covariance: LinearOperator | torch.Tensor | None = None,
) -> torch.Tensor:
    r""":math:`\log|I + L^\top K_{XX} L| = \log|H| - \log|P_0|` from the site factor at every call (the dense
    route where the cached curvature does not apply: a given covariance, a batched kernel, inputs with gradients).

    Function space factorises the ``(N·k)²`` matrix :math:`I + L^\top K L`; weight space the ``P²`` matrix
    :math:`I + W^\top W`, :math:`W = L^\top J P_0^{-1/2}` (from the covariance's root or the cached Jacobian).
    ``"auto"`` takes weight space when :math:`N k > 0.85 P` (:func:`~ntkgp.laplace.ggn.space.exact_space`).

    Args:
        kernel: the NTK kernel at the training inputs (prior precisions, cached Grams and Jacobians).
        x: training inputs ``(N, D)`` as the kernel takes them.
        factor: ``L`` as blocks ``(N, C, k)`` (:func:`curvature_factor`).
        space: ``"auto"``, ``"function"`` or ``"weight"``.
        covariance: :math:`K_{XX}` when the caller already holds it (e.g. the covariance of the prior
            ``model(train_x)``); otherwise ``kernel(x)`` is used.
    """
    n, _, k = factor.shape
    space = exact_space(space, kernel.engine.num_params, n * k)
    if space is Space.FUNCTION:
        gram = kernel(x) if covariance is None else covariance
        gram = gram.to_dense() if isinstance(gram, LinearOperator) else gram
        return 2 * site_cholesky(factor, gram.to(factor)).diagonal().log().sum()
    root = _root(covariance)
    if root is None:
        root = kernel.jacobian(x) * kernel.column_weights(-0.5).to(factor)
    return low_rank_log_det(factor, root.to(factor))


def is_kernel_covariance(covariance: object, kernel: NTKKernel, x: torch.Tensor) -> bool:
    """Whether ``covariance`` is the kernel's own lazy :math:`K_{XX}` at ``x`` (e.g. ``model(train_x)``'s
    covariance): the evidence then computes the kernel's terms itself instead of factorizing ``covariance``."""
    if not isinstance(covariance, LazyEvaluatedKernelTensor) or covariance.kernel is not kernel:
        return False
    if covariance.last_dim_is_batch or covariance.params.get("diag", False):
        return False
    x1, x2 = covariance.x1, covariance.x2
    same = (x1 is x or (x1.shape == x.shape and torch.equal(x1, x))) and (x2 is x1 or torch.equal(x2, x1))
    return bool(same)


def _matrix_free_problem(kernel: NTKKernel, x: torch.Tensor) -> str | None:
    if kernel.raw_prior_precision.dim() != 1:
        return "it needs an unbatched kernel"
    if x.requires_grad and torch.is_grad_enabled():
        return "x requires grad (the route gives gradients in the hyperparameters only)"
    return None


def evidence_method(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor,
    curvature: CurvatureKind | str = "ggn",
    space: Space | str = "auto",
    covariance: LinearOperator | torch.Tensor | None = None,
    method: EvidenceMethod | str = "auto",
    options: EvidenceOptions | None = None,
) -> EvidenceMethod:
    r"""The route :func:`laplace_log_marginal_likelihood` takes for these arguments (``docs/scaling.md``).

    ``"auto"``: ``"matrix_free"`` when the dense routes would hold more than ``options.dense_memory_limit``
    bytes (:func:`~ntkgp.laplace.function_space.routes.dense_memory_bytes`), else ``"eigen"`` where it applies
    (:func:`~ntkgp.laplace.function_space.eigen.eigen_problem`: one prior precision, a scalar site scale), else
    ``"cholesky"``. A ``covariance`` other than the kernel's own lazy :math:`K_{XX}` always takes
    ``"cholesky"`` (it is what is factorized); a problem the chosen route cannot treat (a batched kernel,
    inputs that require grad) falls back to ``"cholesky"``.

    Args:
        kernel, likelihood, x, f, curvature, space, covariance: as for :func:`laplace_log_marginal_likelihood`.
        method: ``"auto"``, ``"cholesky"``, ``"eigen"`` or ``"matrix_free"``.
        options: :class:`~ntkgp.laplace.EvidenceOptions` (``dense_memory_limit``).

    Returns:
        The resolved :class:`~ntkgp.laplace.EvidenceMethod`.

    Raises:
        ValueError: for an unknown option, or an explicit method that does not apply, naming the reason.
    """
    curvature = choose(CurvatureKind, curvature, "curvature")
    space = choose(Space, space, "space")
    method = choose(EvidenceMethod, method, "method")
    return _route(kernel, likelihood, x, _outputs(f), curvature, space, covariance, method, check_options(options))


def _outputs(f: torch.Tensor) -> tuple[int, int, torch.dtype]:
    """What the route choice reads of the network outputs ``f``: ``(N, C, dtype)``."""
    return f.shape[-2], f.shape[-1], f.dtype


def _route(
    kernel: NTKKernel, likelihood: Likelihood, x: torch.Tensor, outputs: tuple[int, int, torch.dtype],
    curvature: CurvatureKind, space: Space, covariance: LinearOperator | torch.Tensor | None, method: EvidenceMethod,
    options: EvidenceOptions,
) -> EvidenceMethod:
    """:func:`evidence_method` for arguments already converted to their types (the evidence's own call, and the
    MLL's, which knows ``outputs`` = :func:`_outputs` of ``f`` before it reads ``f``)."""
    own = covariance is None or is_kernel_covariance(covariance, kernel, x)
    if method is EvidenceMethod.CHOLESKY:
        return method
    if not own:
        if method is EvidenceMethod.AUTO:
            return EvidenceMethod.CHOLESKY
        raise ValueError(
            f"method={method.value!r} computes the kernel itself: pass covariance=None (or the kernel's own "
            "model(train_x) covariance), or use method='cholesky' to factorize the given covariance"
        )
    eigen = eigen_problem(kernel, likelihood, x, curvature)
    free = _matrix_free_problem(kernel, x)
    if method is EvidenceMethod.EIGEN and eigen is not None:
        raise ValueError(f"method='eigen' does not apply: {eigen}")
    if method is EvidenceMethod.MATRIX_FREE and free is not None:
        raise ValueError(f"method='matrix_free' does not apply: {free}")
    n, c, dtype = outputs
    k = site_columns(likelihood, c, curvature)  # the site factor's columns
    engine = kernel.engine
    components = scale_size(likelihood) ** (2 if curvature is CurvatureKind.EF else 1)
    dense = dense_memory_bytes(engine.num_params, engine.num_groups, n, c, k, dtype, space, components)
    chosen = choose_method(method, dense, options, eigen)
    if chosen is EvidenceMethod.MATRIX_FREE and free is not None:
        return EvidenceMethod.CHOLESKY
    return chosen


def laplace_log_marginal_likelihood(
    kernel: NTKKernel,
    likelihood: Likelihood,
    x: torch.Tensor,
    f: torch.Tensor,
    y: torch.Tensor,
    curvature: CurvatureKind | str = "ggn",
    space: Space | str = "auto",
    covariance: LinearOperator | torch.Tensor | None = None,
    method: EvidenceMethod | str = "auto",
    options: EvidenceOptions | None = None,
) -> torch.Tensor:
    r"""The Laplace-GGN log marginal likelihood :math:`\log q(\mathcal D)` with :math:`\theta^*` fixed (total, not per point).

    .. math::
        \log q(\mathcal D) = \sum_n \log p(y_n \mid f_n) - \tfrac12 \theta^{*\top} P_0 \theta^*
                    - \tfrac12 \log\lvert I_{NC} + \Lambda^{1/2} K_{XX} \Lambda^{1/2} \rvert

    (Immer et al. 2021, eq. 3–4; docs/math.md, "Laplace-GGN evidence"). Differentiable w.r.t. the prior
    precisions and the likelihood's noise or temperature (through :math:`\log p` and :math:`\Lambda`); no
    Jacobian is recomputed between hyperparameter steps.

    The log-determinant takes one of four routes (``method``; ``docs/scaling.md``): ``"cholesky"`` (dense, in
    function or weight space by ``space``), ``"eigen"`` (one prior precision and a scalar site scale: one
    eigendecomposition, then :math:`O(\min(Nk, P))` per step, exact), ``"matrix_free"`` (GPyTorch's CG and
    stochastic Lanczos quadrature on a matrix-free kernel: an unbiased-in-expectation estimate and a stochastic
    gradient, memory linear in :math:`N`), and ``"auto"`` (:func:`evidence_method`: matrix-free when the dense
    routes need more than ``options.dense_memory_limit`` bytes, else eigen where it applies, else Cholesky).

    Args:
        kernel: the NTK kernel (prior precisions, cached Grams).
        likelihood: a supported likelihood (:mod:`ntkgp.likelihoods`).
        x: training inputs ``(N, D)`` as the kernel takes them.
        f: network outputs at ``x``, ``(N, C)`` (fixed data, at :math:`\theta^*`).
        y: targets (validated by :func:`ntkgp.likelihoods.validate_targets`).
        curvature: ``"ggn"`` (Gauss–Newton) or ``"ef"`` (empirical Fisher).
        space: ``"auto"``, ``"function"`` or ``"weight"``: where the Cholesky and eigen routes work
            (:func:`log_det_term`); the matrix-free route is in function space.
        covariance: :math:`K_{XX}` if already at hand (see :func:`log_det_term`); anything but the kernel's
            own lazy covariance is factorized by the Cholesky route.
        method: ``"auto"``, ``"cholesky"``, ``"eigen"`` or ``"matrix_free"``.
        options: :class:`~ntkgp.laplace.EvidenceOptions`: the memory limit of ``"auto"``, and the probes,
            tolerances, preconditioner rank and seed of the matrix-free route (``None`` fields take
            ``gpytorch.settings``).

    Returns:
        A scalar tensor.

    Raises:
        ValueError: for an unknown ``curvature``, ``space`` or ``method``, or a method that does not apply.
        NotPSDError: when :math:`I + L^\top K L` cannot be factorised (non-finite hyperparameters).

    Example:
        >>> from ntkgp.likelihoods import SoftmaxLikelihood
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
        >>> kernel = NTKKernel(net, prior_precision=1.0, prior_structure="network")
        >>> x, y = torch.randn(20, 2, dtype=torch.float64), torch.randint(0, 3, (20,))
        >>> f = net(x).detach()
        >>> exact = laplace_log_marginal_likelihood(kernel, SoftmaxLikelihood(3), x, f, y, method="cholesky")
        >>> eigen = laplace_log_marginal_likelihood(kernel, SoftmaxLikelihood(3), x, f, y, method="eigen")
        >>> bool(torch.isclose(exact, eigen, rtol=1e-10))
        True
    """
    return TrainingEvidence(keep=False)(kernel, likelihood, x, lambda: f, y, _outputs(f), curvature, space,
                                        covariance, method, options)


def _evidence_by_route(
    kernel: NTKKernel, likelihood: Likelihood, x: torch.Tensor, f: torch.Tensor, y: torch.Tensor,
    curvature: CurvatureKind, space: Space, covariance: LinearOperator | torch.Tensor | None, route: EvidenceMethod,
    options: EvidenceOptions,
) -> torch.Tensor:
    """The evidence by the route :func:`_route` chose, for arguments converted to their types (the dispatch of
    :class:`TrainingEvidence`, where the eigen route's data is not kept)."""
    traced = f.requires_grad and torch.is_grad_enabled()  # the data fit then differentiable in f
    if route is EvidenceMethod.EIGEN and not traced:  # fit, prior and log-determinant from one cache lookup
        return checked_spectral_evidence(kernel, likelihood, x, f, y, curvature, space)
    if route is EvidenceMethod.CHOLESKY and (covariance is None or is_kernel_covariance(covariance, kernel, x)):
        # the function-space side of the curvature's own evidence: N·(C − 1) rows for a softmax GGN
        rows = f.shape[-2] * site_columns(likelihood, f.shape[-1], curvature)
        resolved = exact_space(space, kernel.engine.num_params, rows)
        if curvature_problem(kernel, likelihood, x, f, y, curvature, resolved) is None:
            # the curvature's own evidence: its fit statistics and ‖θ*_g‖², kept with it (one cache lookup)
            exact = evidence_curvature(kernel, likelihood, x, f, y, curvature, resolved)
            return exact.log_marginal_likelihood(kernel.prior_precision, likelihood)
    fit = log_likelihood(likelihood, f, y).sum()
    prior = 0.5 * prior_term(kernel).to(fit)
    if route is EvidenceMethod.EIGEN:
        return fit - prior - 0.5 * spectral_log_det(kernel, likelihood, x, f, y, curvature, space).to(fit)
    factor = curvature_factor(likelihood, f, y, curvature)
    if route is EvidenceMethod.MATRIX_FREE:
        return fit - prior - 0.5 * matrix_free_log_det(kernel, x, factor, options).to(fit)
    return fit - prior - 0.5 * _given_log_det(kernel, x, factor, space, covariance)


class TrainingEvidence:
    r"""The Laplace evidence of fixed training data, evaluated step after step at new hyperparameters: the one
    implementation behind :func:`laplace_log_marginal_likelihood` (which calls it with ``keep=False``),
    :meth:`ntkgp.NTKGP.log_marginal_likelihood` and :class:`~ntkgp.mlls.LaplaceGGNMarginalLogLikelihood`. The route
    is chosen from the outputs' sizes alone (:func:`evidence_method`'s rule); with ``keep`` (the MLL's use) the
    eigen route's fixed data (eigenvalues, data-fit statistics, :math:`\lVert\theta^*\rVert^2`) is kept by the
    values of the training inputs, the targets and the network's weights and buffers, with the curvature, space
    and dtype: the network's outputs are read only to compute it, so a step is one cache lookup and an
    :math:`O(\min(Nk, P))` evaluation.

    Args:
        keep: keep the eigen route's data as above (``False``: read the outputs at every call, as
            :func:`laplace_log_marginal_likelihood` does, whose outputs may carry a graph).

    Example:
        >>> from ntkgp.likelihoods import SoftmaxLikelihood
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
        >>> kernel = NTKKernel(net, prior_precision=1.0, prior_structure="network")
        >>> x, y = torch.randn(20, 2, dtype=torch.float64), torch.randint(0, 3, (20,))
        >>> evidence = TrainingEvidence()
        >>> value = evidence(kernel, SoftmaxLikelihood(3), x, lambda: net(x).detach(), y, (20, 3, torch.float64))
        >>> exact = laplace_log_marginal_likelihood(kernel, SoftmaxLikelihood(3), x, net(x).detach(), y,
        ...                                         method="cholesky")
        >>> bool(torch.isclose(value, exact, rtol=1e-10))
        True
    """

    def __init__(self, keep: bool = True) -> None:
        self._eigen = ValueCache(size=1) if keep else None

    def __call__(
        self,
        kernel: NTKKernel,
        likelihood: Likelihood,
        x: torch.Tensor,
        outputs: Callable[[], torch.Tensor],
        y: torch.Tensor,
        shape: tuple[int, int, torch.dtype],
        curvature: CurvatureKind | str = "ggn",
        space: Space | str = "auto",
        covariance: LinearOperator | torch.Tensor | None = None,
        method: EvidenceMethod | str = "auto",
        options: EvidenceOptions | None = None,
    ) -> torch.Tensor:
        r""":math:`\log q(\mathcal D)` (total, not per point), as :func:`laplace_log_marginal_likelihood`.

        Args:
            kernel, likelihood, x, curvature, space, covariance, method, options: as for
                :func:`laplace_log_marginal_likelihood`.
            outputs: a function giving the network outputs ``(N, C)`` at ``x``, called only where a route needs them.
            y: validated targets (:func:`ntkgp.likelihoods.validate_targets`).
            shape: ``(N, C, dtype)`` of the outputs.

        Raises:
            ValueError: as :func:`laplace_log_marginal_likelihood`.
        """
        curvature = choose(CurvatureKind, curvature, "curvature")
        space = choose(Space, space, "space")
        options = check_options(options)
        given = None if covariance is None or is_kernel_covariance(covariance, kernel, x) else covariance
        route = _route(kernel, likelihood, x, shape, curvature, space, given, choose(EvidenceMethod, method, "method"),
                       options)
        if route is EvidenceMethod.EIGEN and self._eigen is not None:
            tag = (curvature.value, space.value, type(likelihood).__name__, shape[2])
            data = self._eigen.get_or_compute(
                tag, [x, y], lambda: spectral_data(kernel, likelihood, x, outputs(), y, curvature, space),
                state=kernel.network_state(),
            )
            return checked_spectral_evidence(kernel, likelihood, x, None, y, curvature, space, data=data)
        return _evidence_by_route(kernel, likelihood, x, outputs(), y, curvature, space, given, route, options)
