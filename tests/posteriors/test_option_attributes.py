"""Option attributes of the weight-space posteriors (issue 29), enumerated with ntkgp.options.option_attributes so
that a new option is covered when it is added: an assignable one equals a posterior built with the value, a fixed
one raises AttributeError saying to build a new posterior (assigning its own value is a no-op)."""

import gpytorch
import pytest
import torch

from ntkgp.laplace.weight_space import (DiagLaplace, FullLaplace, KFACLaplace, LastLayerDiagLaplace,
                                       LastLayerKFACLaplace, LastLayerLaplace)
from ntkgp.laplace.weight_space.subnetwork.laplace import SubnetLaplace
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.options import option_attributes
from tests.helpers import mlp

CLASSES = [FullLaplace, KFACLaplace, DiagLaplace, LastLayerLaplace, LastLayerKFACLaplace, LastLayerDiagLaplace,
           SubnetLaplace]
#: every documented value of the assignable options
VALUES = {"damping": [True, False]}


def problem():
    torch.manual_seed(0)
    net = mlp(3, 5, 3, depth=1)
    x = torch.randn(15, 3, dtype=torch.float64)
    return net, x, torch.randint(0, 3, (15,)), SoftmaxLikelihood(num_classes=3).double()


def build(cls, net, x, y, lik, **kwargs):
    """A posterior of ``cls``; a subnetwork posterior over the first layer's weight."""
    if cls is SubnetLaplace:
        kwargs["subnetwork"] = [next(iter(dict(net.named_parameters())))]
    return cls(net, x, y, lik, **kwargs)


def summary(posterior, x):
    return [posterior.log_det_precision(), posterior.glm_covariance(x), posterior.dense_precision()]


def other_value(attribute, current):
    """A valid value other than ``current`` for a fixed attribute."""
    enum = getattr(attribute.validate, "enum", None)
    if enum is not None:
        return next(m for m in enum if m != current)
    if isinstance(current, gpytorch.likelihoods.Likelihood):
        return SoftmaxLikelihood(num_classes=3).double()
    return f"{current}_other"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_option_attribute_is_assignable_or_fixed(cls):
    net, x, y, lik = problem()
    attributes = option_attributes(cls)
    assert {"likelihood", "structure"} <= set(attributes)
    for name, attribute in attributes.items():
        posterior = build(cls, net, x, y, lik, prior_precision=2.0)
        current = getattr(posterior, name)
        setattr(posterior, name, current)  # its own value: a no-op
        if attribute.fixed is not None:
            with pytest.raises(AttributeError, match="build a new"):
                setattr(posterior, name, other_value(attribute, current))
            assert getattr(posterior, name) is current
            continue
        for value in VALUES[name]:
            summary(posterior, x)  # something cached at the old value
            setattr(posterior, name, value)
            fresh = build(cls, net, x, y, lik, prior_precision=2.0, **{name: value})
            for a, b in zip(summary(posterior, x), summary(fresh, x)):
                assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_invalid_assignments_are_refused_naming_the_attribute():
    net, x, y, lik = problem()
    posterior = KFACLaplace(net, x, y, lik)
    with pytest.raises(TypeError, match="damping"):
        posterior.damping = "yes"
    with pytest.raises(ValueError, match="curvature"):
        FullLaplace(net, x, y, lik).curvature = "hessian"
