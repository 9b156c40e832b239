"""Every option attribute of every public ntkgp class, assigned after construction (issue 29), generated.

The classes are found by walking ntkgp's public modules; their option attributes by
:func:`ntkgp.options.option_attributes`. For each attribute and each documented value (every member of a
``choice()`` enum, as its string and as the member; otherwise the values listed in the class's factory below):

* an assignable attribute (``on_change=``) must give an object that predicts as one freshly built with that
  value, after the old object's caches were filled;
* a fixed attribute (``fixed=``) must raise ``AttributeError`` saying to build a new object for another value,
  and accept its own value;
* a value the constructor refuses is refused on assignment too (naming the attribute), leaving the value as it was.

A class with option attributes needs a factory in :data:`FACTORIES` (how to build a small instance and what it
predicts): the test fails with "no factory for class X" otherwise, so that a new class or option is covered.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import gpytorch
import pytest
import torch

import ntkgp
from ntkgp.options import option_attributes
from tests.helpers import mlp

D64 = torch.float64


def public_classes() -> dict[str, type]:
    """Every class defined in ntkgp and exported by a public module (its ``__all__``, or its public names)."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(ntkgp.__path__, "ntkgp."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        module = importlib.import_module(info.name)
        names = getattr(module, "__all__", None)
        if names is None:
            names = [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name, None)
            if inspect.isclass(obj) and obj.__module__.startswith("ntkgp."):
                found.setdefault(obj.__qualname__, obj)
    return found


# ---------------------------------------------------------------------------------------------- the factories
def _data():
    torch.manual_seed(0)
    x = torch.randn(12, 3, dtype=D64)
    return x, torch.sin(x.sum(-1)), torch.randn(5, 3, dtype=D64)


def _gaussian():
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    likelihood.noise = 0.05
    return likelihood


def _ntkgp(classification: bool = False, **options):
    x, y, _ = _data()
    if classification:
        likelihood = ntkgp.likelihoods.SoftmaxLikelihood(num_classes=3).double()
        return ntkgp.NTKGP(mlp(d_out=3), x, (y > 0).long() + (y > 0.5).long(), likelihood, **options).eval()
    return ntkgp.NTKGP(mlp(), x, y, _gaussian(), **options).eval()


def _predictive(model) -> list[torch.Tensor]:
    _, _, x_test = _data()
    with torch.no_grad():
        pred = model(x_test)
        factor = model.site_posterior().chol  # its shape tells the space it was factorized in (both forms are exact)
        return [pred.mean, pred.variance, pred.covariance_matrix, torch.tensor(factor.shape, dtype=D64)]


def _kernel_values(kernel) -> list[torch.Tensor]:
    x, _, x_test = _data()
    with torch.no_grad():
        return [kernel(x).to_dense(), kernel(x_test, x).to_dense(), kernel(x_test, diag=True)]


def _mean_values(mean) -> list[torch.Tensor]:
    x, _, x_test = _data()
    with torch.no_grad():
        return [mean(x), mean(x_test)]


@dataclass
class Factory:
    """How to build a small instance with given options, and what it predicts."""

    build: Callable[..., Any]
    evaluate: Callable[[Any], list[torch.Tensor]]
    #: documented values of the attributes whose validator is not a ``choice()`` of an enum
    values: dict[str, list] = field(default_factory=dict)
    #: values the constructor refuses, per attribute (besides a plain ``object()``, refused by every validator)
    invalid: dict[str, list] = field(default_factory=dict)


