from pathlib import Path

import numpy as np
import pytest
import torch

from ntkgp.datasets import load_uci_classification, load_uci_regression
from tests.helpers import EPS32

# The benchmark data folder (skipped without NTKGP_DATA_DIR)


def test_load_uci_regression_normalisation(data_dir):
    split = load_uci_regression(data_dir, "boston", split=3)
    assert split.x_train.shape == (455, 13) and split.x_test.shape == (51, 13)
    assert split.y_train.shape == (455, 1) and split.y_test.shape == (51, 1)
    torch.testing.assert_close(
        split.x_train.mean(0), torch.zeros(13, dtype=torch.float64), atol=1e-10, rtol=0
    )
    torch.testing.assert_close(
        split.x_train.std(0, unbiased=False), torch.ones(13, dtype=torch.float64), atol=1e-10, rtol=0
    )
    folder = data_dir / "uci_regression" / "boston"
    table = np.loadtxt(folder / "data.txt")
    train = np.loadtxt(folder / "index_train_3.txt", dtype=int)
    test = np.loadtxt(folder / "index_test_3.txt", dtype=int)
    assert split.y_mean == pytest.approx(table[train, 13].mean())
    assert split.y_std == pytest.approx(table[train, 13].std())
    original = split.y_test.squeeze(1).numpy() * split.y_std + split.y_mean
    np.testing.assert_allclose(original, table[test, 13], rtol=1e-12)


def test_load_uci_regression_constant_columns_stay_finite(data_dir):
    split = load_uci_regression(data_dir, "naval", split=0, dtype=torch.float32)
    assert split.x_train.dtype == torch.float32 and split.x_train.shape[1] == 16
    assert bool(torch.isfinite(split.x_train).all()) and bool(torch.isfinite(split.x_test).all())
    constant = split.x_train.std(0) == 0
    assert constant.sum() == 2
    assert bool((split.x_train[:, constant] == 0).all())


def test_load_uci_regression_bad_split_and_name(data_dir):
    with pytest.raises(ValueError, match="split"):
        load_uci_regression(data_dir, "yacht", split=20)
    with pytest.raises(FileNotFoundError, match="boston"):
        load_uci_regression(data_dir, "no_such_set")


@pytest.mark.parametrize(
    "name, d, n_train, n_test", [("australian", 14, 345, 345), ("breast_cancer", 10, 341, 342)]
)
def test_load_uci_classification_presplit(data_dir, name, d, n_train, n_test):
    split = load_uci_classification(data_dir, name, split="distributed")
    assert split.x_train.shape == (n_train, d) and split.x_test.shape == (n_test, d)
    assert split.x_val is None and split.y_val is None
    assert split.num_classes == 2
    assert set(split.y_train.tolist()) | set(split.y_test.tolist()) == {0, 1}


def test_load_uci_classification_glass_split(data_dir):
    split = load_uci_classification(data_dir, "glass", seed=0)
    sizes = [len(split.y_train), len(split.y_val), len(split.y_test)]
    assert sum(sizes) == 214 and split.num_classes == 6
    assert sizes[0] == pytest.approx(0.7 * 214, abs=4) and sizes[1] == pytest.approx(0.15 * 214, abs=4)
    for labels in (split.y_train, split.y_val, split.y_test):
        assert set(labels.tolist()) == set(range(6))  # stratified: every class in every part
    # The parts are disjoint and cover the set: undo the per-column affine standardisation and
    # compare the rows, as a multiset, with the raw file.
    raw_x = np.loadtxt(data_dir / "uci_classification" / "glass" / "X.txt")
    combined = torch.cat([split.x_train, split.x_val, split.x_test]).numpy()
    restored = np.empty_like(combined)
    for j in range(raw_x.shape[1]):
        slope, intercept = np.polyfit(np.sort(combined[:, j]), np.sort(raw_x[:, j]), 1)
        restored[:, j] = slope * combined[:, j] + intercept

    def lexsorted(rows):
        rows = np.round(rows, 6)
        return rows[np.lexsort(rows.T[::-1])]

    np.testing.assert_allclose(lexsorted(restored), lexsorted(raw_x), atol=1e-6)
    zeros, ones = torch.zeros(9, dtype=torch.float64), torch.ones(9, dtype=torch.float64)
    torch.testing.assert_close(split.x_train.mean(0), zeros, atol=1e-10, rtol=0)
    torch.testing.assert_close(split.x_train.std(0, unbiased=False), ones, atol=1e-10, rtol=0)


