"""The option strings of FSVI, as ``str`` enums validated by :func:`ntkgp.options.choose`."""

from __future__ import annotations

from ..options import Option


class PriorMean(Option):
    """The prior mean :math:`\\mu_0` of the weights (``prior_mean=``)."""

    ZERO = "zero"  #: μ0 = 0
    INITIAL = "initial"  #: μ0 = the network's weights when the model is built (a random function at initialization)


class PriorLinearization(Option):
    """Where the prior's function-space covariance is linearized (``prior_linearization=``)."""

    #: about the variational mean μ: p(f_C) = N(f(X_C; μ) + J_μ (μ0 - μ), J_μ diag(s0²) J_μᵀ); never degenerate
    VARIATIONAL_MEAN = "variational_mean"
    #: about the prior mean μ0: p(f_C) = N(f(X_C; μ0), J_μ0 diag(s0²) J_μ0ᵀ), the paper's equation
    PRIOR_MEAN = "prior_mean"


class Predictive(Option):
    """How :meth:`ntkgp.fsvi.FSVI.predict` forms the predictive (``method=``)."""

    LINEARIZED = "linearized"  #: the linearized GP N(f(x; μ), J_μ diag(s²) J_μᵀ) through the likelihood
    MC = "mc"  #: Monte Carlo over weights θ ~ q through the network itself (the paper's predictive)


class ContextKind(Option):
    """Context distributions that :func:`ntkgp.fsvi.train_fsvi` builds from the training inputs (``context=``)."""

    AUTO = "auto"  #: "uniform" for (N, D) inputs, "monochrome" for images (N, channels, H, W)
    UNIFORM = "uniform"  #: uniform in the box of the training inputs
    MONOCHROME = "monochrome"  #: random monochrome images from the training pixels


class KLCovariance(Option):
    """Which covariance over the ``K·C`` outputs at the context points the function-space KL keeps
    (``kl_covariance=``)."""

    #: all outputs jointly, (K·C)² covariances: the exact KL of the linearized Gaussians (the paper's equation)
    FULL = "full"
    #: each context point's C outputs jointly, the points independent: a sum of K KLs in C dimensions
    BLOCK = "block"
    #: every output independent: a sum of K·C one-dimensional KLs (what the public JAX code of FSVI computes
    #: unless its ``full_ntk`` flag is set)
    DIAGONAL = "diagonal"
