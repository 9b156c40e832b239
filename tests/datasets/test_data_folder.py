import pytest
import torch

from ntkgp.datasets import (
    DATA_DIR_VARIABLE,
    load_banana,
    load_snelson,
    load_uci_classification,
    load_uci_regression,
    resolve_data_dir,
)

# Missing data folder


@pytest.mark.parametrize(
    "loader",
    [
        load_snelson,
        load_banana,
        lambda d: load_uci_regression(d, "boston"),
        lambda d: load_uci_classification(d, "glass"),
    ],
)
def test_missing_folder_names_data_dir_and_layout(tmp_path, loader):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="data_dir") as info:
        loader(missing)
    assert str(missing) in str(info.value) and "data_dir/" in str(info.value)
    with pytest.raises(FileNotFoundError, match="expected layout"):
        loader(tmp_path)  # exists, but holds nothing


def test_resolve_data_dir_argument_then_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_DIR_VARIABLE, raising=False)
    assert resolve_data_dir(tmp_path) == tmp_path.resolve()
    with pytest.raises(FileNotFoundError, match=f"--data-dir PATH .*{DATA_DIR_VARIABLE}"):
        resolve_data_dir()
    monkeypatch.setenv(DATA_DIR_VARIABLE, str(tmp_path))
    assert resolve_data_dir() == tmp_path.resolve()
    with pytest.raises(FileNotFoundError, match="not found: pass --data-dir"):
        resolve_data_dir(tmp_path / "missing")


@pytest.mark.parametrize(
    "loader",
    [
        lambda d, dtype: load_snelson(d, dtype=dtype),
        lambda d, dtype: load_banana(d, dtype=dtype),
        lambda d, dtype: load_uci_regression(d, "boston", dtype=dtype),
        lambda d, dtype: load_uci_classification(d, "glass", dtype=dtype),
    ],
)
def test_a_non_floating_dtype_is_refused_before_the_folder_is_read(tmp_path, loader):
    with pytest.raises(ValueError, match="^dtype must be a floating-point torch.dtype"):
        loader(tmp_path / "nowhere", torch.int64)
