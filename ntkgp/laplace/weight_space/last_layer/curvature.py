r"""Curvatures of the last layer from its features: full, KFAC and diagonal, from one forward pass over the data.

With :math:`J_n = I_C \otimes \tilde\phi_n^\top` (:mod:`~ntkgp.laplace.weight_space.last_layer.features`) and the
unit factors of the likelihood (:mod:`~ntkgp.laplace.ggn.scaling`), in the Kronecker order
:math:`(c, j)` of :math:`\Theta = [W \mid b]`:

.. math::
    H_{\mathrm{GGN}} = \sum_n \tilde\Lambda_n \otimes \tilde\phi_n \tilde\phi_n^\top, \qquad
    H_{\mathrm{EF}} = \sum_n \tilde g_n \tilde g_n^\top \otimes \tilde\phi_n \tilde\phi_n^\top, \qquad
    \operatorname{diag} H_{\mathrm{GGN}} = \sum_n \operatorname{diag}(\tilde\Lambda_n) \otimes \tilde\phi_n^{\odot 2},

and KFAC (``docs/math.md``, "Structured form": :math:`\Gamma = I`, one location) :math:`H \approx G \otimes A`
with :math:`A = \sum_n \tilde\phi_n \tilde\phi_n^\top`, :math:`G = \frac1N \sum_n \tilde\Lambda_n` — exact for a
Gaussian likelihood (:math:`\tilde\Lambda_n = I`). The blocks :math:`S_{ab} = \sum_n w_{n,ab}\,\tilde\phi_n
\tilde\phi_n^\top` (:math:`w_n = \tilde\Lambda_n` or :math:`\tilde g_n \tilde g_n^\top`) are formed for the
:math:`C(C+1)/2` pairs :math:`a \le b` by one matrix product per chunk: :math:`C^2 N d_a^2 / 2` multiply-adds,
not the :math:`N C P^2` of Jacobian rows (:math:`P = C d_a`, :math:`d_a = d + 1`).

Memory: full :math:`K P^2` (the dense components; :math:`K = C` per-output Gaussian, :math:`C^2` for its EF) and
chunks of :math:`2^{22}` numbers; KFAC :math:`d_a^2 + K C^2`; diagonal :math:`K P`. For a softmax likelihood
:math:`\sum_n \tilde\Lambda_n = \operatorname{diag}(\sum_n p_n) - P^\top P` and
:math:`\operatorname{diag}\tilde\Lambda_n = p_n - p_n^{\odot 2}` are formed without a ``C × C`` matrix per example:
KFAC and the diagonal take memory linear in ``C`` per example (``C = 1,000`` classes: :math:`G` is
:math:`C^2` numbers once, 8 MB in float64). The components are those of
:class:`~ntkgp.laplace.weight_space.FullCurvature`, :class:`~ntkgp.laplace.weight_space.KroneckerGGN` and
:class:`~ntkgp.laplace.weight_space.DiagonalGGN` / :class:`~ntkgp.laplace.weight_space.DiagonalEF` over the
layer's parameters, whose evidence they give. Layers off the feature route (not an ``nn.Linear`` whose output is
the network's) take per-example Jacobians for the full and diagonal structures; KFAC then raises.
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood, SoftmaxLikelihood
from torch import Tensor

from ....likelihoods import hessian
from ....memory import LAST_LAYER_CHUNK_BYTES, chunk_rows
from ....ntk import ParameterGroups
from ....ntk.features import Layer
from ....ntk.network import NetworkCore
from ....options import Structure, choose
from ...ggn.curvature import Curvature
from ...ggn.data_pass import Data
from ..diagonal.curvature import DiagonalEF, DiagonalGGN
from ...ggn.full_curvature import ComponentSum, FullCurvature, jacobian_rows
from ..kfac.blocks import KroneckerFactors
from ..kfac.curvature import KroneckerGGN
from .features import LastLayerPass, last_layer_names
from ..posterior.weight_posterior import check_before_pass


def unit_hessian(likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor) -> Tensor:
    r""":math:`\tilde\Lambda_n = S_0^{-1/2} \Lambda_n S_0^{-1/2}`, ``(n, C, C)``, without a graph."""
    with torch.no_grad():
        root = scale0.rsqrt()
        return hessian(likelihood, f, y) * root[:, None] * root


def unit_hessian_sum(likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor) -> Tensor:
    r""":math:`\sum_n \tilde\Lambda_n`, ``(C, C)``; for a softmax :math:`\operatorname{diag}(\sum_n p_n) - P^\top P`
    (no ``C × C`` matrix per example)."""
    with torch.no_grad():
        if isinstance(likelihood, SoftmaxLikelihood):
            p = torch.softmax(f, dim=-1)
            return torch.diag(p.sum(dim=0)) - p.T @ p
        return unit_hessian(likelihood, f, y, scale0).sum(dim=0)


def unit_hessian_diagonal(likelihood: Likelihood, f: Tensor, y: Tensor, scale0: Tensor) -> Tensor:
    r""":math:`\operatorname{diag}\tilde\Lambda_n`, ``(n, C)``; for a softmax :math:`p_n - p_n^{\odot 2}`."""
    with torch.no_grad():
        if isinstance(likelihood, SoftmaxLikelihood):
            p = torch.softmax(f, dim=-1)
            return p - p.square()
        return unit_hessian(likelihood, f, y, scale0).diagonal(dim1=-2, dim2=-1)


def pair_grams(phi: Tensor, weights: Tensor) -> Tensor:
    r""":math:`\sum_n w_{nk} \tilde\phi_n \tilde\phi_n^\top`, ``(K, d_a, d_a)``, for ``phi`` ``(n, d_a)`` and
    ``weights`` ``(n, K)``: one matrix product per chunk of
    :data:`ntkgp.memory.LAST_LAYER_CHUNK_BYTES`."""
    n, d = phi.shape
    k = weights.shape[1]
    out = phi.new_zeros(k * d, d)
    rows = chunk_rows(LAST_LAYER_CHUNK_BYTES, k * d, phi.dtype)
    for start in range(0, n, rows):
        part, w = phi[start:start + rows], weights[start:start + rows]
        out.addmm_((w[:, :, None] * part[:, None, :]).reshape(part.shape[0], k * d).T, part)
    return out.reshape(k, d, d)


def group_sq_norms(core: NetworkCore, groups: ParameterGroups) -> Tensor:
    r""":math:`\|\theta^*_g\|^2` per group of ``groups`` (names as ``core.names``), ``(G,)``."""
    squares = torch.stack([p.detach().square().sum() for p in core.parameters()])
    index = torch.tensor(groups.group_of, device=squares.device)
    return squares.new_zeros(groups.num_groups).index_add_(0, index, squares)


class _FeatureSums:
    """The running sums of one structure over the batches of the feature route (module docstring)."""

    def __init__(self, structure: Structure, layer: Layer, num_outputs: int, num_components: int) -> None:
        self.structure, self.layer, self.c, self.k = structure, layer, num_outputs, num_components
        self.fisher = structure in (Structure.FULL_EF, Structure.DIAG_EF)
        full = structure in (Structure.FULL_GGN, Structure.FULL_EF)
        self.pairs = torch.triu_indices(num_outputs, num_outputs) if full else None  # a ≤ b, the full blocks only
        self.total: Tensor | None = None
        self.outputs: Tensor | None = None  # KFAC's Σ Λ̃ per component, float64
        self.count = 0

    def _add(self, value: Tensor) -> None:
        self.total = value if self.total is None else self.total.add_(value)

    def add(self, data, phi: Tensor, f: Tensor, y: Tensor) -> None:
        s0, lik, per_output = data.scale0, data.likelihood, self.k > 1
        self.count += phi.shape[0]
        if self.structure is Structure.KFAC:
            self._add(phi.T.double() @ phi.double())
            if per_output:  # Λ̃ = I: component k holds column k of the root
                g = torch.diag_embed(torch.eye(self.c, dtype=torch.float64, device=phi.device)) * phi.shape[0]
            else:
                g = unit_hessian_sum(lik, f, y, s0).double().unsqueeze(0)
            self.outputs = g if self.outputs is None else self.outputs.add_(g)
            return
        grad = data.unit_gradient(f, y) if self.fisher else None
        if self.structure in (Structure.DIAG_GGN, Structure.DIAG_EF):
            weights = grad.square() if self.fisher else unit_hessian_diagonal(lik, f, y, s0)
            self._add(weights.T @ phi.square())  # (C, d_a); per-output components are its rows
            return
        if not self.fisher and per_output:  # Λ̃ = I: one Gram of the features
            self._add(phi.T @ phi)
            return
        a, b = self.pairs[0].to(phi.device), self.pairs[1].to(phi.device)
        if self.fisher:
            weights = grad[:, a] * grad[:, b]
        else:
            weights = unit_hessian(lik, f, y, s0)[:, a, b]
        self._add(pair_grams(phi, weights))

    def curvature(self, core: NetworkCore, groups: ParameterGroups, theta_sq: Tensor, f: Tensor, y: Tensor
                  ) -> Curvature:
        """The curvature over the layer's parameters, in the network's flat order."""
        layer, c, k = self.layer, self.c, self.k
        index = layer.index(core.offset, core.device).reshape(-1)  # Kronecker position → flat position
        p = index.numel()
        if self.structure is Structure.KFAC:
            group = dict(zip(groups.names, groups.group_of))[layer.weight]
            block = KroneckerFactors(layer.name, layer.weight, layer.bias, group, self.total.to(core.dtype),
                                     (self.outputs / self.count).to(core.dtype))
            return KroneckerGGN(groups, theta_sq, f, y, k, [block], [], f.new_zeros(k, 0))
        if self.structure in (Structure.DIAG_GGN, Structure.DIAG_EF):
            rows = self.total  # (C, d_a)
            if k > 1:  # component k (GGN) or (k, k) (EF, pairs a·C + b): output k's rows only
                ar = torch.arange(c, device=rows.device)
                if self.fisher:
                    blocks = rows.new_zeros(c, c, c, rows.shape[1])
                    blocks[ar, ar, ar] = rows
                    blocks = blocks.flatten(0, 1)
                else:
                    blocks = rows.new_zeros(c, c, rows.shape[1])
                    blocks[ar, ar] = rows
                kron = blocks.reshape(blocks.shape[0], p)
            else:
                kron = rows.reshape(1, p)
            components = torch.empty_like(kron)
            components[:, index] = kron
            kind = DiagonalEF if self.fisher else DiagonalGGN
            return kind(groups, theta_sq, f, y, k, components)
        d = p // c
        eye = torch.eye(c, dtype=f.dtype, device=f.device)
        if not self.fisher and k > 1:  # component k: E_kk ⊗ A
            kron = torch.einsum("kab,ij->kaibj", torch.diag_embed(eye), self.total)
        else:
            blocks = f.new_zeros(c, c, d, d)
            a, b = self.pairs
            blocks[a, b] = self.total
            blocks[b, a] = self.total
            if self.fisher and k > 1:  # component (a, b): E_ab ⊗ S_ab
                ar = torch.arange(c, device=f.device)
                kron = f.new_zeros(c, c, c, d, c, d)
                kron[ar[:, None], ar[None, :], ar[:, None], :, ar[None, :], :] = blocks
            else:
                kron = blocks.permute(0, 2, 1, 3)
        kron = kron.reshape(-1, p, p)
        components = torch.empty_like(kron)
        components[:, index[:, None], index[None, :]] = kron
        return FullCurvature(groups, theta_sq, f, y, k, components, self.fisher)


def _jacobian_components(structure: Structure, data, xb: Tensor, f: Tensor, y: Tensor) -> Tensor:
    """One batch's components from per-example Jacobians (a layer off the feature route)."""
    jac = data.core.jacobian(xb)  # (n, C, P)
    per_output = data.scale0.shape[0] > 1
    if structure in (Structure.FULL_GGN, Structure.FULL_EF):
        return jacobian_rows(jac, data.likelihood, f, y, data.scale0, structure is Structure.FULL_EF)
    if structure is Structure.DIAG_GGN:
        rows = torch.einsum("ncp,ncm->nmp", jac, data.unit_hessian_sqrt(f, y)).square().sum(dim=0)
        return rows if per_output else rows.sum(dim=0, keepdim=True)
    grad = data.unit_gradient(f, y)
    if per_output:
        rows = jac * grad[..., None]
        return torch.einsum("nap,nbp->abp", rows, rows).flatten(0, 1)
    return torch.einsum("nc,ncp->np", grad, jac).square().sum(dim=0, keepdim=True)