def test_load_uci_classification_glass_seeded(data_dir):
    a, b = (
        load_uci_classification(data_dir, "glass", seed=1),
        load_uci_classification(data_dir, "glass", seed=1),
    )
    c = load_uci_classification(data_dir, "glass", seed=2)
    assert torch.equal(a.x_test, b.x_test) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_test, c.x_test)


def test_load_uci_classification_unknown_name(data_dir):
    with pytest.raises(ValueError, match="australian"):
        load_uci_classification(data_dir, "iris")


# Fake data sets in the files' formats (these run without the data folder)


def _fake_regression(root: Path, n: int = 40, d: int = 3, n_splits: int = 2) -> np.ndarray:
    folder = root / "uci_regression" / "fake"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    table = np.column_stack([rng.normal(size=(n, d)) * [1.0, 10.0, 0.1], np.ones(n), rng.normal(5.0, 3.0, n)])
    np.savetxt(folder / "data.txt", table)
    np.savetxt(folder / "index_features.txt", np.arange(d + 1), fmt="%d")
    np.savetxt(folder / "index_target.txt", [d + 1], fmt="%d")
    (folder / "n_splits.txt").write_text(f"{n_splits}\n")
    for i in range(n_splits):
        order = np.random.default_rng(i).permutation(n)
        np.savetxt(folder / f"index_train_{i}.txt", np.sort(order[: n - n // 10]), fmt="%d")
        np.savetxt(folder / f"index_test_{i}.txt", np.sort(order[n - n // 10:]), fmt="%d")
    return table


def _fake_classification(root: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    sets = {}
    for name, (n_tr, n_te, d) in {"australian": (30, 30, 4), "breast_cancer": (25, 26, 3)}.items():
        folder = root / "uci_classification" / name
        folder.mkdir(parents=True)
        x = rng.uniform(-1, 1, size=(n_tr + n_te, d))
        y = np.where(rng.uniform(size=n_tr + n_te) < 0.4, -1.0, 1.0)
        for part, rows in (("tr", slice(0, n_tr)), ("te", slice(n_tr, None))):
            np.savetxt(folder / f"{name}_scale_X_{part}.csv", x[rows])
            np.savetxt(folder / f"{name}_scale_y_{part}.csv", y[rows])
        sets[name] = (x, y)
    folder = root / "uci_classification" / "glass"
    folder.mkdir(parents=True)
    x = rng.normal(size=(60, 5)) * [1.0, 100.0, 0.01, 1.0, 1.0]
    y = np.repeat([1.0, 2.0, 3.0, 5.0], [20, 20, 10, 10])
    np.savetxt(folder / "X.txt", x)
    np.savetxt(folder / "Y.txt", y)
    sets["glass"] = (x, y)
    return sets


def _rows(array: np.ndarray) -> np.ndarray:
    """Rows in lexicographic order (a multiset of rows, for comparing parts with the file)."""
    rounded = np.round(np.asarray(array, dtype=np.float64), 8)
    return rounded[np.lexsort(rounded.T[::-1])]


def test_fake_regression_standard_split_and_normalisation(tmp_path):
    table = _fake_regression(tmp_path)
    split = load_uci_regression(tmp_path, "fake", split=1, dtype=torch.float32)
    train = np.loadtxt(tmp_path / "uci_regression" / "fake" / "index_train_1.txt", dtype=int)
    test = np.loadtxt(tmp_path / "uci_regression" / "fake" / "index_test_1.txt", dtype=int)
    assert split.x_train.dtype == torch.float32 and split.x_train.shape == (len(train), 4)
    assert split.x_val is None and split.y_val is None
    mean, std = table[train].mean(0), table[train].std(0)
    assert split.y_mean == pytest.approx(mean[4]) and split.y_std == pytest.approx(std[4])
    expected = (table[test, :3] - mean[:3]) / std[:3]
    # standardized in float64, then rounded once to float32 (ε32/2 relative); the two float64 means and stds differ
    # by float64 rounding only (atol 1e-12 for entries near zero)
    np.testing.assert_allclose(split.x_test[:, :3].numpy(), expected, rtol=EPS32 / 2, atol=1e-12)
    assert bool((split.x_train[:, 3] == 0).all())  # the constant column: exact zeros, std 1
    # back in float32: ỹ rounded (ε32/2 of |ỹ|s), s rounded and the product rounded (ε32/2 of |ỹ|s each), ȳ rounded
    # and the sum rounded (ε32/2 of |ȳ| and of |y|)
    y_test = split.y_test.squeeze(1).numpy()
    back = y_test * split.y_std + split.y_mean
    bound = EPS32 / 2 * (3 * np.abs(y_test) * split.y_std + abs(split.y_mean) + np.abs(table[test, 4]))
    assert back.dtype == np.float32 and (np.abs(back - table[test, 4]) <= bound).all()


def test_fake_regression_validation_fraction_is_seeded_and_disjoint(tmp_path):
    table = _fake_regression(tmp_path)
    train = np.loadtxt(tmp_path / "uci_regression" / "fake" / "index_train_0.txt", dtype=int)
    split = load_uci_regression(tmp_path, "fake", split=0, val_fraction=0.25, seed=3)
    n_val = round(0.25 * len(train))
    assert split.x_val.shape == (n_val, 4) and split.y_val.shape == (n_val, 1)
    assert len(split.x_train) == len(train) - n_val
    # Training statistics are those of the remaining training part: it is exactly standardized.
    torch.testing.assert_close(split.x_train[:, :3].mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(split.y_train.std(0, unbiased=False), torch.ones(1, dtype=torch.float64))
    # Train and validation together are the standard training rows (undo the standardization).
    y_all = torch.cat([split.y_train, split.y_val]).squeeze(1).numpy() * split.y_std + split.y_mean
    np.testing.assert_allclose(np.sort(y_all), np.sort(table[train, 4]), rtol=1e-10)
    again = load_uci_regression(tmp_path, "fake", split=0, val_fraction=0.25, seed=3)
    other = load_uci_regression(tmp_path, "fake", split=0, val_fraction=0.25, seed=4)
    assert torch.equal(again.y_val, split.y_val) and not torch.equal(other.y_val, split.y_val)
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="val_fraction"):
            load_uci_regression(tmp_path, "fake", val_fraction=bad)


@pytest.mark.parametrize("name", ["australian", "breast_cancer", "glass"])
def test_fake_classification_random_split(tmp_path, name):
    x_raw, y_raw = _fake_classification(tmp_path)[name]
    split = load_uci_classification(tmp_path, name, seed=5)
    parts = [(split.x_train, split.y_train), (split.x_val, split.y_val), (split.x_test, split.y_test)]
    classes = np.unique(y_raw)
    assert split.num_classes == len(classes)
    for c, label in enumerate(classes):  # stratified: per class round(0.7 n_c), round(0.15 n_c), the rest
        n_c = int((y_raw == label).sum())
        sizes = [int((y == c).sum()) for _, y in parts]
        assert sizes == [round(0.7 * n_c), round(0.15 * n_c), n_c - round(0.7 * n_c) - round(0.15 * n_c)]
    torch.testing.assert_close(split.x_train.mean(0), torch.zeros(x_raw.shape[1], dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(split.x_train.std(0, unbiased=False), torch.ones(x_raw.shape[1], dtype=torch.float64))
    # The map raw -> standardized is affine and increasing per column, so sorting pairs the values: fit it,
    # undo it, and compare the three parts (with their labels) with the file's rows, each row once.
    x_all = np.concatenate([x.numpy() for x, _ in parts])
    slope, intercept = zip(*(np.polyfit(np.sort(x_all[:, j]), np.sort(x_raw[:, j]), 1) for j in range(x_raw.shape[1])))
    restored = x_all * np.array(slope) + np.array(intercept)
    labels = np.concatenate([y.numpy() for _, y in parts])
    code = {label: c for c, label in enumerate(classes)}
    np.testing.assert_allclose(
        _rows(np.column_stack([restored, labels])), _rows(np.column_stack([x_raw, [code[v] for v in y_raw]])), atol=1e-8
    )
    # ...and the statistics were the training part's: its restored rows have mean `intercept`, std `slope`.
    train_raw = split.x_train.numpy() * np.array(slope) + np.array(intercept)
    np.testing.assert_allclose(train_raw.mean(0), intercept, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(train_raw.std(0), slope, rtol=1e-8)
    same = load_uci_classification(tmp_path, name, seed=5)
    other = load_uci_classification(tmp_path, name, seed=6)
    assert torch.equal(same.x_test, split.x_test) and torch.equal(same.y_val, split.y_val)
    assert not torch.equal(other.x_test, split.x_test)


@pytest.mark.parametrize("name", ["australian", "breast_cancer"])
def test_fake_classification_distributed_split(tmp_path, name):
    x_raw, y_raw = _fake_classification(tmp_path)[name]
    split = load_uci_classification(tmp_path, name, split="distributed", dtype=torch.float32)
    n_train = len(split.y_train)
    assert split.x_val is None and split.y_val is None and split.x_train.dtype == torch.float32
    # the file's values rounded once to float32: within ε32/2 relative (round to nearest)
    np.testing.assert_allclose(torch.cat([split.x_train, split.x_test]).numpy(), x_raw, rtol=EPS32 / 2, atol=0)
    np.testing.assert_array_equal(torch.cat([split.y_train, split.y_test]).numpy(), (y_raw > 0).astype(int))
    assert n_train == len(np.loadtxt(tmp_path / "uci_classification" / name / f"{name}_scale_y_tr.csv"))


def test_fake_classification_fractions_and_errors(tmp_path):
    _fake_classification(tmp_path)
    split = load_uci_classification(tmp_path, "glass", fractions=(0.5, 0.25))
    # per class round(0.5 n_c), round(0.25 n_c) (round half to even: 2.5 -> 2), classes of 20, 20, 10, 10
    assert (len(split.y_train), len(split.y_val), len(split.y_test)) == (30, 14, 16)
    with pytest.raises(ValueError, match="no distributed"):
        load_uci_classification(tmp_path, "glass", split="distributed")
    with pytest.raises(ValueError, match="split must be"):
        load_uci_classification(tmp_path, "glass", split="other")
    for bad in ((0.9, 0.1), (0.0, 0.2), (0.7,)):
        with pytest.raises(ValueError, match="fractions"):
            load_uci_classification(tmp_path, "glass", fractions=bad)


@pytest.mark.parametrize("split", [True, 1.0, "1"])
def test_fake_regression_split_must_be_an_integer(tmp_path, split):
    _fake_regression(tmp_path)
    with pytest.raises(ValueError, match="^split must be an integer index"):
        load_uci_regression(tmp_path, "fake", split=split)  # True used to pick split 1
    with pytest.raises(ValueError, match="^split must be an integer index"):  # before the folder is read
        load_uci_regression(tmp_path / "nowhere", "fake", split=split)
    expected = load_uci_regression(tmp_path, "fake", split=1)
    torch.testing.assert_close(load_uci_regression(tmp_path, "fake", split=np.int64(1)).x_test, expected.x_test)
