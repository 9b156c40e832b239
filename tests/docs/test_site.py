"""The documentation site (docs/conf.py, Sphinx): the API reference covers the public API, and the site
builds with warnings as errors (the build itself runs in CI, .ci/run, and here with --runslow)."""

import importlib
import posixpath
import re
import subprocess
import sys

import pytest

import ntkgp
from ntkgp._doctable import REPO_ROOT

DOCS = REPO_ROOT / "docs"
API = DOCS / "api"
# The public modules: the subpackages of ntkgp.__all__ and the other modules users import from.
PUBLIC_MODULES = [
    "options", "kernels", "ntk", "likelihoods", "laplace", "laplace.function_space", "laplace.weight_space", "models",
    "means", "mlls", "training", "fsvi", "botorch", "distributed", "datasets", "metrics",
]


def _toctree_entries(page):
    text = page.read_text()
    entries = []
    for block in re.findall(r"```\{toctree\}\n(.*?)```", text, re.S):
        entries += [line.strip() for line in block.splitlines() if line.strip() and not line.startswith(":")]
    return entries


def test_every_public_module_has_an_api_page_in_the_toctree():
    modules = {name for name in ntkgp.__all__ if type(getattr(ntkgp, name)).__name__ == "module"}
    assert modules <= set(PUBLIC_MODULES)
    listed = _toctree_entries(API / "index.md")
    for module in PUBLIC_MODULES:
        page = API / f"{module.replace('.', '_')}.md"
        assert page.exists(), page
        assert f".. automodule:: ntkgp.{module}\n" in page.read_text(), page
        assert module.replace(".", "_") in listed, f"docs/api/index.md's toctree lacks {module}"
    assert "api/index" in _toctree_entries(DOCS / "index.md")


def test_top_level_summary_is_ntkgp_all():
    """docs/api/index.md lists each object of ``ntkgp.__all__`` (by the module that documents it), no other."""
    text = (API / "index.md").read_text()
    block = re.search(r"\.\. autosummary::\n(.*?)```", text, re.S)[1]
    entries = [line.strip().lstrip("~") for line in block.splitlines() if line.strip() and ":" not in line]
    listed = [getattr(importlib.import_module(f"ntkgp.{e.rsplit('.', 1)[0]}"), e.rsplit(".", 1)[1]) for e in entries]
    objects = [getattr(ntkgp, n) for n in ntkgp.__all__ if n != "__version__"]
    objects = [o for o in objects if type(o).__name__ != "module"]
    assert len(listed) == len(entries) == len({id(o) for o in listed})
    assert {id(o) for o in listed} == {id(o) for o in objects}


@pytest.mark.slow
def test_site_builds_without_warnings_and_documents_every_public_name(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = tmp_path / "html"
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees"),
         str(DOCS), str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-6000:]

    from sphinx.util.inventory import InventoryFile

    with open(out / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", posixpath.join)
    documented = set()
    for kind, entries in inventory.items():
        if kind.startswith("py:"):
            documented |= set(entries)
    missing = []
    for module in PUBLIC_MODULES:
        mod = importlib.import_module(f"ntkgp.{module}")
        names = getattr(mod, "__all__", None)
        if names is None:  # ntkgp.options: its public classes and functions
            names = [n for n, o in vars(mod).items() if not n.startswith("_") and callable(o)
                     and getattr(o, "__module__", None) == mod.__name__]
        # a package front door (ntkgp.laplace) may document its names in the subpackages that define them
        missing += [f"ntkgp.{module}.{n}" for n in names if f"ntkgp.{module}.{n}" not in documented
                    and not any(d.startswith(f"ntkgp.{module}.") and d.endswith(f".{n}") for d in documented)]
    assert not missing, f"public names not on the site: {missing}"
    # math is rendered by MathJax, bundled when sphinx-mathjax-offline is installed (the docs extra)
    page = (out / "math.html").read_text()
    assert "mathjax" in page.lower() and r"\(" in page
