"""The generic argument checks (ntkgp.validation) that every package imports, and the memory budgets
(ntkgp.memory): their rule against a brute-force count, and the deprecated names in numbers."""

import math
import warnings

import numpy as np
import pytest
import torch

from ntkgp import memory, validation


@pytest.mark.parametrize("value", [1, 7, np.int64(3), np.int32(1)])
def test_positive_int_accepts_every_integral_type_and_returns_an_int(value):
    out = validation.positive_int(value, "n")
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [0, -2, 2.0, 2.7, True, "3", None, float("nan")])
def test_positive_int_refuses_naming_the_argument(value):
    with pytest.raises(ValueError, match="^n must be a positive integer, got"):
        validation.positive_int(value, "n")
    assert validation.optional_positive_int(None, "n") is None


def test_integer_ranges_counts_and_flags():
    assert validation.integer(5, "k", minimum=0, maximum=5) == 5
    for bad, message in [(-1, "k must be an integer >= 0 and <= 5"), (6, "k must be an integer >= 0 and <= 5"),
                         (1.0, r"k must be an integer >= 0 and <= 5; got 1.0")]:
        with pytest.raises(ValueError, match=message):
            validation.integer(bad, "k", minimum=0, maximum=5)
    assert validation.count(0, "cache_size") == 0 and validation.positive_count(1, "chunk_size") == 1
    with pytest.raises(ValueError, match="cache_size must be an integer >= 0"):
        validation.count(-1, "cache_size")
    assert validation.flag(False, "progress") is False
    with pytest.raises(TypeError, match="progress must be a bool"):
        validation.flag(1, "progress")
    with pytest.raises(ValueError, match="learn must be a bool"):  # the error type a caller asks for
        validation.flag("yes", "learn", error=ValueError)


