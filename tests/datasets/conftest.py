import os
from pathlib import Path

import pytest

from ntkgp.datasets import DATA_DIR_VARIABLE


@pytest.fixture
def data_dir() -> Path:
    """The benchmark data folder, from NTKGP_DATA_DIR; the loader tests skip without it."""
    folder = os.environ.get(DATA_DIR_VARIABLE)
    if not folder or not (Path(folder) / "toy").is_dir():
        pytest.skip(f"set {DATA_DIR_VARIABLE} to the benchmark data folder to run the loader tests")
    return Path(folder)
