"""The repository explains itself: no page and no source file cites a path outside it.

A machine-specific folder (the benchmark data beside the checkout, a home or work directory) is written as a
placeholder in the docs (``DATA``, ``LAPLACE_PYTHON``: ``ntkgp._doctable.PLACEHOLDERS``), and the scripts that
write generated regions name their command with ``ntkgp._doctable.command_line``, which does so. This test
reads README.md, docs/ (not the built site, docs/_build) and every source and text file git tracks or would
track (untracked but not ignored), and fails on a relative path that climbs out of the repository into a
sibling ``shared`` folder or on an absolute path under the ``work`` root.
"""

import importlib.machinery
import re
import subprocess
import sys
import types

from ntkgp._doctable import REPO_ROOT, command_line

#: Suffixes of the files read (results as JSON and images are not text written by hand or by a footer).
SUFFIXES = {".md", ".py", ".toml", ".sh", ".rst", ".txt", ".cfg", ".yml", ".yaml"}
#: Folders never read: the built site and what a local run leaves behind.
SKIPPED = {"_build", "build", "dist", "__pycache__", "node_modules"}
#: A climb out of the repository into the sibling folder ``shared`` (``..`` then ``shared``, at any depth) but
#: not a file of the parent such as ``shared_x.md``; and an absolute path starting at the ``work`` root, not
#: the same letters inside a URL or a relative path. The examples below are split so this file cannot match.
OUTSIDE = re.compile(r"(?<![\w.])\.\./shared(?![\w.-])|(?<![\w./~:-])/wor[k]/")


def _files():
    """The repository's text files: git's list (tracked, and untracked but not ignored), else a walk."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                                capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
        paths = [REPO_ROOT / name for name in listed]
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an unpacked archive)
        paths = [p for p in REPO_ROOT.rglob("*")
                 if not any(part.startswith(".") or part in SKIPPED for part in p.relative_to(REPO_ROOT).parts)]
    paths.append(REPO_ROOT / "README.md")
    paths += (REPO_ROOT / "docs").rglob("*.md")
    return sorted({p for p in paths if p.suffix in SUFFIXES and p.is_file()
                   and not SKIPPED.intersection(p.relative_to(REPO_ROOT).parts)})


def test_pattern_is_tight():
    for cited in ["--data-dir ../sha" "red/data", "`../sha" "red`", "see ../../sha" "red/data/uci",
                  "'/wor" "k/main/x.py'"]:
        assert OUTSIDE.search(cited), cited
    for fine in ["[x](../sha" "red_memory.md)", "../sha" "red.md", "https://example.org/wor" "k/x", "docs/wor" "k/x",
                 "--data-dir DATA", "shared/ folder", "a shared data set"]:
        assert not OUTSIDE.search(fine), fine


def test_no_file_cites_a_path_outside_the_repository():
    cited = []
    for path in _files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            match = OUTSIDE.search(line)
            if match:
                cited.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()[:120]}")
    assert not cited, (
        "paths outside the repository (write the data folder as DATA, the laplace-torch interpreter as "
        "LAPLACE_PYTHON; footers by ntkgp._doctable.command_line):\n" + "\n".join(cited))


def test_command_line_writes_placeholders_and_how_the_script_was_run(monkeypatch):
    main = types.ModuleType("__main__")
    main.__spec__ = None  # python benchmarks/evidence.py ...
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [str(REPO_ROOT / "benchmarks" / "evidence.py"), "--data-dir", "/somewhere/data",
                                      "--laplace-python=/opt/laplace/bin/python", "--write-docs"])
    assert command_line() == ("python benchmarks/evidence.py --data-dir DATA --laplace-python=LAPLACE_PYTHON "
                              "--write-docs")
    main.__spec__ = importlib.machinery.ModuleSpec("benchmarks.marglik_round", None)  # python -m ...
    monkeypatch.setattr(sys, "argv", [str(REPO_ROOT / "benchmarks" / "marglik_round.py"), "--data-dir", "d",
                                      "--laplace-steps", "4"])
    assert command_line() == "python -m benchmarks.marglik_round --data-dir DATA --laplace-steps 4"