def test_real_numbers_intervals_and_dtypes():
    assert validation.real_number(1.0, "p", 0.0, 1.0, high_open=False) == 1.0
    for bad in [1.5, -0.1, float("nan"), True, "0.5"]:
        with pytest.raises(ValueError, match=r"p must be a number in \[0, 1\]"):
            validation.real_number(bad, "p", 0.0, 1.0, high_open=False)
    with pytest.raises(ValueError, match=r"s must be a number in \(0, inf\)"):
        validation.real_number(0.0, "s", low_open=True)
    assert validation.positive_float(np.float32(0.5), "lr") == 0.5
    for bad in [0.0, -1.0, math.inf, True]:
        with pytest.raises(ValueError, match="lr must be a positive finite number"):
            validation.positive_float(bad, "lr")
    assert validation.non_negative(torch.tensor(0.0), "noise") == 0.0
    with pytest.raises(ValueError, match="noise must be a finite number >= 0"):
        validation.non_negative(-1e-9, "noise")
    assert validation.float_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
        validation.float_dtype(torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("budget, width, largest", [(2**20, 1000, None), (2**20, 3, 100), (10, 1000, None),
                                                    (0, 5, None), (2**30, 7, 1024)])
def test_chunk_rows_is_the_largest_chunk_within_the_budget(dtype, budget, width, largest):
    size = torch.empty((), dtype=dtype).element_size()
    # brute force: the largest n >= 1 with n · width · size <= budget (one row whatever its size), capped
    fits = [n for n in range(1, 2**20) if n * width * size <= budget]
    expected = max(fits) if fits else 1
    if largest is not None:
        expected = min(expected, largest)
    assert memory.chunk_rows(budget, width, dtype, largest) == expected
    assert memory.chunk_rows(budget, width, size, largest) == expected  # an item size in bytes works too


def test_budgets_are_bytes_and_the_old_names_in_numbers_warn():
    # the budgets once counted in numbers are the same number of float64 bytes
    assert memory.PREDICTION_BYTES == 8 * 2**25 and memory.SFR_STEP_BYTES == 8 * 2**24
    import ntkgp.models.ntkgp as ntkgp_models

    with pytest.warns(FutureWarning, match="PREDICTION_BYTES"):
        assert ntkgp_models.PREDICTION_BUDGET == 2**25
    with pytest.warns(FutureWarning, match=r"max_elements \(numbers\) is deprecated: pass max_bytes=80"):
        assert memory.renamed_budget(memory.INDUCING_POOL_BYTES, 10, "max_bytes", "max_elements") == 80
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert memory.renamed_budget(123, None, "max_bytes", "max_elements") == 123
    with pytest.raises(ValueError, match="max_elements must be an integer >= 0"):
        memory.renamed_budget(123, -1, "max_bytes", "max_elements")


def test_optional_integer_is_none_or_an_integer_in_range():
    assert validation.integer(None, "seed", 0, 9, allow_none=True) is None
    assert validation.integer(np.int64(9), "seed", 0, 9, allow_none=True) == 9
    for bad, message in [(10, r"^seed must be None or an integer >= 0 and <= 9; got 10"),
                         (1.5, r"^seed must be None or an integer >= 0 and <= 9; got 1.5"),
                         (True, r"^seed must be None or an")]:
        with pytest.raises(ValueError, match=message):
            validation.integer(bad, "seed", 0, 9, allow_none=True)
    with pytest.raises(ValueError, match=r"^seed must be an integer >= 0 and <= 9; got None"):  # only where allowed
        validation.integer(None, "seed", 0, 9)


def test_the_packages_checks_are_this_modules():
    """The options of the evidence routes, the network core, the training loop and the likelihoods refuse through
    ntkgp.validation: the same rule (numpy integers accepted, bools and integral floats refused) and messages."""
    from ntkgp.laplace import EvidenceOptions
    from ntkgp.likelihoods import SoftmaxLikelihood
    from ntkgp.ntk.network import NetworkCore

    assert EvidenceOptions(num_probes=np.int64(3), seed=None).num_probes == 3
    with pytest.raises(ValueError, match=r"^num_probes must be None or an integer >= 1; got 0"):
        EvidenceOptions(num_probes=0)
    with pytest.raises(ValueError, match=r"^cg_tolerance must be a number in \(0, inf\]"):
        EvidenceOptions(cg_tolerance=float("nan"))
    net = torch.nn.Linear(2, 1)
    assert NetworkCore(net, chunk_size=np.int64(4)).chunk_size == 4
    for kwargs, message in [({"chunk_size": 2.0}, "chunk_size must be an integer >= 1"),
                            ({"max_jacobian_bytes": -1}, "max_jacobian_bytes must be an integer >= 0"),
                            ({"input_shape": (2, 0)}, "input_shape must be an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            NetworkCore(net, **kwargs)
    assert SoftmaxLikelihood(num_classes=np.int64(3)).num_classes == 3
    with pytest.raises(ValueError, match="num_classes must be an integer >= 2"):
        SoftmaxLikelihood(num_classes=1)


def test_exact_names_lists_the_missing_and_the_unknown_names():
    validation.exact_names({"b": 1, "a": 2}, ("a", "b"), "prior_mean")  # any order of the keys
    with pytest.raises(ValueError, match=r"^prior_mean must name every trainable parameter exactly: missing \['b'\], "
                                         r"unknown \['c'\]"):
        validation.exact_names({"a": 1, "c": 2}, ["a", "b"], "prior_mean")
    with pytest.raises(ValueError, match=r"^s must name every parameter of the posterior exactly: missing \[\]"):
        validation.exact_names({"a": 1, "z": 2}, ["a"], "s", "every parameter of the posterior")


def test_a_wide_range_is_named_in_powers_of_two():
    # a seed's range is torch.Generator's: the message names it as 2**k, not as twenty-digit numbers
    from ntkgp.validation import integer

    with pytest.raises(ValueError, match=r"seed must be an integer >= -2\*\*63 and <= 2\*\*64 - 1; got 1.5"):
        integer(1.5, "seed", minimum=-(2**63), maximum=2**64 - 1)
    with pytest.raises(ValueError, match=r"<= 2\*\*63 - 2; got -1"):
        integer(-1, "seed", 0, 2**63 - 2, allow_none=True)
    assert integer(2**64 - 1, "seed", minimum=-(2**63), maximum=2**64 - 1) == 2**64 - 1
