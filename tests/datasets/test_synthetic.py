import sys

import pytest
import torch

from ntkgp.datasets import (
    GAP_REGRESSION_INTERVALS,
    GAP_REGRESSION_TEST_RANGE,
    gap_regression,
    gap_regression_function,
    two_moons,
)


def test_gap_regression_shapes_and_dtype():
    data = gap_regression(n=50, n_test=40)
    assert data.x_train.shape == (50, 1) and data.y_train.shape == (50, 1)
    assert data.x_test.shape == (40, 1) and data.f_test.shape == (40, 1)
    assert data.x_train.dtype == torch.float64
    assert gap_regression(n=10, dtype=torch.float32).x_train.dtype == torch.float32
    assert data.noise_std == 0.1


def test_gap_regression_gap_is_empty_and_inputs_in_intervals():
    x = gap_regression(n=2000, seed=3).x_train.squeeze(1)
    (left_lo, left_hi), (right_lo, right_hi) = GAP_REGRESSION_INTERVALS
    in_left = (x >= left_lo) & (x <= left_hi)
    in_right = (x >= right_lo) & (x <= right_hi)
    assert bool((in_left | in_right).all())
    assert not bool(((x > left_hi) & (x < right_lo)).any())
    assert in_left.sum() == 1000 and in_right.sum() == 1000
    assert bool((x[1:] >= x[:-1]).all())


def test_gap_regression_test_grid_covers_gap_and_matches_function():
    data = gap_regression(n_test=301)
    grid = data.x_test.squeeze(1)
    assert grid[0] == GAP_REGRESSION_TEST_RANGE[0] and grid[-1] == GAP_REGRESSION_TEST_RANGE[1]
    assert bool(((grid > -0.35) & (grid < 0.35)).any())
    torch.testing.assert_close(data.f_test, torch.sin(4 * data.x_test))


def test_gap_regression_deterministic_by_seed():
    a, b, c = gap_regression(seed=5), gap_regression(seed=5), gap_regression(seed=6)
    torch.testing.assert_close(a.x_train, b.x_train, rtol=0, atol=0)
    torch.testing.assert_close(a.y_train, b.y_train, rtol=0, atol=0)
    assert not torch.equal(a.x_train, c.x_train)


def test_gap_regression_noise_has_stated_std():
    data = gap_regression(n=20000, noise_std=0.25, seed=1)
    residual = data.y_train - gap_regression_function(data.x_train)
    assert residual.mean().abs() < 0.01
    assert residual.std().item() == pytest.approx(0.25, rel=0.03)


def test_two_moons_shapes_labels_and_seed():
    pytest.importorskip("sklearn")
    x, y = two_moons(n=100, noise=0.1, seed=0)
    assert x.shape == (100, 2) and x.dtype == torch.float64
    assert y.shape == (100,) and y.dtype == torch.long
    assert set(y.tolist()) == {0, 1}
    torch.testing.assert_close(two_moons(100, 0.1, 0)[0], x, rtol=0, atol=0)
    assert not torch.equal(two_moons(100, 0.1, 1)[0], x)


def test_two_moons_names_examples_extra_without_sklearn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"ntkgp\[examples\]"):
        two_moons()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex128, "float64", float])
def test_a_non_floating_dtype_is_refused_naming_dtype(dtype):
    # gap_regression(dtype=torch.int64) used to return all-zero inputs (|x| < 1 truncated)
    with pytest.raises(ValueError, match="^dtype must be a floating-point torch.dtype"):
        gap_regression(dtype=dtype)
    with pytest.raises(ValueError, match="^dtype must be a floating-point torch.dtype"):
        two_moons(dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gap_regression_in_lower_precision_rounds_the_float64_draw(dtype):
    reference, data = gap_regression(n=30, seed=2), gap_regression(n=30, seed=2, dtype=dtype)
    for field in ("x_train", "y_train", "x_test", "f_test"):
        torch.testing.assert_close(getattr(data, field), getattr(reference, field).to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: gap_regression(noise_std="0.1"), "noise_std"),
        (lambda: gap_regression(noise_std=None), "noise_std"),
        (lambda: gap_regression(seed=1.5), "seed"),
        (lambda: gap_regression(seed="0"), "seed"),
        (lambda: gap_regression(seed=True), "seed"),
        (lambda: two_moons(noise=None), "noise"),
        (lambda: two_moons(noise="0.2"), "noise"),
        (lambda: two_moons(seed=-1), "seed"),
        (lambda: two_moons(seed=1.5), "seed"),
        (lambda: two_moons(seed=2**32), "seed"),
    ],
)
def test_bad_seed_or_noise_is_refused_naming_it_before_drawing(call, argument):
    """A string, None or fractional seed or noise reached torch's / scikit-learn's own errors (naming
    ``manual_seed`` or ``random_state``, or "must be real number")."""
    pytest.importorskip("sklearn")
    with pytest.raises((TypeError, ValueError), match=argument):
        call()


def test_numpy_integers_are_integers():
    """``n=np.int64(10)`` (a count computed with numpy) was refused as "not an integer"; it gives what ``n=10``
    gives, as do numpy seeds and a numpy noise level."""
    pytest.importorskip("sklearn")
    np = pytest.importorskip("numpy")
    x, y = two_moons(n=np.int64(10), noise=np.float32(0.25), seed=np.int64(3))
    x_ref, y_ref = two_moons(n=10, noise=float(np.float32(0.25)), seed=3)
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    data = gap_regression(n=np.int32(12), n_test=np.int64(5), seed=np.int64(2), noise_std=np.float64(0.2))
    reference = gap_regression(n=12, n_test=5, seed=2, noise_std=0.2)
    assert torch.equal(data.y_train, reference.y_train) and data.x_test.shape == (5, 1)
