"""Every fenced code block in README.md and docs/ is either run by the test suite or visibly marked.

``python``, ``bash`` and ``sh`` blocks are run (root ``conftest.py``, sybil) unless their first line starts
with ``# illustrative``; ``text`` blocks are output shown to the reader. Any other language (or none) would
be silently skipped by the runner, so it is refused here. The site's own MyST directives (``{toctree}``, and
``{eval-rst}`` holding autodoc directives) are not code; an ``{eval-rst}`` block must not smuggle in a code
or literal block.
"""

import re

import pytest

from ntkgp._doctable import REPO_ROOT

PAGES = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")])
PAGES = [p for p in PAGES if "_build" not in p.parts]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$", re.MULTILINE)
RUN = {"python", "bash", "sh"}
SHOWN = {"text", "math", "mermaid"}
CODE_DIRECTIVE = re.compile(r"\.\.\s+(code|code-block|sourcecode|literalinclude|doctest|testcode)::")


def _blocks(text):
    """(language, line, body) of each fenced block."""
    open_fence = None
    for match in FENCE.finditer(text):
        if open_fence is None:
            open_fence = match
        elif match["fence"].startswith(open_fence["fence"]) and not match["info"].strip():
            yield (open_fence["info"].strip().split(" ")[0], text.count("\n", 0, open_fence.start()) + 1,
                   text[open_fence.end():match.start()])
            open_fence = None
    if open_fence is not None:  # an unclosed fence runs to the end of the page
        yield open_fence["info"].strip().split(" ")[0], text.count("\n", 0, open_fence.start()) + 1, text[open_fence.end():]


def _refused(lang, body):
    if lang in RUN | SHOWN | {"{toctree}"}:
        return False
    if lang != "{eval-rst}":
        return True
    # automodule/autodata/autosummary directives only: no code directive, doctest or `::` literal block
    for line in map(str.strip, body.splitlines()):
        if CODE_DIRECTIVE.match(line) or line.startswith(">>>") or (line.endswith("::") and not line.startswith("..")):
            return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_code_block_is_run_or_shown(page):
    wrong = [f"{page.name}:{line}: ```{lang}" for lang, line, body in _blocks(page.read_text()) if _refused(lang, body)]
    assert not wrong, "code blocks in a language the doc runner does not run (use python/bash/sh, or text for output):\n" + "\n".join(wrong)
