from pathlib import Path

import numpy as np
import pytest
import torch

from ntkgp.datasets import load_csv


@pytest.fixture
def csv_file(tmp_path) -> Path:
    path = tmp_path / "mine.csv"
    path.write_text("a,b,species,target\n1.0,2,cat,0.5\n3,4.5,dog,-1\n\n5,6,cat,2e1\n7,8,emu,3\n")
    return path


def test_load_csv_regression_by_name_and_index(csv_file):
    data = load_csv(csv_file, ["b", "a"], "target")
    torch.testing.assert_close(data.x, torch.tensor([[2, 1], [4.5, 3], [6, 5], [8, 7]], dtype=torch.float64))
    torch.testing.assert_close(data.y, torch.tensor([[0.5], [-1], [20], [3]], dtype=torch.float64))
    assert data.input_names == ["b", "a"] and data.class_names is None
    by_index = load_csv(csv_file, [1, 0], -1, dtype=torch.float32)
    assert by_index.x.dtype == torch.float32
    torch.testing.assert_close(by_index.x, data.x.float())


def test_load_csv_classification_maps_text_labels(csv_file):
    data = load_csv(csv_file, "a", "species", task="classification")
    assert data.x.shape == (4, 1)
    assert data.class_names == ["cat", "dog", "emu"]
    assert data.y.tolist() == [0, 1, 0, 2] and data.y.dtype == torch.long


def test_load_csv_classification_sorts_numeric_labels_numerically(tmp_path):
    path = tmp_path / "numeric.csv"
    path.write_text("x,label\n0,10\n1,2\n2,-1\n3,2\n")
    data = load_csv(path, ["x"], "label", task="classification")
    assert data.class_names == ["-1", "2", "10"]
    assert data.y.tolist() == [2, 1, 0, 1]


def test_load_csv_errors(csv_file, tmp_path):
    with pytest.raises(ValueError, match="line 2, column 'species'"):
        load_csv(csv_file, ["species"], "target")  # text in an input column
    gappy = tmp_path / "gappy.csv"
    gappy.write_text("a,t\n1,2\n\nx,3\n")
    with pytest.raises(ValueError, match="line 4, column 'a'"):  # file line numbers, blank line included
        load_csv(gappy, ["a"], "t")
    with pytest.raises(ValueError, match="not in the header"):
        load_csv(csv_file, ["nope"], "target")
    with pytest.raises(ValueError, match="also listed"):
        load_csv(csv_file, ["a", "target"], "target")
    with pytest.raises(ValueError, match="task"):
        load_csv(csv_file, ["a"], "target", task="ranking")
    with pytest.raises(FileNotFoundError):
        load_csv(tmp_path / "absent.csv", ["a"], "target")


@pytest.mark.parametrize(
    ("cell", "message"),
    [("inf", "line 3, column 'b': 'inf' is not a finite number"),
     ("-Infinity", "line 3, column 'b': '-Infinity' is not a finite number"),
     ("nan", "line 3, column 'b': missing value"),
     ("1,5", "line 3: 4 fields"),
     ("abc", "line 3, column 'b': cannot read 'abc'")],
)
def test_load_csv_rejects_non_finite_and_non_numeric_cells(tmp_path, cell, message):
    path = tmp_path / "bad.csv"
    path.write_text(f"a,b,t\n1,2,3\n4,{cell},6\n")
    with pytest.raises(ValueError, match=message) as info:
        load_csv(path, ["a", "b"], "t")
    assert str(path) in str(info.value)


def test_load_csv_rejects_non_finite_regression_target(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("a,t\n1,2\n4,inf\n")
    with pytest.raises(ValueError, match="line 3, column 't'"):
        load_csv(path, ["a"], "t")


def test_load_csv_rejects_duplicate_header_names(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("a,b,a\n1,2,3\n")
    with pytest.raises(ValueError, match=r"line 1: header name 'a' appears twice \(columns 0 and 2"):
        load_csv(path, ["b"], 0)


def test_load_csv_strips_utf8_byte_order_mark(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes("\ufeffa,t\n1,2\n3,4\n".encode())
    data = load_csv(path, ["a"], "t")
    assert data.input_names == ["a"]
    torch.testing.assert_close(data.x, torch.tensor([[1.0], [3.0]], dtype=torch.float64))


@pytest.mark.parametrize("bad", ["inf", "nan", "-Infinity"])
def test_load_csv_rejects_a_non_finite_label_among_numeric_labels(tmp_path, bad):
    path = tmp_path / "labels.csv"
    path.write_text(f"x,label\n0.1,2\n0.2,10\n0.3,{bad}\n0.4,2\n")
    with pytest.raises(ValueError, match=r"line 4, column 'label'.*NaN or infinite"):
        load_csv(path, ["x"], "label", task="classification")
    # text labels stay text, whatever they spell
    path.write_text("x,label\n0.1,cat\n0.2,inf\n")
    assert load_csv(path, ["x"], "label", task="classification").class_names == ["cat", "inf"]


@pytest.mark.parametrize(
    ("inputs", "target", "name"),
    [([True], "target", "input_columns"), (True, "target", "input_columns"), (["a", False], "target", "input_columns"),
     (["a"], True, "target_column"), ([1.0], "target", "input_columns"), ([None], "target", "input_columns"),
     (["a"], 3.0, "target_column")],
)
def test_load_csv_refuses_bools_and_non_integer_indices(csv_file, tmp_path, inputs, target, name):
    # input_columns=[True] used to pick column 1 (True == 1)
    with pytest.raises(ValueError, match=f"^{name} must hold header names"):
        load_csv(csv_file, inputs, target)
    with pytest.raises(ValueError, match=f"^{name} must hold header names"):  # checked before reading
        load_csv(tmp_path / "absent.csv", inputs, target)


def test_load_csv_accepts_numpy_integer_indices(csv_file):
    by_name = load_csv(csv_file, ["b", "a"], "target")
    by_numpy = load_csv(csv_file, [np.int64(1), np.int32(0)], np.int64(-1))
    torch.testing.assert_close(by_numpy.x, by_name.x, rtol=0, atol=0)
    torch.testing.assert_close(by_numpy.y, by_name.y, rtol=0, atol=0)
    assert by_numpy.input_names == ["b", "a"]


def test_load_csv_refuses_no_or_repeated_input_columns_and_a_non_floating_dtype(csv_file):
    with pytest.raises(ValueError, match="^input_columns is empty"):
        load_csv(csv_file, [], "target")
    with pytest.raises(ValueError, match=r"^input_columns lists column\(s\) \['a'\] more than once"):
        load_csv(csv_file, ["a", 0], "target")
    with pytest.raises(ValueError, match="^dtype must be a floating-point torch.dtype"):
        load_csv(csv_file, ["a"], "target", dtype=torch.int64)
