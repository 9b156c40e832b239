r"""Likelihoods and their Laplace terms :math:`\log p`, :math:`g = \nabla_f \log p`,
:math:`\Lambda = -\nabla_f^2 \log p`.

Supported: GPyTorch's ``GaussianLikelihood`` and ``MultitaskGaussianLikelihood(rank=0)``, ntkgp's
:class:`LogisticLikelihood` and :class:`SoftmaxLikelihood`, and GPyTorch's
``SoftmaxLikelihood(mixing_weights=False)``.
"""

from .laplace_terms import gradient, hessian, hessian_sqrt, log_likelihood
from .link_approximation import (
    output_covariance_blocks,
    sigmoid_monte_carlo,
    sigmoid_probit,
    softmax_monte_carlo,
    softmax_probit,
)
from .logistic_likelihood import LogisticLikelihood
from .properties import hyperparameter_values, is_gaussian, noise_variance, num_outputs
from .softmax_likelihood import SoftmaxLikelihood
from .targets import validate_targets
from .temperature import likelihood_temperature

__all__ = [
    "LogisticLikelihood",
    "SoftmaxLikelihood",
    "gradient",
    "hessian",
    "hessian_sqrt",
    "hyperparameter_values",
    "is_gaussian",
    "likelihood_temperature",
    "log_likelihood",
    "noise_variance",
    "num_outputs",
    "output_covariance_blocks",
    "sigmoid_monte_carlo",
    "sigmoid_probit",
    "softmax_monte_carlo",
    "softmax_probit",
    "validate_targets",
]