def fit_last_layer(core: NetworkCore, groups: ParameterGroups, likelihood: Likelihood, name: str,
                   structure: Structure, x: Data, y: Tensor | None, batch_size: int, progress: bool
                   ) -> tuple[Curvature, Layer | None]:
    """The curvature ``structure`` of the layer ``name`` (``core`` is over its parameters, ``groups`` their prior
    groups), from one pass over the data; and the layer in structured form on the feature route, else ``None``.

    Raises:
        ValueError: for ``structure="kfac"`` off the feature route, or KFAC with the layer's weight and bias in
            two prior groups.
    """
    if structure is Structure.KFAC:
        index = dict(zip(groups.names, groups.group_of))
        if len({index[n] for n in core.names}) > 1:
            raise ValueError(
                "prior_structure: KFAC treats the last layer's weight and bias as one Kronecker block, so they need "
                "one prior precision; use prior_structure='layer' or 'network'"
            )
    passing = LastLayerPass(core, likelihood, name)
    per_output = passing.data.scale0.shape[0] > 1
    sums: _FeatureSums | None = None
    generic = ComponentSum(structure is Structure.FULL_EF, per_output) if structure.value.startswith("full") else None
    diagonal = 0
    for xb, phi, fb, yb in passing.batches(x, y, batch_size, progress, f"last layer ({structure.value})"):
        if phi is not None:
            if sums is None:
                sums = _FeatureSums(structure, passing.layer, fb.shape[1], passing.data.scale0.shape[0])
            sums.add(passing.data, phi, fb, yb)
        elif structure is Structure.KFAC:
            raise ValueError(
                f"structure='kfac' over the last layer needs an nn.Linear layer whose output is the network's output; "
                f"'{name}' is not one: use structure='full_ggn' or 'diag_ggn' (per-example Jacobians)"
            )
        elif generic is not None:
            with torch.no_grad():
                generic.add(_jacobian_components(structure, passing.data, xb, fb, yb))
        else:
            diagonal = diagonal + _jacobian_components(structure, passing.data, xb, fb, yb)
    f_all, y_all = passing.data.collected()
    theta_sq = group_sq_norms(core, groups)
    k = passing.data.scale0.shape[0]
    if sums is not None:
        return sums.curvature(core, groups, theta_sq, f_all, y_all), passing.layer
    if generic is not None:
        return FullCurvature(groups, theta_sq, f_all, y_all, k, generic.total(), structure is Structure.FULL_EF), None
    kind = DiagonalEF if structure is Structure.DIAG_EF else DiagonalGGN
    return kind(groups, theta_sq, f_all, y_all, k, diagonal), None


