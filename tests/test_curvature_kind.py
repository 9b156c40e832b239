"""The ``curvature=`` option enum is ``ntkgp.options.CurvatureKind``; its former name ``Curvature`` still imports,
with a ``DeprecationWarning``, and no longer shadows the curvature base class of ``ntkgp.laplace``."""

import pytest

import ntkgp
from ntkgp.options import CurvatureKind, choose


def test_the_former_name_warns_and_is_the_same_enum():
    with pytest.warns(DeprecationWarning, match="CurvatureKind"):
        from ntkgp.options import Curvature
    assert Curvature is CurvatureKind
    assert choose(Curvature, "ef", "curvature") is CurvatureKind.EF
    assert ntkgp.laplace.Curvature is not CurvatureKind  # the ABC of the structured curvatures


def test_other_missing_names_still_raise():
    with pytest.raises(AttributeError, match="NoSuchOption"):
        ntkgp.options.NoSuchOption  # noqa: B018
