"""The state dict of a weight-space posterior is a file format: its keys, their order and the types of their
values are fixed here (each curvature class writes its own part, :meth:`Curvature.state`, and a state saved by an
earlier version must still load), and a state that names a curvature its class is not restored from is refused
before anything changes. The values themselves are checked against a dense computation in test_front_door."""

from __future__ import annotations

import pytest
import torch

from ntkgp.laplace import laplace_posterior
from ntkgp.laplace.ggn.gram_curvature import function_space_curvature
from tests.posteriors.test_front_door import problem

COMMON = ["structure", "groups", "theta_sq_norms", "f", "y", "scale_size"]
OWN = {
    "full_ggn": ["components"], "full_ef": ["components"], "diag_ggn": ["components"], "diag_ef": ["components"],
    "kfac": ["blocks", "diagonal_names", "diagonal_components"],
}
BLOCK = ["module", "weight", "bias", "group", "input_factor", "output_factors"]


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", list(OWN))
def test_the_keys_and_their_types_are_those_of_the_saved_format(structure, subset):
    net, x, y, lik, _ = problem("softmax")
    state = laplace_posterior(net, x, y, lik, structure=structure, subset=subset).state_dict()
    assert list(state) == ["class", "structure", "names", "prior_precision", "curvature", "options"]
    curvature = state["curvature"]
    assert list(curvature) == COMMON + OWN[structure]
    assert curvature["structure"] == structure
    assert list(curvature["groups"]) == ["names", "shapes", "group_of", "group_names"]
    assert isinstance(curvature["scale_size"], int)
    assert all(isinstance(curvature[k], torch.Tensor) for k in ("theta_sq_norms", "f", "y"))
    if structure == "kfac":
        assert curvature["blocks"] and all(list(b) == BLOCK for b in curvature["blocks"])
        assert isinstance(curvature["diagonal_names"], list)
    else:
        assert isinstance(curvature["components"], torch.Tensor)


@pytest.mark.parametrize(("structure", "other"), [("full_ggn", "kfac"), ("kfac", "diag_ggn"), ("diag_ef", "full_ef")])
def test_a_state_naming_another_curvature_is_refused_before_anything_changes(structure, other):
    net, x, y, lik, _ = problem("softmax")
    posterior = laplace_posterior(net, x, y, lik, structure=structure)
    state = posterior.state_dict()
    state["curvature"] = laplace_posterior(net, x, y, lik, structure=other).state_dict()["curvature"]
    before = posterior.dense_precision()
    with pytest.raises(ValueError, match=f"structure '{other}'"):
        posterior.load_state_dict(state)
    torch.testing.assert_close(posterior.dense_precision(), before, rtol=0, atol=0)


def test_a_curvature_without_a_state_says_so():
    net, x, y, lik, _ = problem("softmax")
    curvature = function_space_curvature(net, x, y, lik)
    with pytest.raises(NotImplementedError, match="FunctionSpaceCurvature"):
        curvature.state()