_KERNEL_VALUES = {
    "chunk_size": [1, 5, 256],
    "cache_size": [0, 1, 4],
    "progress": [False, True],
    "prior_structure": ["network", "layer", "parameter"],
    "input_shape": [None, (3,)],
}
_KERNEL_INVALID = {"chunk_size": [0, 2.5, True], "cache_size": [-1], "progress": ["yes"], "input_shape": [(0,)]}
_MODEL_VALUES = {**_KERNEL_VALUES, "prediction_chunk_size": [None, 1, 3]}
_MODEL_INVALID = {**_KERNEL_INVALID, "prediction_chunk_size": [0, -2, 1.5]}
_MEAN = Factory(
    build=None, evaluate=_mean_values, values={"cache_size": [0, 1, 4]}, invalid={"cache_size": [-1, 1.5]}
)

#: One factory per class with option attributes, by class name. Add one for every new class that gets options.
FACTORIES: dict[str, Factory] = {
    "NTKGP": Factory(_ntkgp, _predictive, _MODEL_VALUES, _MODEL_INVALID),
    "ExactNTKGP": Factory(_ntkgp, _predictive, _MODEL_VALUES, _MODEL_INVALID),
    "LaplaceNTKGP": Factory(lambda **o: _ntkgp(True, **o), _predictive, _MODEL_VALUES, _MODEL_INVALID),
    "NTKKernel": Factory(lambda **o: ntkgp.NTKKernel(mlp(d_out=2), **o), _kernel_values, _KERNEL_VALUES, _KERNEL_INVALID),
    "LinearizedNetworkMean": Factory(
        lambda **o: ntkgp.LinearizedNetworkMean(ntkgp.NTKEngine(mlp(d_out=2)), **o),
        _MEAN.evaluate, _MEAN.values, _MEAN.invalid,
    ),
    "NetworkMean": Factory(
        lambda **o: ntkgp.NetworkMean(ntkgp.NTKEngine(mlp(d_out=2)), **o), _MEAN.evaluate, _MEAN.values, _MEAN.invalid
    ),
}


#: Classes whose option attributes are enumerated, each against a freshly built object, by a generated test of
#: their own package (built from ``option_attributes`` there too); base classes and mixins are covered through
#: the subclasses that those tests build. A class with options in neither table fails below.
COVERED_ELSEWHERE: dict[str, str] = {
    "SFR": "tests/models/sfr/test_sfr_options.py",
    "FSVI": "tests/fsvi/test_fsvi_options.py",
    "GaussianParameterPrior": "tests/fsvi/test_fsvi_options.py",
    "LogisticLikelihood": "tests/likelihoods/test_likelihood_options.py",
    "SoftmaxLikelihood": "tests/likelihoods/test_likelihood_options.py",
    "LinkApproximation": "tests/likelihoods/test_likelihood_options.py",
    "TemperatureMixin": "tests/likelihoods/test_likelihood_options.py",
    "LaplaceGGNMarginalLogLikelihood": "tests/mlls/test_option_attributes.py",
    "FullLaplace": "tests/posteriors/test_option_attributes.py",
    "KFACLaplace": "tests/posteriors/test_option_attributes.py",
    "DiagLaplace": "tests/posteriors/test_option_attributes.py",
    "LastLayerLaplace": "tests/posteriors/test_option_attributes.py",
    "LastLayerKFACLaplace": "tests/posteriors/test_option_attributes.py",
    "LastLayerDiagLaplace": "tests/posteriors/test_option_attributes.py",
    "SubnetLaplace": "tests/posteriors/test_option_attributes.py",
    "DensePosterior": "tests/posteriors/test_option_attributes.py",
    "WeightPosterior": "tests/posteriors/test_option_attributes.py",
}


# ---------------------------------------------------------------------------------------------- the generated cases
CLASSES = public_classes()
WITH_OPTIONS = {name: cls for name, cls in CLASSES.items() if option_attributes(cls) and name not in COVERED_ELSEWHERE}


def documented_values(name: str, attribute: str) -> list:
    validate = option_attributes(WITH_OPTIONS[name])[attribute].validate
    enum = getattr(validate, "enum", None)
    if enum is not None:
        return [v for member in enum for v in (member.value, member)]
    values = FACTORIES[name].values.get(attribute)
    assert values, f"no documented values for {name}.{attribute}: list them in FACTORIES[{name!r}].values"
    return values


