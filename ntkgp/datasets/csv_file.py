"""A user's CSV file with a header row: columns by name or index, every cell checked before returning."""

from __future__ import annotations

import csv
import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from ..validation import float_dtype
from .data_folder import PathType

__all__ = ["CsvData", "load_csv"]


class CsvData(NamedTuple):
    """Output of :func:`load_csv`."""

    x: Tensor
    """``(N, D)`` inputs, in the order of ``input_columns``."""
    y: Tensor
    """``(N, 1)`` float targets (regression) or ``(N,)`` long labels in ``0..C-1`` (classification)."""
    input_names: list[str]
    """Header names of the input columns."""
    class_names: list[str] | None
    """The text of each class for classification (``class_names[k]`` is label ``k``); ``None`` for regression."""


def load_csv(
    path: PathType,
    input_columns: Sequence[str | int] | str | int,
    target_column: str | int,
    task: Literal["regression", "classification"] = "regression",
    delimiter: str = ",",
    dtype: torch.dtype = torch.float64,
) -> CsvData:
    """Load a user's CSV file with a header row, checking every cell before returning.

    Columns are chosen by header name or by 0-based index (negative indices count from the end). Input
    cells (and regression targets) must be finite numbers. For ``task="classification"`` the target cells
    may be any text; the classes are sorted (numerically when every label is a finite number, e.g.
    ``2 < 10``, otherwise alphabetically) and mapped to ``0..C-1``. Blank lines are skipped; a UTF-8 byte
    order mark is dropped from the first header name; no normalization is applied.

    Args:
        path: the CSV file.
        input_columns: header names or indices of the input columns (one name or index is accepted too),
            at least one, none twice. An index is any integer but ``bool`` (``True`` is not column 1).
        target_column: header name or index of the target column.
        task: ``"regression"`` (float targets) or ``"classification"`` (class labels).
        delimiter: the field separator.
        dtype: floating-point dtype of ``x`` (and of regression targets).

    Returns:
        :class:`CsvData` ``(x, y, input_names, class_names)``.

    Raises:
        FileNotFoundError: if ``path`` is not a file.
        ValueError: naming the file, the line and the column: a file that is not UTF-8 text, an empty file, a
            duplicated header name, an unknown column, a row with the wrong number of fields, a cell that is not
            a number, a NaN or infinite cell, a missing label, a NaN or infinite label among numeric ones; or,
            before the file is read, an unknown ``task``, a ``dtype`` that is not floating point, or a column
            that is neither a name nor an integer index (a ``bool`` included), no input column or one listed
            twice.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "data.csv"
        >>> _ = path.write_text("a,b,label\\n0.5,1,cat\\n1.5,2,dog\\n")
        >>> data = load_csv(path, ["a", "b"], "label", task="classification")
        >>> data.x.shape, data.y.tolist(), data.class_names
        (torch.Size([2, 2]), [0, 1], ['cat', 'dog'])
    """
    if task not in ("regression", "classification"):
        raise ValueError(f"task must be 'regression' or 'classification'; got {task!r}")
    float_dtype(dtype)
    if isinstance(input_columns, (str, numbers.Integral)):
        input_columns = [input_columns]
    input_columns = list(input_columns)
    if not input_columns:
        raise ValueError("input_columns is empty; name at least one input column")
    for name, column in [*(("input_columns", c) for c in input_columns), ("target_column", target_column)]:
        if isinstance(column, bool) or not isinstance(column, (str, numbers.Integral)):
            raise ValueError(
                f"{name} must hold header names (str) or integer column indices, not {type(column).__name__} "
                f"{column!r}"
            )
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CSV file {str(path)!r} not found")
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle, delimiter=delimiter)
            numbered = [(reader.line_num, row) for row in reader if any(cell.strip() for cell in row)]
    except UnicodeDecodeError as problem:
        raise ValueError(f"{path} is not UTF-8 text ({problem.reason} at byte {problem.start})") from None
    except csv.Error as problem:
        raise ValueError(f"{path}, line {reader.line_num}: {problem}") from None
    if not numbered:
        raise ValueError(f"{path} is empty; expected a header row followed by data rows")
    header = [name.strip() for name in numbered[0][1]]
    seen: dict[str, int] = {}
    for position, name in enumerate(header):
        if name in seen:
            raise ValueError(
                f"{path}, line {numbered[0][0]}: header name {name!r} appears twice (columns {seen[name]} and "
                f"{position}, 0-based); header names must be unique"
            )
        seen[name] = position
    lines = [line for line, _ in numbered[1:]]
    body = [row for _, row in numbered[1:]]
    inputs = [_column_index(header, column, path) for column in input_columns]
    target = _column_index(header, target_column, path)
    repeated = sorted({header[i] for i in inputs if inputs.count(i) > 1})
    if repeated:
        raise ValueError(f"input_columns lists column(s) {repeated} more than once")
    if target in inputs:
        raise ValueError(f"target column {header[target]!r} is also listed among the input columns")
    for line, row in zip(lines, body):
        if len(row) != len(header):
            raise ValueError(f"{path}, line {line}: {len(row)} fields, but the header has {len(header)}")
    x_values = [[_number(row[i], line, header[i], path) for i in inputs] for line, row in zip(lines, body)]
    x = torch.tensor(x_values, dtype=dtype).reshape(len(body), len(inputs))
    input_names = [header[i] for i in inputs]
    if task == "regression":
        y_values = [_number(row[target], line, header[target], path) for line, row in zip(lines, body)]
        return CsvData(x, torch.tensor(y_values, dtype=dtype).reshape(-1, 1), input_names, None)
    texts = [row[target].strip() for row in body]
    for line, text in zip(lines, texts):
        if not text:
            raise ValueError(f"{path}, line {line}, column {header[target]!r}: missing label")
    try:
        keys: list[float] | list[str] = [float(text) for text in texts]
    except ValueError:
        keys = texts
    else:
        # numeric labels: a NaN or infinite one is a missing or corrupt value, not a class of its own
        for line, key, text in zip(lines, keys, texts):
            if not math.isfinite(key):
                raise ValueError(
                    f"{path}, line {line}, column {header[target]!r}: label {text!r} is NaN or infinite while the "
                    "other labels are numbers"
                )
    classes = sorted(set(keys))
    first_text: dict[float | str, str] = {}
    for key, text in zip(keys, texts):
        first_text.setdefault(key, text)
    code = {key: k for k, key in enumerate(classes)}
    y = torch.tensor([code[key] for key in keys], dtype=torch.long)
    return CsvData(x, y, input_names, [first_text[key] for key in classes])


def _column_index(header: list[str], column: str | int, path: Path) -> int:
    """Resolve a header name or a (possibly negative) integer index to a 0-based column index."""
    if isinstance(column, numbers.Integral):
        column = int(column)
        if not -len(header) <= column < len(header):
            raise ValueError(f"column index {column} out of range: {path} has {len(header)} columns")
        return column % len(header)
    if column not in header:
        raise ValueError(f"column {column!r} not in the header of {path}: {header}")
    return header.index(column)


def _number(text: str, line: int, column: str, path: Path) -> float:
    """Parse one numeric cell, with a message pointing at the cell on failure."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{path}, line {line}, column {column!r}: cannot read {text!r} as a number"
        ) from None
    if math.isnan(value):
        raise ValueError(f"{path}, line {line}, column {column!r}: missing value ({text.strip()!r}, NaN)")
    if math.isinf(value):
        raise ValueError(f"{path}, line {line}, column {column!r}: {text.strip()!r} is not a finite number")
    return value
