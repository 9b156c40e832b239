"""The example scripts run: tiny settings in-process (fast), their ``--quick`` settings as the gallery runs
them (slow), and ``scripts/gallery.py`` writes a page whose region names its script."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ntkgp.datasets import DATA_DIR_VARIABLE

pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BENCHMARK_DATA = Path(os.environ.get(DATA_DIR_VARIABLE) or "/nonexistent")  # the data folder, if the user set it


def run_example(name: str, args: list[str], monkeypatch, capsys) -> str:
    """``python examples/NAME.py ARGS`` in this process (no data folder unless ARGS name one); its stdout."""
    monkeypatch.delenv(DATA_DIR_VARIABLE, raising=False)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(sys, "argv", [name, *args])
    threads = torch.get_num_threads()  # bayesian_optimization.py sets one thread
    try:
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def numbers(line: str) -> list[float]:
    return [float(t) for t in re.findall(r"-?\d+\.\d+", line)]


def table(out: str, first_header: str) -> list[list[str]]:
    """The rows (split on runs of 2+ spaces) of the table whose header starts with ``first_header``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_header)) + 2
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_snelson_tiny_on_the_stand_in(tmp_path, monkeypatch, capsys):
    out = run_example("snelson_regression", ["--quick", "--epochs", "2", "--grid-size", "2", "--width", "4",
                                             "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert "data: synthetic 1-D gap regression (stand-in" in out and "width 4, 2 epochs" in out
    assert len(table(out, "network")) == 2 and len(table(out, "method")) == 4
    assert (tmp_path / "snelson_regression.png").stat().st_size > 10_000


def test_banana_tiny_on_the_stand_in(tmp_path, monkeypatch, capsys):
    out = run_example("banana_classification", ["--quick", "--epochs", "3", "--width", "8", "--output-dir",
                                                str(tmp_path)], monkeypatch, capsys)
    assert "data: two moons (stand-in" in out and "N_train = 280, N_test = 120, 3 epochs" in out
    rows = table(out, "model")
    assert [row[:2] for row in rows] == [["online", "MAP"], ["online", "NTKGP"], ["baseline", "MAP"],
                                         ["baseline", "NTKGP"]]
    for row in rows:
        accuracy = float(row[4])
        assert 0.0 <= accuracy <= 1.0
    assert (tmp_path / "banana_classification.png").stat().st_size > 10_000


def test_sequential_tiny_on_the_stand_in(tmp_path, monkeypatch, capsys):
    out = run_example("sequential_updates", ["--quick", "--epochs", "3", "--batches", "2", "--num-inducing", "10",
                                             "--width", "8", "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert "data: scikit-learn's diabetes (stand-in" in out and "398 training points in 2 batches" in out
    rows = table(out, "batch")
    assert [int(row[1]) for row in rows] == [199, 398]
    assert (tmp_path / "sequential_updates.png").stat().st_size > 10_000


def test_bayesian_optimization_tiny(tmp_path, monkeypatch, capsys):
    out = run_example("bayesian_optimization", ["--quick", "--seeds", "1", "--iterations", "2", "--train-steps", "5",
                                                "--output-dir", str(tmp_path)], monkeypatch, capsys)
    rows = [line for line in out.splitlines() if line.startswith("| Branin") or line.startswith("| Hartmann")]
    assert len(rows) == 6
    assert (tmp_path / "bo_regret.png").stat().st_size > 10_000


def test_fmnist_uncertainty_tiny_on_synthetic_images(tmp_path, monkeypatch, capsys):
    """The image example end to end on tiny synthetic images: MAP, KFAC-GLM, SFR and FSVI on one table with
    in-range metrics, and the entropy figure."""
    out = run_example("fmnist_uncertainty", ["--synthetic", "--quick", "--n-train", "120", "--n-test", "40",
                                             "--num-inducing", "8", "--channels", "2", "4", "--output-dir",
                                             str(tmp_path)], monkeypatch, capsys)
    assert "data: synthetic stripes (OOD: checkerboards)" in out
    rows = table(out, "method")
    assert [row[0] for row in rows] == ["MAP", "KFAC-GLM", "SFR (M = 8)", "FSVI"]
    for row in rows:
        nlpd, acc, ece, auroc = map(float, row[1:5])
        assert nlpd > 0 and 0 <= acc <= 1 and 0 <= ece <= 1 and 0 <= auroc <= 1
    assert (tmp_path / "fmnist_uncertainty_entropy.png").stat().st_size > 10_000



@pytest.fixture
def one_thread():
    """One torch thread: at these tiny sizes the second thread only adds synchronization (several times the run
    time on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_resnet_batchnorm_tiny_on_synthetic_images(tmp_path, monkeypatch, capsys, one_thread):
    """The ResNet example end to end on tiny synthetic images: MAP, KFAC, KFAC-MC and last-layer KFAC on one
    table with in-range metrics, and the entropy figure."""
    out = run_example("resnet_batchnorm", ["--synthetic", "--n-train", "16", "--n-test", "8", "--epochs", "1",
                                           "--width", "2", "--no-laplace-torch", "--output-dir", str(tmp_path)],
                      monkeypatch, capsys)
    # P of the described network, counted by hand: stem 9W + BN 2W, three blocks of two 3×3 convs (9W² each,
    # no bias) and two BNs (2W each), linear 10W + 10
    width = 2
    assert f"P = {9 * width + 2 * width + 3 * (18 * width**2 + 4 * width) + 10 * width + 10:,}" in out
    rows = table(out, "method")
    assert [row[0] for row in rows] == ["MAP", "KFAC", "KFAC-MC (S = 1)", "last-layer KFAC"]
    for row in rows:
        nll, acc, ece, auroc = map(float, row[1:5])
        assert nll > 0 and 0 <= acc <= 1 and 0 <= ece <= 1 and 0 <= auroc <= 1
    assert (tmp_path / "resnet_batchnorm_entropy.png").stat().st_size > 10_000


def test_transformer_tokens_tiny(tmp_path, monkeypatch, capsys, one_thread):
    """The transformer example end to end at tiny sizes: MAP, KFAC, NTKGP and SFR on integer token ids."""
    out = run_example("transformer_tokens", ["--n-train", "24", "--n-test", "8", "--epochs", "1", "--classes", "3",
                                             "--seq-len", "4", "--vocab", "12", "--width", "4", "--n-gp", "6",
                                             "--num-inducing", "4", "--no-laplace-torch", "--output-dir",
                                             str(tmp_path)], monkeypatch, capsys)
    rows = table(out, "method")
    assert [row[0] for row in rows] == ["MAP", "KFAC", "NTKGP (N = 6)", "SFR (M = 4)"]
    for row in rows:
        nll, acc, ece, auroc = map(float, row[1:5])
        assert nll > 0 and 0 <= acc <= 1 and 0 <= ece <= 1 and 0 <= auroc <= 1
    assert (tmp_path / "transformer_tokens_entropy.png").stat().st_size > 10_000


def test_transformer_task_is_the_first_of_two_markers(monkeypatch):
    """The sequence task, by a scan of each sequence: exactly two different markers, the label is the earlier
    one, both orders equally common (a bag of tokens cannot beat chance); OOD sequences use only the held-out
    quarter of the vocabulary, which no training sequence contains."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from transformer_tokens import marker_sequences

    classes, seq_len, vocab = 4, 10, 32
    x, y = marker_sequences(4000, classes, seq_len, vocab, seed=0)
    later = []
    for tokens, label in zip(x.tolist(), y.tolist()):
        markers = [(position, t) for position, t in enumerate(tokens) if t < classes]
        assert len(markers) == 2 and markers[0][1] != markers[1][1]
        assert label == markers[0][1]
        later.append(markers[1][1])
    assert x.max() < vocab - vocab // 4
    # the label is the smaller of the two markers in half of the sequences: 4000 fair coin flips, |Δ| < 5σ
    smaller = sum(a < b for a, b in zip(y.tolist(), later))
    assert abs(smaller - 2000) < 5 * (4000 * 0.25) ** 0.5
    ood, _ = marker_sequences(100, classes, seq_len, vocab, seed=1, out_of_distribution=True)
    assert ood.min() >= vocab - vocab // 4 and ood.max() < vocab


@pytest.mark.parametrize(("name", "args", "message"), [
    ("snelson_regression", ["--grid-size", "1"], "--grid-size >= 2"),
    ("banana_classification", ["--epochs", "0"], "--epochs must be >= 1"),
    ("sequential_updates", ["--batches", "1"], "--batches must be >= 2"),
    ("bayesian_optimization", ["--seeds", "0"], "--seeds must be >= 1"),
    ("fmnist_uncertainty", ["--epochs", "0"], "--epochs must be a positive integer"),
    ("resnet_batchnorm", ["--width", "0"], "--width must be a positive integer"),
    ("transformer_tokens", ["--width", "3"], "--width must be even"),
])
def test_bad_options_exit_2(name, args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(sys, "argv", [name, *args, "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    assert done.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_given_but_missing_data_folder_is_an_error_not_a_stand_in(tmp_path):
    """``NTKGP_DATA_DIR`` (like ``--data-dir``) pointing nowhere: exit 1, the message names the option and the
    variable; the stand-in is only for when no folder is given at all."""
    env = dict(os.environ, **{DATA_DIR_VARIABLE: str(tmp_path / "absent")})
    done = subprocess.run([sys.executable, "examples/banana_classification.py", "--quick", "--output-dir",
                           str(tmp_path)], cwd=ROOT, env=env, check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    assert "--data-dir" in done.stderr and DATA_DIR_VARIABLE in done.stderr and "not found" in done.stderr
    assert not list(tmp_path.glob("*.png"))


def test_gallery_regions_are_named_in_the_script():
    """Every generated region of docs/gallery/ is one scripts/gallery.py writes (its entries and the index)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gallery
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    regions = {entry.region for entry in gallery.ENTRIES} | {gallery.INDEX_REGION}
    assert len(regions) == len(gallery.ENTRIES) + 1
    source = (ROOT / "scripts" / "gallery.py").read_text()
    assert all(f'"{region}"' in source for region in regions)
    for page in (ROOT / "docs" / "gallery").glob("*.md"):
        for name in re.findall(r"<!-- generated: ([\w.:/-]+) -->", page.read_text()):
            assert name in regions, (page.name, name)
    for entry in gallery.ENTRIES:
        assert (ROOT / entry.argv[0]).is_file() or entry.program == "ntkgp"
        for figure in entry.figures:
            page = ROOT / "docs" / "gallery" / f"{entry.name}.md"
            if page.is_file():
                assert f"]({gallery.figure_name(entry, figure)})" in page.read_text()
                assert (ROOT / "docs" / "gallery" / gallery.figure_name(entry, figure)).is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["snelson_regression", "banana_classification", "sequential_updates",
                                  "bayesian_optimization", "fsvi"])
def test_quick_run_as_in_the_gallery(name, tmp_path, monkeypatch, capsys):
    out = run_example(name, ["--quick", "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert list(tmp_path.glob("*.png"))
    if name == "sequential_updates":
        # the documented claim: an update costs less than retraining, at every batch
        for row in table(out, "batch")[1:]:
            update_s, retrain_s = float(row[4]), float(row[6])
            assert update_s < retrain_s


@pytest.mark.slow
@pytest.mark.skipif(not (BENCHMARK_DATA / "toy").is_dir(), reason=f"set {DATA_DIR_VARIABLE} to the benchmark data folder")
def test_quick_run_on_the_benchmark_data(tmp_path, monkeypatch, capsys):
    out = run_example("banana_classification", ["--quick", "--data-dir", str(BENCHMARK_DATA), "--output-dir",
                                                str(tmp_path)], monkeypatch, capsys)
    assert "data: banana (toy/banana_400_*.csv), N_train = 280" in out


def test_gallery_writes_a_page_its_figures_and_the_index(tmp_path, monkeypatch):
    """scripts/gallery.py on a fake run: the page holds the output in a generated region with a footer naming
    the script, a shrunk PNG linked from the page, and the index lists every entry; refreshing the page's text
    keeps the region."""
    import matplotlib.pyplot as plt

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gallery
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.setattr(gallery, "GALLERY", tmp_path)
    entry = gallery.BY_NAME["banana_classification"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fig = plt.figure(figsize=(20, 4))
    fig.gca().plot([0, 1], [1, 0])
    fig.savefig(run_dir / "banana_classification.png", dpi=100)
    plt.close(fig)
    command = "python scripts/gallery.py --only banana_classification"
    gallery.write_page(entry, None, "model  evidence/N\n-----  ----------\nonline  -0.419", 12.3, run_dir, command)
    page = (tmp_path / "banana_classification.md").read_text()
    assert f"<!-- generated: {entry.region} -->" in page and "online  -0.419" in page
    assert f"*Generated by `{command}` on " in page and "Wall time of the quick run: 12 s." in page
    assert "](banana_classification.png)" in page
    from PIL import Image

    with Image.open(tmp_path / "banana_classification.png") as image:
        assert image.width == gallery.MAX_WIDTH and image.mode == "P"
    gallery.refresh_page(entry, None)
    assert (tmp_path / "banana_classification.md").read_text() == page
    gallery.write_index("python scripts/gallery.py")
    index = (tmp_path / "index.md").read_text()
    # only the pages that exist are linked (a link to a missing page fails the Sphinx build)
    assert "](banana_classification.md)" in index and "](demo.md)" not in index
    assert "| 12 s |" in index and "\nbanana_classification\n```" in index