def cases():
    for name, cls in sorted(WITH_OPTIONS.items()):
        for attribute in option_attributes(cls):
            yield pytest.param(name, attribute, id=f"{name}.{attribute}")


def test_the_generator_finds_the_classes():
    """Not vacuous: the walk finds the models, kernels and means, and the ones with options are covered."""
    assert {"NTKGP", "SFR", "FSVI", "NTKKernel", "LinearizedNetworkMean", "LaplaceGGNMarginalLogLikelihood"} <= set(CLASSES)
    assert {"NTKGP", "ExactNTKGP", "LaplaceNTKGP", "NTKKernel", "LinearizedNetworkMean"} <= set(WITH_OPTIONS)


@pytest.mark.parametrize("name", sorted(COVERED_ELSEWHERE))
def test_classes_covered_elsewhere_are_tested_there(name):
    """Each class of COVERED_ELSEWHERE has options and its test module names the class and, for a concrete
    class, every one of its option attributes."""
    from ntkgp._doctable import REPO_ROOT

    assert name in CLASSES and option_attributes(CLASSES[name]), name
    text = (REPO_ROOT / COVERED_ELSEWHERE[name]).read_text()
    assert "option_attributes" in text or "OptionAttribute" in text
    if name in text and "option_attributes(" not in text:  # a module that enumerates covers every attribute
        for attribute in option_attributes(CLASSES[name]):
            assert attribute in text, f"{COVERED_ELSEWHERE[name]} does not test {name}.{attribute}"


@pytest.mark.parametrize("name", sorted(WITH_OPTIONS))
def test_every_class_with_options_has_a_factory(name):
    assert name in FACTORIES, (
        f"no factory for class {name} (it has option attributes {list(option_attributes(WITH_OPTIONS[name]))}): "
        "add one to FACTORIES in tests/test_option_attributes.py"
    )


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.allclose(x, y, rtol=1e-9, atol=1e-12) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("name, attribute", list(cases()))
def test_assignment_equals_a_fresh_object_or_is_refused(name, attribute):
    if name not in FACTORIES:
        pytest.fail(f"no factory for class {name}")
    factory = FACTORIES[name]
    descriptor = option_attributes(WITH_OPTIONS[name])[attribute]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jitter or progress output of extreme options is not the point here
        for value in documented_values(name, attribute):
            obj = factory.build()
            before = getattr(obj, attribute)
            factory.evaluate(obj)  # fill the caches first
            if descriptor.fixed is not None:
                if getattr(factory.build(**{attribute: value}), attribute) == before:
                    setattr(obj, attribute, value)  # its own value: a no-op
                    continue
                with pytest.raises(AttributeError, match=rf"{attribute} cannot be changed.*build a new"):
                    setattr(obj, attribute, value)
                assert getattr(obj, attribute) == before
                continue
            setattr(obj, attribute, value)
            fresh = factory.build(**{attribute: value})
            assert getattr(obj, attribute) == getattr(fresh, attribute)
            assert _equal(factory.evaluate(obj), factory.evaluate(fresh)), f"{name}.{attribute} = {value!r}"


@pytest.mark.parametrize("name, attribute", list(cases()))
def test_a_refused_value_is_refused_on_assignment_too(name, attribute):
    if name not in FACTORIES:
        pytest.fail(f"no factory for class {name}")
    factory = FACTORIES[name]
    for value in [object(), "no such option", *factory.invalid.get(attribute, [])]:
        with pytest.raises((TypeError, ValueError), match=attribute):
            factory.build(**{attribute: value})
        obj = factory.build()
        before = getattr(obj, attribute)
        with pytest.raises((TypeError, ValueError), match=attribute):
            setattr(obj, attribute, value)
        assert getattr(obj, attribute) == before
