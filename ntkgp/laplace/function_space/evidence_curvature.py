r"""The exact curvature behind the dense route of the evidence, built once per network state and inputs.

The dense (``method="cholesky"``) route of :func:`~ntkgp.laplace.laplace_log_marginal_likelihood` at the kernel's
own :math:`K_{XX}` evaluates the exact full GGN / EF of :mod:`ntkgp.laplace.ggn` at the kernel's training
inputs, in the space :func:`~ntkgp.laplace.ggn.space.exact_space` picks:

- **function space** (:class:`~ntkgp.laplace.weight_space.FunctionSpaceCurvature`): the per-group Grams of the
  unit rows, :math:`\tilde L^\top J_g J_g^\top \tilde L` (``(G, Nk, Nk)``; for a Gaussian likelihood the kernel's
  own cached Grams), each step one :math:`Nk \times Nk` Cholesky factorization;
- **weight space** (:class:`~ntkgp.laplace.weight_space.FullCurvature`): the GGN / EF components
  :math:`D_k = \sum_n (\tilde L_n^\top J_n)^\top (\tilde L_n^\top J_n)` (``(K, P, P)``, from the kernel's cached
  Jacobian), each step one :math:`P \times P` Cholesky factorization of :math:`P_0^{-1/2}(H + P_0)P_0^{-1/2}`:
  :math:`O(P^3)`, not the :math:`O(N k P^2)` of forming :math:`W^\top W`, :math:`W = L^\top J P_0^{-1/2}`, again.
  For a network of linear layers (one output scale, the GGN) the components are built block by block from the
  engine's layer features (:mod:`~ntkgp.laplace.ggn.layer_ggn`, :math:`k` times fewer multiply-adds)
  instead of from the Jacobian's rows, whichever costs fewer.

Both are exact and differentiable in every :math:`\delta_g` and in the likelihood's noise or temperature (through
its output scale :math:`s`, :mod:`~ntkgp.laplace.ggn.scaling`), and are the same objects
:func:`~ntkgp.training.train_marglik` evaluates. They are kept with the kernel, keyed by the values of the
inputs, the outputs, the targets and the network's weights and buffers (:class:`~ntkgp.caching.ValueCache`): a
change of the weights builds them again; the hyperparameters may change freely.

**When it applies** (:func:`curvature_problem`): an unbatched kernel, inputs, outputs and targets without
gradients, and not the empirical Fisher of per-output Gaussian noises in function space (whose site factor has no
row scale). Otherwise the evidence factorizes its matrix from the current site factor at every step.
"""

from __future__ import annotations

import weakref

import torch
from gpytorch.likelihoods import Likelihood

from ...caching import ValueCache
from ...kernels import NTKKernel
from ...options import CurvatureKind, Space
from ..ggn.full_curvature import FullCurvature
from ..ggn.gram_curvature import FunctionSpaceCurvature, unit_grams
from ..ggn.layer_ggn import layer_ggn_components
from ..ggn.scaling import output_scale

__all__ = ["curvature_problem", "evidence_curvature"]

_CURVATURES: weakref.WeakKeyDictionary[NTKKernel, ValueCache] = weakref.WeakKeyDictionary()


def curvature_problem(
    kernel: NTKKernel, likelihood: Likelihood, x: torch.Tensor, f: torch.Tensor, y: torch.Tensor,
    curvature: CurvatureKind, space: Space,
) -> str | None:
    """Why :func:`evidence_curvature` does not apply to this problem, or ``None`` when it does."""
    if kernel.raw_prior_precision.dim() != 1:  # the shape of δ, without reading it through its constraint
        return "it needs an unbatched kernel"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, f, y)):
        return "x, f or y requires grad (the curvature is fixed data)"
    if curvature is CurvatureKind.EF and space is Space.FUNCTION and output_scale(likelihood).shape[0] > 1:
        return "the function-space empirical Fisher needs a single output scale"
    return None


def weight_space_blocks(engine, likelihood: Likelihood, x: torch.Tensor, f: torch.Tensor, y: torch.Tensor,
                        scale0: torch.Tensor, fisher: bool) -> torch.Tensor | None:
    """The weight-space GGN components from the engine's layer features
    (:mod:`~ntkgp.laplace.ggn.layer_ggn`), or ``None`` where the Jacobian's rows are the cheaper route."""
    x = engine.prepare(x)  # the pass over x follows the kernel's progress, as its Jacobian's would
    return layer_ggn_components(engine.core, engine.plan(x), x, likelihood, f, y, scale0, fisher,
                                engine.core.progress)


def evidence_curvature(
    kernel: NTKKernel, likelihood: Likelihood, x: torch.Tensor, f: torch.Tensor, y: torch.Tensor,
    curvature: CurvatureKind, space: Space,
) -> FullCurvature | FunctionSpaceCurvature:
    r"""The exact curvature of the evidence at ``x`` in ``space`` (``"function"`` or ``"weight"``), cached with the
    kernel (module docstring).

    Args:
        kernel: the NTK kernel (its cached Grams or Jacobian at ``x``).
        likelihood: the likelihood (its current output scale fixes the unit factors, a change of it does not).
        x: training inputs ``(N, D)`` as the kernel takes them.
        f: network outputs ``(N, C)`` at ``x``.
        y: validated targets.
        curvature: GGN or EF.
        space: ``Space.FUNCTION`` or ``Space.WEIGHT``.
    """
    engine = kernel.engine
    fisher = curvature is CurvatureKind.EF
    cache = _CURVATURES.setdefault(kernel, ValueCache(size=2))

    def compute() -> FullCurvature | FunctionSpaceCurvature:
        with torch.no_grad():
            scale0 = output_scale(likelihood).detach().to(f)
            groups, norms = engine.groups, engine.group_sq_norms().to(f)
            if space is Space.FUNCTION:
                grams, row_scale = unit_grams(kernel.group_grams(x).to(f), likelihood, f, y, scale0, fisher)
                return FunctionSpaceCurvature(groups, norms, f, y, scale0.shape[0], grams, row_scale, fisher)
            blocks = weight_space_blocks(engine, likelihood, x, f, y, scale0, fisher)
            if blocks is not None:
                return FullCurvature(groups, norms, f, y, scale0.shape[0], blocks, fisher)
            return FullCurvature.from_jacobian(groups, norms, kernel.jacobian(x).to(f), likelihood, f, y, scale0,
                                               fisher)

    tag = ("evidence curvature", curvature.value, space.value, type(likelihood).__name__,
           output_scale(likelihood).shape[0])
    return cache.get_or_compute(tag, [x, f, y], compute, state=engine.network_state())
