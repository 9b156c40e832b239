"""Option attributes of LaplaceGGNMarginalLogLikelihood (issue 29), enumerated with option_attributes: every
documented value assigned after construction gives the value of an MLL built with it (or the same error)."""

import pytest
import torch

import ntkgp
from ntkgp.laplace import EvidenceOptions
from ntkgp.options import option_attributes
from tests.problems import make_problem

SEEDED = EvidenceOptions(seed=0, num_probes=8, preconditioner_rank=3)  # the matrix-free route reproducible
OPTIONS = [None, SEEDED, EvidenceOptions(dense_memory_limit=0, seed=1)]


def values(attribute):
    enum = getattr(attribute.validate, "enum", None)
    return list(enum) + [m.value for m in enum] if enum is not None else OPTIONS


def outcome(mll, model, x, y):
    try:
        return mll(model(x), y).detach()
    except (ValueError, TypeError) as error:
        return type(error)


@pytest.mark.parametrize("structure", [pytest.param("network", marks=pytest.mark.slow), "layer"])
def test_every_assignment_equals_a_freshly_built_mll(structure):
    net, x, y, lik, _ = make_problem("softmax4")
    model = ntkgp.NTKGP(net, x, y, lik, prior_precision=2.0, prior_structure=structure).train()
    attributes = option_attributes(ntkgp.LaplaceGGNMarginalLogLikelihood)
    assert set(attributes) == {"curvature", "space", "method", "options"}
    for name, attribute in attributes.items():
        built = {"options": SEEDED} if name != "options" else {}
        mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, **built)
        outcome(mll, model, x, y)
        for value in values(attribute):
            setattr(mll, name, value)
            fresh = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, model, **{**built, name: value})
            got, expected = outcome(mll, model, x, y), outcome(fresh, model, x, y)
            if isinstance(expected, type):
                assert got is expected, (name, value)
            else:
                assert torch.equal(got, expected), (name, value)


def test_invalid_assignments_are_refused_naming_the_attribute():
    net, x, y, lik, _ = make_problem("binary")
    mll = ntkgp.LaplaceGGNMarginalLogLikelihood(lik, ntkgp.NTKGP(net, x, y, lik))
    with pytest.raises(ValueError, match="method"):
        mll.method = "lanczos"
    with pytest.raises(TypeError, match="options"):
        mll.options = {"num_probes": 3}
    assert mll.method == "auto" and isinstance(mll.options, EvidenceOptions)
