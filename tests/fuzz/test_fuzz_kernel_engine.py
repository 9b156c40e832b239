"""Property-based tests of NTKKernel and NTKEngine (see tests/fuzz/common.py for the property)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import ntkgp
from tests.fuzz import reference
from tests.fuzz.common import (
    ACCEPTED_INPUT_CORRUPTIONS,
    INPUT_CORRUPTIONS,
    check_call,
    corrupt_inputs,
    dtypes,
    fuzz_settings,
    inputs,
    make_network,
    networks,
)
from tests.helpers import float32_gram_tolerance, float32_roundings

SETTINGS = fuzz_settings(25)

PRIOR_PRECISIONS = ("ok", "zero", "negative", "nan", "inf", "length", "string", "bool")


def prior_precision(kind: str, groups: int, dtype: torch.dtype) -> object:
    return {
        "ok": torch.linspace(0.5, 2.0, groups, dtype=dtype),
        "zero": 0.0,
        "negative": -1.0,
        "nan": float("nan"),
        "inf": torch.full((groups,), float("inf"), dtype=dtype),
        "length": torch.ones(groups + 1, dtype=dtype),
        "string": "1.0",
        "bool": True,
    }[kind]


@SETTINGS
@given(data=st.data())
def test_kernel_calls(data):
    kind, dtype = data.draw(networks), data.draw(dtypes)
    c, n1, n2 = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    network = make_network(kind, c, dtype, seed=data.draw(st.integers(0, 3)))
    x1, x2 = inputs(network, n1, dtype, 1), inputs(network, n2, dtype, 2)
    corruption = data.draw(st.sampled_from([None, *INPUT_CORRUPTIONS]))
    target = data.draw(st.sampled_from(["x1", "x2"]))
    if corruption is not None:
        bad = corrupt_inputs(x1 if target == "x1" else x2, corruption, data.draw(st.integers(0, 3)))
        x1, x2 = (bad, x2) if target == "x1" else (x1, bad)
    kernel = ntkgp.NTKKernel(network.net, input_shape=network.input_shape)
    accepted = corruption in ACCEPTED_INPUT_CORRUPTIONS or corruption == "empty"  # an empty Gram is a Gram
    diag = data.draw(st.booleans()) and corruption is None and n1 == n2
    result = check_call(
        lambda: kernel(x1, x2, diag=diag) if diag else kernel(x1, x2).to_dense(),
        network.net,
        [x1, x2],
        corruption,
        [target],
        accepted,
    )
    if result is None:  # a corrupted call, refused as check_call requires
        return
    # every accepted call against the Gram of brute-force Jacobians (the inputs as the network takes them)
    a, b = (torch.as_tensor(t).to(dtype).reshape(-1, *network.example) for t in (x1, x2))
    expected = reference.ntk(network.net, a, b)
    if diag:
        expected = expected.diagonal()
    assert result.shape == expected.shape
    if dtype == torch.float32:  # rε√(tr K(a, a) tr K(b, b)) (tests.helpers.float32_gram_tolerance), traces in float64
        bound = float32_gram_tolerance(network.net, reference.ntk(network.net, a, a).diagonal(),
                                       reference.ntk(network.net, b, b).diagonal())
        assert (result.double() - expected).norm() <= bound
    else:
        torch.testing.assert_close(result.double(), expected, **_tolerance(dtype, expected))
    if corruption is None and not diag:
        square = kernel(x1).to_dense()
        assert torch.allclose(square, square.mT) and bool((square.diagonal() >= 0).all())


def _tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    """float64 only: two float64 computations of the same sums in another order (ε64 times small counts)."""
    assert dtype == torch.float64
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    return {"rtol": 1e-9, "atol": 1e-11 * scale}


def _float32_bound(net, method: str, j: torch.Tensor, expected: torch.Tensor, v: torch.Tensor) -> float:
    r"""A bound on ‖result − expected‖_F for a float32 network (ε = ε32, ``r`` = tests.helpers.float32_roundings):
    Jacobian rows within rε of their norm, so ‖ΔJ‖_F ≤ rε‖J‖_F; Jᵀv adds the blocked sum over the N·C rows
    (log2(NC) roundings): (r + log2 NC)ε‖J‖_F‖v‖_F; a Gram's entries within rε√(K_ii K_jj), so ‖ΔK‖_F ≤ rε tr K per
    group (tests.helpers.float32_gram_tolerance; for diagonal blocks, per block), and Kv adds
    log2(NC)ε‖K‖_F‖v‖_F."""
    eps, r, rows = torch.finfo(torch.float32).eps, float32_roundings(net), max(j.shape[0], 2)
    if method == "jacobian":
        return r * eps * j.norm().item()
    if method == "vjp":
        return (r + math.log2(rows)) * eps * j.norm().item() * v.double().norm().item()
    if method == "matvec":
        gram = j @ j.T
        return (float32_gram_tolerance(net, gram.diagonal()) + math.log2(rows) * eps * gram.norm().item()
                ) * v.double().norm().item()
    return float32_gram_tolerance(net, expected.diagonal(dim1=-2, dim2=-1))  # group Grams, diagonal blocks


@SETTINGS
@given(data=st.data())
def test_kernel_prior_precision(data):
    kind, dtype = data.draw(networks), data.draw(dtypes)
    network = make_network(kind, 2, dtype, seed=0)
    groups = len(ntkgp.NTKEngine(network.net, input_shape=network.input_shape).groups.group_names)
    bad = data.draw(st.sampled_from(PRIOR_PRECISIONS))
    value = prior_precision(bad, groups, dtype)
    corrupted = None if bad == "ok" else bad
    kernel = check_call(
        lambda: ntkgp.NTKKernel(network.net, prior_precision=value, input_shape=network.input_shape),
        network.net,
        [value],
        corrupted,
        ["prior_precision"],
    )
    kernel = kernel or ntkgp.NTKKernel(network.net, input_shape=network.input_shape)
    before = kernel.prior_precision.detach().clone()

    def set_value():
        kernel.prior_precision = value
        return kernel(inputs(network, 3, dtype, 0)).to_dense()

    check_call(set_value, network.net, [value], corrupted, ["prior_precision"])
    if corrupted is not None:  # a rejected value leaves the kernel as it was
        assert torch.equal(kernel.prior_precision.detach(), before)


@SETTINGS
@given(data=st.data())
def test_engine_products(data):
    kind, dtype = data.draw(networks), data.draw(dtypes)
    c, n = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    network = make_network(kind, c, dtype, seed=1)
    engine = ntkgp.NTKEngine(network.net, input_shape=network.input_shape)
    x = inputs(network, n, dtype, 3)
    v = torch.randn(n * c, 2, dtype=dtype)
    weights = torch.ones(engine.num_groups, dtype=dtype)
    corruption = data.draw(
        st.sampled_from(
            [None, "x", "v_length", "v_nan", "v_integer", "weights_negative", "weights_length", "weights_nan"]
        )
    )
    name = None
    if corruption == "x":
        x = corrupt_inputs(
            x, data.draw(st.sampled_from([k for k in INPUT_CORRUPTIONS if k != "other_float"])), 0
        )
        name = "x"
    elif corruption == "v_length":
        v, name = torch.randn(n * c + 1, dtype=dtype), "v"
    elif corruption == "v_nan":
        v, name = v.clone().fill_(float("nan")), "v"
    elif corruption == "v_integer":
        v, name = torch.ones(n * c, dtype=torch.long), "v"
    elif corruption == "weights_negative":
        weights, name = -weights, "weights"
    elif corruption == "weights_length":
        weights, name = torch.ones(engine.num_groups + 1, dtype=dtype), "weights"
    elif corruption == "weights_nan":
        weights, name = weights * float("nan"), "weights"
    method = data.draw(st.sampled_from(["matvec", "jacobian", "group_grams", "diag_blocks", "vjp"]))
    if method != "matvec" and corruption not in (None, "x") and not (method == "vjp" and name == "v"):
        corruption = None  # the corrupted argument is not one of this method's
    calls = {
        "matvec": lambda: engine.matvec(x, v, weights),
        "jacobian": lambda: engine.jacobian(x),
        "group_grams": lambda: engine.group_grams(x),
        "diag_blocks": lambda: engine.diag_blocks(x),
        "vjp": lambda: engine.vjp(x, v),
    }
    result = check_call(calls[method], network.net, [x, v, weights], corruption, [name or "x"])
    if result is None:  # a corrupted call, refused as check_call requires
        return
    # every accepted call against brute-force Jacobians (columns in the network's parameter order, "layer" groups)
    j, group = reference.jacobian(network.net, x)
    per_group = [j[:, group == g] for g in range(engine.num_groups)]
    if method == "matvec":
        result, expected = result, reference.ntk(network.net, x, x, weights) @ v.double()
    elif method == "jacobian":
        expected = j
    elif method == "vjp":
        result, expected = torch.cat([result[k].reshape(-1, 2) for k in engine.groups.names]), j.T @ v.double()
    else:
        grams = torch.stack([jg @ jg.T for jg in per_group])
        expected = grams
        if method == "diag_blocks":
            idx = torch.arange(n * c).reshape(n, c)
            expected = grams[:, idx[:, :, None], idx[:, None, :]]
    assert result.shape == expected.shape
    if dtype == torch.float32:
        assert (result.double() - expected).norm() <= _float32_bound(network.net, method, j, expected, v)
    else:
        torch.testing.assert_close(result.double(), expected, **_tolerance(dtype, expected))
