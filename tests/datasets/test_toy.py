"""Snelson and banana from the benchmark data folder (skipped without NTKGP_DATA_DIR)."""

import numpy as np
import pytest
import torch

from ntkgp.datasets import load_banana, load_snelson


def test_load_snelson(data_dir):
    x_train, y_train, x_test = load_snelson(data_dir)
    assert x_train.shape == (200, 1) and y_train.shape == (200, 1) and x_test.shape == (301, 1)
    expected = np.loadtxt(data_dir / "toy" / "snelson_train_outputs.dat")
    np.testing.assert_array_equal(y_train.squeeze(1).numpy(), expected)


@pytest.mark.parametrize("full, n", [(False, 400), (True, 5300)])
def test_load_banana(data_dir, full, n):
    x, y = load_banana(data_dir, full=full, dtype=torch.float32)
    assert x.shape == (n, 2) and x.dtype == torch.float32
    assert y.shape == (n,) and set(y.tolist()) == {0, 1}


def test_load_banana_full_maps_labels_one_two_to_zero_one(data_dir):
    _, y = load_banana(data_dir, full=True)
    raw = np.loadtxt(data_dir / "toy" / "banana_5300.csv", delimiter=",")[:, 2]
    np.testing.assert_array_equal(y.numpy(), raw - 1)
