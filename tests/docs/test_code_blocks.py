"""Every fenced code block in README.md and docs/ is either run by the test suite or visibly marked.

``python``, ``bash`` and ``sh`` blocks are run (root ``conftest.py``, sybil) unless their first line starts
with ``# illustrative``; ``text`` blocks are output shown to the reader. Any other language (or none) would
be silently skipped by the runner, so it is refused here.
"""

import re

import pytest

from ntkgp._doctable import REPO_ROOT

PAGES = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])
PAGES = [p for p in PAGES if "_build" not in p.parts]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$", re.MULTILINE)
RUN = {"python", "bash", "sh"}
SHOWN = {"text", "math", "mermaid"}


def _blocks(text):
    open_fence = None
    for match in FENCE.finditer(text):
        if open_fence is None:
            open_fence = match
            yield match["info"].strip().split(" ")[0], text.count("\n", 0, match.start()) + 1
        elif match["fence"].startswith(open_fence["fence"]) and not match["info"].strip():
            open_fence = None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_code_block_is_run_or_shown(page):
    wrong = [f"{page.name}:{line}: ```{lang}" for lang, line in _blocks(page.read_text()) if lang not in RUN | SHOWN]
    assert not wrong, "code blocks in a language the doc runner does not run (use python/bash/sh, or text for output):\n" + "\n".join(wrong)
