"""Write measured results into the docs, so that no number there is typed by hand.

A Markdown page marks each generated region::

    <!-- generated: NAME -->
    ...written by the script...
    <!-- end generated: NAME -->

and the script that measured the numbers calls :func:`write_block` (by convention behind a
``--write-docs`` flag), which replaces the region with the new content followed by a line naming the
command, the date and the machine. ``tests/docs/test_generated.py`` checks that every table of numbers in
``README.md`` and ``docs/`` lies in such a region and that the script named in it writes that region.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
from pathlib import Path

__all__ = ["write_block", "markdown_table", "block_pattern", "command_line", "REPO_ROOT"]

#: The repository root (this file lives in ``ntkgp/``).
REPO_ROOT = Path(__file__).resolve().parent.parent


#: Options whose values are machine-specific, and what a footer writes in their place.
PLACEHOLDERS = {"--data-dir": "DATA", "--laplace-python": "LAPLACE_PYTHON", "--weights": "WEIGHTS.pt"}


def _program() -> list[str]:
    """How the running script was started: ``["-m", "package.module"]`` when run with ``python -m``, else its
    path relative to the repository root."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name and name != "__main__":
        return ["-m", name.removesuffix(".__main__")]
    return [os.path.relpath(sys.argv[0], REPO_ROOT)]


def command_line(extra: dict[str, str] | None = None) -> str:
    """The running script's command as typed from the repository root, for a footer: the data folder written
    as ``DATA``, the laplace-torch interpreter as ``LAPLACE_PYTHON`` and a weights file as ``WEIGHTS.pt``
    (:data:`PLACEHOLDERS`). A script run
    with ``python -m package.module`` is written so. A note (such as ``  # with laplace-torch 0.3 importable``)
    is appended by the caller, after the command. ``extra`` adds placeholders of the script's own options."""
    placeholders = PLACEHOLDERS if extra is None else {**PLACEHOLDERS, **extra}
    out = []
    placeholder = None
    for token in sys.argv[1:]:
        if placeholder:
            out.append(placeholder)
            placeholder = None
            continue
        option = token.split("=", 1)[0]
        if option in placeholders:
            if "=" in token:
                token = f"{option}={placeholders[option]}"
            else:
                placeholder = placeholders[option]
        out.append(token)
    argv = [*_program(), *out]
    return "python " + " ".join(shlex.quote(t) for t in argv)


def block_pattern(name: str | None = None) -> re.Pattern:
    """The regular expression of a generated region (any name when ``name`` is None)."""
    label = re.escape(name) if name is not None else r"[\w.:/-]+"
    return re.compile(rf"<!-- generated: (?P<name>{label}) -->\n(?P<body>.*?)<!-- end generated: (?P=name) -->",
                      re.DOTALL)


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table; floats are written as given by ``str`` (format them before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _machine() -> str:
    cores = os.cpu_count()
    try:
        load = f", load average {os.getloadavg()[0]:.1f}"
    except OSError:  # pragma: no cover - not on every platform
        load = ""
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        torch_version = f", torch {torch.__version__}"
    except Exception:  # pragma: no cover
        device, torch_version = "unknown device", ""
    return f"{platform.machine()}, {cores} CPU cores, {device}{torch_version}{load}"


def write_block(doc: str | os.PathLike, name: str, content: str, command: str) -> Path:
    """Replace the generated region ``name`` of the Markdown file ``doc`` with ``content``.

    Args:
        doc: path of the page, absolute or relative to the repository root.
        name: the region's name (``<!-- generated: name -->``); it must already exist in the page.
        content: Markdown (a table, a list of figures, an image link).
        command: the command that produced ``content``, as a user would type it from the repository root.

    Returns:
        The path written.

    Raises:
        KeyError: if the page has no region ``name`` (add the two marker lines to the page first).
    """
    path = Path(doc)
    if not path.is_absolute():
        path = REPO_ROOT / path
    text = path.read_text()
    pattern = block_pattern(name)
    if not pattern.search(text):
        raise KeyError(f"{path} has no region '<!-- generated: {name} -->' ... '<!-- end generated: {name} -->'")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = f"{content.rstrip()}\n\n*Generated by `{command}` on {stamp} ({_machine()}).*\n"
    new = pattern.sub(lambda m: f"<!-- generated: {name} -->\n{body}<!-- end generated: {name} -->", text, count=1)
    path.write_text(new)
    return path
