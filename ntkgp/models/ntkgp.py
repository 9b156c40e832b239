"""``NTKGP``: the Laplace-GGN linearised network as a GPyTorch GP."""

from __future__ import annotations

import copy

import torch
from gpytorch.distributions import MultitaskMultivariateNormal, MultivariateNormal
from gpytorch.likelihoods import Likelihood
from gpytorch.models import GP, ExactGP
from linear_operator.operators import RootLinearOperator
from torch import nn

from ..kernels import NTKKernel
from ..likelihoods import gradient, hessian, is_gaussian, num_outputs, validate_targets
from ..means import LinearisedNetworkMean
from ..mlls.laplace_ggn_evidence import curvature_factor, laplace_ggn_evidence
from ..ntk import GroupSpec
from .site_posterior import SitePosterior


def _flatten_inputs(x: torch.Tensor, input_shape: tuple[int, ...] | None, argument: str) -> tuple[torch.Tensor, tuple | None]:
    """GPyTorch takes ``(N, D)`` inputs: flatten ``(N, *input_shape)`` and remember the shape."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 1:
        raise ValueError(f"{argument} must have shape (N, ...) with a feature dimension, got {tuple(x.shape)}")
    if x.dim() > 2:
        return x.flatten(1), tuple(x.shape[1:]) if input_shape is None else input_shape
    return x, input_shape


class NTKGP(GP):
    r"""The Laplace-GGN posterior of a trained network, as a Gaussian process over its outputs.

    The linearised network :math:`f_{lin}(x) = f(x;\theta^*) + J(x)(\theta - \theta^*)` with prior
    :math:`\theta_g \sim N(0, \delta_g^{-1} I)` is the GP :math:`GP(m, K)` with mean
    :math:`m(x) = f(x;\theta^*) - J(x)\theta^*` and the NTK kernel :math:`K` (:class:`~ntkgp.NTKKernel`).
    Conditioning it on the data through the likelihood's Gaussian sites at :math:`f_n = f(x_n;\theta^*)`,
    natural parameters :math:`(\Lambda_n f_n + g_n, \Lambda_n)`, gives the Laplace-GGN GLM predictive:

    .. math::
        f(x_*) \sim N\big(\mu(x_*),\; J_* H^{-1} J_*^\top\big), \qquad
        H = \textstyle\sum_n J_n^\top \Lambda_n J_n + P_0,

    computed in function space as :math:`K_{**} - K_{*X}\Lambda^{1/2}(I + \Lambda^{1/2}K_{XX}\Lambda^{1/2})^{-1}
    \Lambda^{1/2}K_{X*}`. The mean :math:`\mu(x_*)` is the linearised network at the posterior mean
    :math:`\theta^* + H^{-1}\nabla_\theta \log p(D, \theta^*)`: it equals :math:`f(x_*;\theta^*)` when
    :math:`\theta^*` is a stationary point of the regularised loss under these hyperparameters (a MAP), and
    it is what makes conditioning on new data an exact Bayesian update of the linearised model.

    ``NTKGP(net, train_x, train_y, likelihood)`` returns

    * for a Gaussian likelihood (``GaussianLikelihood``, C = 1, or ``MultitaskGaussianLikelihood(rank=0)``)
      an :class:`ExactNTKGP`, a ``gpytorch.models.ExactGP``: GPyTorch's ``ExactMarginalLogLikelihood`` is
      the linearised-GP evidence and ``get_fantasy_model`` works;
    * for :class:`~ntkgp.likelihoods.LogisticLikelihood` / :class:`~ntkgp.likelihoods.SoftmaxLikelihood` a
      :class:`LaplaceNTKGP` with the same interface.

    In train mode ``model(x)`` is the prior :math:`N(m(x), K(x,x))`; in eval mode the posterior above, a
    ``MultivariateNormal`` (C = 1) or an interleaved ``MultitaskMultivariateNormal`` ``(N, C)`` whose
    covariance stays lazy, so that ``.variance`` never forms the joint matrix.
    ``model.likelihood(model(x))`` is the predictive over ``y``.

    Args:
        net: the trained network ``(N, *input_shape) → (N, C)``, in eval mode if it has BatchNorm/dropout.
            Held by reference, never modified.
        train_x: training inputs ``(N, ...)``; inputs with more than one feature dimension are flattened
            for GPyTorch and reshaped for the network.
        train_y: targets (see :func:`ntkgp.likelihoods.validate_targets`).
        likelihood: a supported likelihood (its number of outputs must match the network's).
        prior_precision: initial :math:`\delta` (float or one per group).
        groups: prior-precision groups (``"layer"``, ``"network"``, ``"parameter"`` or a mapping).
        **kernel_kwargs: passed to :class:`~ntkgp.NTKKernel` (``chunk_size``, ``strategy``, ``progress``, ...).
    """

    def __new__(cls, *args, **kwargs):
        if cls is NTKGP:
            likelihood = kwargs.get("likelihood", args[3] if len(args) > 3 else None)
            if likelihood is None:
                raise TypeError("NTKGP needs a likelihood")
            return super().__new__(ExactNTKGP if is_gaussian(likelihood) else LaplaceNTKGP)
        return super().__new__(cls)

    def __init__(
        self,
        net: nn.Module,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        likelihood: Likelihood,
        prior_precision: float | torch.Tensor = 1.0,
        groups: GroupSpec = "layer",
        **kernel_kwargs,
    ) -> None:
        x, y, kernel, state = self._setup(net, train_x, train_y, likelihood, prior_precision, groups, kernel_kwargs)
        self._init_data(x, y, likelihood)
        self.__dict__.update(state)
        self.covar_module = kernel
        self.mean_module = LinearisedNetworkMean(kernel.engine)

    def _init_data(self, x: torch.Tensor, y: torch.Tensor, likelihood: Likelihood) -> None:
        """Initialise the GPyTorch base class with the training data (differs between exact and Laplace)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared construction
    def _setup(
        self,
        net: nn.Module,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        likelihood: Likelihood,
        prior_precision: float | torch.Tensor,
        groups: GroupSpec,
        kernel_kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor, NTKKernel, dict]:
        """Check everything and build the kernel; returns ``x``, ``y``, the kernel and the attributes to set."""
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
        expected = num_outputs(likelihood)  # raises for unsupported likelihoods
        x, input_shape = _flatten_inputs(train_x, kernel_kwargs.pop("input_shape", None), "train_x")
        kernel = NTKKernel(net, prior_precision=prior_precision, groups=groups, input_shape=input_shape, **kernel_kwargs)
        x = x.to(dtype=kernel.engine.dtype, device=kernel.engine.device) if x.is_floating_point() else x
        f = kernel.engine.outputs(x, "train_x")
        if f.shape[1] != expected:
            raise ValueError(
                f"net has {f.shape[1]} outputs but the likelihood {type(likelihood).__name__} expects {expected}"
            )
        y = validate_targets(likelihood, train_y, f.shape[1], num_data=x.shape[0], name="train_y")
        y = y.to(device=f.device)
        init_args = {"prior_precision": prior_precision, "groups": groups, "input_shape": input_shape, **kernel_kwargs}
        state = {"_init_args": init_args, "_f_train": f, "_y": y}
        return x, y, kernel, state

    @property
    def net(self) -> nn.Module:
        return self.covar_module.engine.net

    @property
    def num_outputs(self) -> int:
        return self._f_train.shape[1]

    @property
    def num_data(self) -> int:
        return self._f_train.shape[0]

    @property
    def train_x(self) -> torch.Tensor:
        return self.train_inputs[0]

    def _mvn(self, mean: torch.Tensor, covar) -> MultivariateNormal:
        if self.num_outputs == 1:
            return MultivariateNormal(mean.reshape(-1), covar)
        return MultitaskMultivariateNormal(mean.reshape(-1, self.num_outputs), covar, interleaved=True)

    def forward(self, x: torch.Tensor) -> MultivariateNormal:
        """The prior of the linearised network at ``x``: ``N(m(x), K(x, x))``."""
        return self._mvn(self.mean_module(x), self.covar_module(x))

    def _targets(self, target: torch.Tensor | None) -> torch.Tensor:
        if target is None:
            return self._y
        return validate_targets(self.likelihood, target, self.num_outputs, num_data=self.num_data, name="target")

    # ------------------------------------------------------------------ evidence
    def log_marginal_likelihood(
        self, target: torch.Tensor | None = None, curvature: str = "ggn", space: str = "auto"
    ) -> torch.Tensor:
        r"""The Laplace-GGN evidence :math:`\log q(D)` (total, not divided by N), see
        :func:`ntkgp.mlls.laplace_ggn_evidence`. Differentiable w.r.t. every hyperparameter; the Jacobians and
        Grams are computed once and reused."""
        return laplace_ggn_evidence(
            self.covar_module, self.likelihood, self.train_x, self._f_train, self._targets(target), curvature, space
        )

    # ------------------------------------------------------------------ posterior in function space
    def site_posterior(self) -> SitePosterior:
        """The Gaussian-site posterior over the training outputs (differentiable in the hyperparameters).

        Without gradients (prediction) it is cached until a hyperparameter or the network's weights change.
        """
        if torch.is_grad_enabled():
            return self._fit_site_posterior()
        key = (
            self.covar_module.engine.params_version(),
            tuple((p.data_ptr(), p._version) for p in self.hyperparameters()),
        )
        cached = self.__dict__.get("_site_posterior_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        post = self._fit_site_posterior()
        self.__dict__["_site_posterior_cache"] = (key, post)
        return post

    def _fit_site_posterior(self) -> SitePosterior:
        f, y, x = self._f_train, self._y, self.train_x
        factor = curvature_factor(self.likelihood, f, y, "ggn")
        m = self.mean_module(x).reshape(f.shape)
        lam = hessian(self.likelihood, f, y)
        natural = (lam @ (f - m).unsqueeze(-1)).squeeze(-1) + gradient(self.likelihood, f, y)
        return SitePosterior.fit(self.covar_module(x).to_dense(), factor, natural.reshape(-1))

    def posterior(self, x: torch.Tensor) -> MultivariateNormal:
        """The GLM predictive over f at ``x`` (function-space Woodbury form, lazy covariance)."""
        x, _ = _flatten_inputs(x, None, "x")
        post = self.site_posterior()
        cross = self.covar_module(x, self.train_x).to_dense()
        mean = self.mean_module(x).reshape(-1) + post.mean_correction(cross)
        covar = self.covar_module(x) - RootLinearOperator(post.variance_root(cross))
        return self._mvn(mean, covar)

    # ------------------------------------------------------------------ conditioning
    def condition_on(self, x_new: torch.Tensor, y_new: torch.Tensor) -> NTKGP:
        """A new model conditioned on the union of the training data and ``(x_new, y_new)``, same θ*.

        An exact Bayesian update of the linearised model: the network is not retrained, and the new
        points enter through their Gaussian sites at ``f(x_new; θ*)``. The current hyperparameters are
        copied; the network is shared (never copied).
        """
        x_new, _ = _flatten_inputs(x_new, None, "x_new")
        if x_new.shape[1:] != self.train_x.shape[1:]:
            raise ValueError(f"x_new must have shape (M, {self.train_x.shape[1]}), got {tuple(x_new.shape)}")
        y_new = validate_targets(self.likelihood, y_new, self.num_outputs, num_data=x_new.shape[0], name="y_new")
        x_all = torch.cat([self.train_x, x_new.to(self.train_x)])
        y_all = torch.cat([self._y, y_new.to(self._y)])
        args = dict(self._init_args)
        args["prior_precision"] = self.covar_module.prior_precision.detach().clone()
        new = type(self)(self.net, x_all, y_all, copy.deepcopy(self.likelihood), **args)
        new.train(self.training)
        return new


class ExactNTKGP(NTKGP, ExactGP):
    """:class:`NTKGP` with a Gaussian likelihood: a ``gpytorch.models.ExactGP`` on the linearised network."""

    def _init_data(self, x: torch.Tensor, y: torch.Tensor, likelihood: Likelihood) -> None:
        ExactGP.__init__(self, x, y.squeeze(-1) if y.shape[-1] == 1 else y, likelihood)

    def __call__(self, *args, **kwargs):
        args = [_flatten_inputs(a, None, "x")[0] if torch.is_tensor(a) else a for a in args]
        return ExactGP.__call__(self, *args, **kwargs)


class LaplaceNTKGP(NTKGP):
    """:class:`NTKGP` with a classification likelihood: the Laplace-GGN posterior through Gaussian sites."""

    def _init_data(self, x: torch.Tensor, y: torch.Tensor, likelihood: Likelihood) -> None:
        GP.__init__(self)
        self.train_inputs = (x,)
        self.train_targets = y
        self.likelihood = likelihood

    def __call__(self, x: torch.Tensor) -> MultivariateNormal:
        if self.training:
            return self.forward(_flatten_inputs(x, None, "x")[0])
        return self.posterior(x)