def last_layer_curvature(
    net,
    x: Data,
    y: Tensor | None,
    likelihood: Likelihood,
    structure: str = "full_ggn",
    layer: str | None = None,
    prior_structure="layer",
    batch_size: int = 64,
    progress: bool = False,
    input_shape: tuple[int, ...] | None = None,
) -> Curvature:
    r"""The curvature ``structure`` of one layer's parameters (default the last layer's), from one forward pass over
    the data (module docstring): a :class:`~ntkgp.laplace.weight_space.Curvature` whose
    :meth:`~ntkgp.laplace.weight_space.Curvature.log_marginal_likelihood` is the layer's Laplace evidence for any
    prior precisions and likelihood hyperparameters.

    Args:
        net: the trained network; never modified.
        x, y, likelihood, batch_size, progress, input_shape: as :func:`~ntkgp.laplace.compute_curvature`.
        structure: ``"full_ggn"`` (default), ``"full_ef"``, ``"kfac"``, ``"diag_ggn"`` or ``"diag_ef"``.
        layer: the module's name; default the last module that owns trainable parameters.
        prior_structure: the prior groups of the layer's parameters.

    Example:
        >>> curvature = last_layer_curvature(net, x, y, likelihood, structure="kfac")
        >>> evidence = curvature.log_marginal_likelihood(torch.tensor([1.0], dtype=torch.float64), likelihood)
        >>> evidence.shape
        torch.Size([])
    """
    kind = choose(Structure, structure, "structure")
    name, names = last_layer_names(net, layer)
    core, groups = check_before_pass(net, likelihood, 1.0, prior_structure, input_shape, 256, names)
    return fit_last_layer(core, groups, likelihood, name, kind, x, y, batch_size, progress)[0]
