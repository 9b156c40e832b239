r"""Dense GGN and empirical Fisher over the parameters :math:`\theta` of a :class:`NetworkCore` (small
:math:`P`).

.. math::
    H_{\mathrm{GGN}}(s) = \sum_n J_n^\top \Lambda_n J_n = \sum_k s_k \tilde H_k, \qquad
    H_{\mathrm{EF}}(s) = \sum_n J_n^\top g_n g_n^\top J_n = \sum_{k, k'} s_k s_{k'} \tilde D_{kk'},

stored as components computed once with the unit factors of the likelihood (``docs/math.md``, "Laplace-GGN
evidence"; :mod:`ntkgp.laplace.weight_space.scaling`): for a Gaussian likelihood with per-output noise
(:math:`\Lambda_n = \operatorname{diag}(s)`) one component per output, :math:`\tilde H_c = \sum_n J_{nc}^\top
J_{nc}`, and per pair of outputs for the EF with :math:`\tilde g_n = g_n / s`; otherwise (one noise, or a
tempered classification likelihood) a single component with :math:`\tilde\Lambda_n = \Lambda_n / s_0`,
:math:`\tilde g_n = g_n / s_0`. A new noise or temperature re-weights the components without a pass over
the data. Memory :math:`O(K P^2)` (:math:`K = C^2` for the EF of a multi-output Gaussian likelihood).

The components are summed by :class:`ntkgp.laplace.weight_space.full_curvature.ComponentSum`, the one implementation shared
with the weight-space curvature of the evidence (:func:`ntkgp.laplace.weight_space.full_curvature.full_ggn` / ``full_ef``); this
module only produces the per-example rows from a :class:`NetworkCore`'s Jacobians.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor
from tqdm.auto import tqdm

from .scaling import output_scale, scale_size
from .full_curvature import component_weights as _component_weights
from .full_curvature import ComponentSum, jacobian_rows
from ...likelihoods import num_outputs, validate_targets
from ...ntk.checks import check_outputs
from ...ntk.data_arguments import check_data
from ...options import Curvature
from ...ntk.network import NetworkCore
from ...progress import progress_bar

Data = Tensor | Iterable[tuple[Tensor, Tensor]]


def data_batches(
    fn: NetworkCore,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    batch_size: int,
    progress: bool | None,
    desc: str,
) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Yield ``(x_b, f_b, y_b)``: prepared inputs, outputs ``(n, C)`` at :math:`\\theta^*`, normalized
    targets.

    Args:
        fn: the network function.
        x: inputs ``(N, ...)`` with targets ``y``, or an iterable of ``(x_b, y_b)`` batches with ``y=None``.
        y: targets (any form :func:`~ntkgp.likelihoods.validate_targets` accepts), or ``None``.
        likelihood: the likelihood.
        batch_size: examples per batch when ``x`` is a tensor.
        progress: show a tqdm bar.
        desc: the bar's label.

    Raises:
        ValueError: for a non-positive ``batch_size``, mismatched ``x``/``y``, an empty data set, or
            outputs that do not match the likelihood.
        TypeError: when ``x`` is a tensor and ``y`` is not.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    check_data(x, "x")  # an array is not an iterable of batches
    if torch.is_tensor(x):
        if not torch.is_tensor(y):
            raise TypeError("y must be a tensor of targets when x is a tensor")
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
        pairs: Iterable = zip(x.split(batch_size), y.split(batch_size))
        total = -(-x.shape[0] // batch_size)
    else:
        if y is not None:
            raise ValueError("pass y=None when x is an iterable of (x, y) batches")
        pairs, total = x, None
    expected = num_outputs(likelihood)
    seen = 0
    for xb, yb in progress_bar(pairs, total, desc, progress):
        xb = fn.prepare(xb)
        with torch.no_grad():
            fb = fn.forward(xb)
        check_outputs(fb, xb.shape[0])
        if fb.shape[1] != expected:
            raise ValueError(
                f"net has {fb.shape[1]} outputs but {type(likelihood).__name__} expects {expected}"
            )
        yb = validate_targets(likelihood, yb, expected, num_data=fb.shape[0]).to(fb.device)
        seen += xb.shape[0]
        yield xb, fb, yb
    if seen == 0:
        raise ValueError("the data is empty: no batch was seen")


def dense_curvature(
    fn: NetworkCore,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    curvature: Curvature,
    batch_size: int = 64,
    progress: bool | None = None,
) -> Tensor:
    r"""The components of the dense GGN (``(K, P, P)``) or EF (``(K², P, P)``), module docstring.

    One ``vmap(jacrev)`` Jacobian per batch, ``(batch, C, P)``; memory
    :math:`O(\text{batch} \cdot C P + K P^2)`.
    """
    k = scale_size(likelihood)
    s0 = output_scale(likelihood).detach().to(dtype=fn.dtype, device=fn.device)
    fisher = curvature is Curvature.EF
    components = ComponentSum(fisher, k > 1)  # summed in place over the batches, mirrored once
    for xb, fb, yb in data_batches(
        fn, x, y, likelihood, batch_size, progress, f"dense {curvature.value.upper()}"
    ):
        jac = fn.jacobian(xb)  # (n, C, P)
        with torch.no_grad():
            components.add(jacobian_rows(jac, likelihood, fb, yb, s0, fisher))
    return components.total()


def component_weights(scale: Tensor, curvature: Curvature) -> Tensor:
    """The weights of the components for the output scale :math:`s`: :math:`s` (GGN), :math:`s s^\\top`
    (EF)."""
    return _component_weights(scale, curvature is Curvature.EF)
