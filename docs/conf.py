"""Sphinx configuration of ntkgp's site: the guide pages of docs/ (Markdown, myst-parser) and the API
reference from the docstrings (Google style, autodoc + napoleon + autosummary).

Build it (offline; nothing is downloaded, no code block is executed):

    .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

Why Sphinx: it is the tool of this ecosystem — PyTorch, GPyTorch, linear_operator and BoTorch all build
their references with Sphinx + autodoc — so ntkgp's docstrings (which cite ``:class:`` / ``:math:`` roles)
render as they are written, and myst-parser reads the existing Markdown pages unchanged.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's ntkgp, also when it is not installed in the environment

os.environ.setdefault("MPLBACKEND", "Agg")

import ntkgp  # noqa: E402

project = "ntkgp"
author = "ntkgp developers"
copyright = f"{date.today().year}, {author}"
release = ntkgp.__version__
version = release

extensions = [
    "myst_parser",  # the Markdown pages of docs/
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",  # "[source]" links to highlighted source pages, built locally
]

# MathJax for reading the site offline. sphinx-mathjax-offline (PyPI) ships the MathJax 3.2.2 distribution
# unmodified (its files are byte-identical to es5/ of npm's mathjax@3.2.2; the same major version as
# Sphinx's default CDN URL) and an 11-line extension that sets mathjax_path and copies the files into
# _static/mathjax after a successful build. It has had no release since 2022, but needs none: its Python part
# only calls sphinx.util.fileutil.copy_asset, and MathJax 3.2.2 is the final 3.x release. It is the one
# Sphinx extension on PyPI we found that bundles MathJax (sphinxcontrib-katex loads KaTeX from a CDN unless
# Node prerenders the math).
# Without the package the pages load MathJax from its CDN (the build itself never needs the network).
try:
    importlib.import_module("sphinx-mathjax-offline")
except ImportError:  # pragma: no cover - docs extra not installed
    pass
else:
    extensions.append("sphinx-mathjax-offline")

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**/.ipynb_checkpoints"]
templates_path = ["_templates"]

# --- Markdown (myst-parser) -------------------------------------------------------------------------------
myst_enable_extensions = [
    "dollarmath",  # $...$ and $$...$$
    "amsmath",  # \begin{align} ... environments
    "colon_fence",
    "deflist",
]
myst_dmath_double_inline = True
myst_heading_anchors = 3  # links such as math.md#empirical-ntk resolve to the heading
# The code blocks of the pages are executed by pytest (sybil, conftest.py), never by this build: myst-parser
# only highlights them. "text" blocks hold output; "python"/"bash" blocks are highlighted as such.

# --- API reference ----------------------------------------------------------------------------------------
autosummary_generate = True
autosummary_ignore_module_all = False  # a module's public API is its __all__
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "member-order": "bysource",
}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True  # show `strategy="auto"`, not the value of a module constant
autoclass_content = "class"  # the Args: of a constructor are in the class docstring (ntkgp convention)
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
python_use_unqualified_type_names = True

# --- HTML ---------------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"ntkgp {release}"
html_static_path = ["_static"] if (Path(__file__).parent / "_static").is_dir() else []
html_copy_source = False
html_show_sourcelink = False

# Warnings-as-errors (-W) applies to everything; no category is suppressed.
suppress_warnings: list[str] = []


# --- Cross-references to re-exported names ------------------------------------------------------------------
# Each object is documented once, under the public module that exports it (ntkgp.kernels.NTKKernel), while
# docstrings and annotations name it as users import it (ntkgp.NTKKernel) or where it is defined
# (ntkgp.kernels.ntk_kernel.NTKKernel). This handler resolves such a reference to the documented object that
# is the same Python object, so every spelling links to the one entry.

_DOCUMENTED: dict[int, str] | None = None


def _import(path: str):
    """The object named by a dotted path, or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - any failure means "not importable this way"
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _documented(env) -> dict[int, str]:
    global _DOCUMENTED
    if _DOCUMENTED is None:
        _DOCUMENTED = {}
        for fullname, entry in env.get_domain("py").objects.items():
            if entry.objtype not in ("class", "function", "exception", "method", "attribute", "property", "data"):
                continue
            obj = _import(fullname)
            if obj is not None and (inspect.isclass(obj) or inspect.isroutine(obj)):
                _DOCUMENTED.setdefault(id(obj), fullname)
    return _DOCUMENTED


def _resolve_reexport(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    if not target.startswith("ntkgp."):
        modname = node.get("py:module") or ""
        candidates = [f"{modname}.{target}"] if modname.startswith("ntkgp") else []
    else:
        candidates = [target]
    for candidate in candidates:
        obj = _import(candidate)
        if obj is None or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        fullname = _documented(env).get(id(obj))
        if fullname is None or fullname == candidate:
            continue
        domain = env.get_domain("py")
        return domain.resolve_xref(env, node["refdoc"], app.builder, node.get("reftype", "obj"),
                                   fullname, node, contnode)
    return None


# --- Docstrings of re-exported constants ----------------------------------------------------------------------
# autodoc documents a module-level constant only when it has a `#:` comment in the module being documented;
# a constant re-exported in a package's __all__ (ntkgp.ntk.STRATEGIES) has its comment in the defining
# submodule. The API pages list such names with explicit ``autodata`` directives, and this handler gives
# them the `#:` comment of the submodule that defines them (tests/docs/test_site.py checks that every name
# of every public __all__ is on the site).


def _reexported_attr_doc(app, what, name, obj, options, lines):
    if what != "data" or not name.startswith("ntkgp."):
        return
    own = [line for line in lines if line.strip()]
    inherited = inspect.cleandoc(type(obj).__doc__ or "").splitlines()  # tuple's or UnionType's docstring
    if own and own != [line for line in inherited if line.strip()]:
        return
    from sphinx.pycode import ModuleAnalyzer

    package, attr = name.rsplit(".", 1)
    root = Path(importlib.import_module(package).__file__).parent
    for path in sorted(root.glob("*.py")):
        modname = package if path.name == "__init__.py" else f"{package}.{path.stem}"
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:  # noqa: BLE001 - a module the analyzer cannot read has no comments to offer
            continue
        if ("", attr) in docs:
            lines[:] = list(docs["", attr])
            return
    lines[:] = []  # no comment anywhere: show the value alone, not the docstring of its type


# --- Docstrings cite the guide pages as docs/NAME.md: make that a link -------------------------------------------

_PAGE_CITATION = re.compile(r"(``)?\bdocs/(?P<page>[a-z_]+)\.md\b(``)?")


def _link_page_citations(app, what, name, obj, options, lines):
    docs = Path(app.srcdir)

    def link(match):
        page = match["page"]
        if not (docs / f"{page}.md").exists():
            return match[0]
        return f":doc:`docs/{page}.md </{page}>`"

    for i, line in enumerate(lines):
        if "docs/" in line and not line.lstrip().startswith(">>>") and not line.lstrip().startswith("..."):
            lines[i] = _PAGE_CITATION.sub(link, line)


def _reset_documented(app, env, docnames):
    global _DOCUMENTED
    _DOCUMENTED = None


def setup(app):
    app.connect("env-before-read-docs", _reset_documented)
    app.connect("missing-reference", _resolve_reexport)
    app.connect("autodoc-process-docstring", _reexported_attr_doc)
    app.connect("autodoc-process-docstring", _link_page_citations)
