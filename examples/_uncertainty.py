"""Helpers shared by ``fmnist_uncertainty.py``, ``resnet_batchnorm.py`` and ``transformer_tokens.py``: Adam training of the MAP network, a
table of NLL, accuracy, ECE, OOD AUROC and seconds per method, the entropy figure, and laplace-torch's KFAC
Laplace on the same network when laplace-torch is importable (it is optional, never a dependency of ntkgp).

Python puts the script's folder first on ``sys.path``, so the examples import this module as ``_uncertainty``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from _common import format_table
from ntkgp.metrics import accuracy, categorical_nlpd, expected_calibration_error, ood_auroc, predictive_entropy

HEADERS = ["method", "NLL", "accuracy", "ECE", "OOD AUROC", "seconds"]


def train_map(net: nn.Module, x: Tensor, y: Tensor, delta: float, epochs: int, seed: int, lr: float = 1e-3,
              batch_size: int = 128, min_batch: int = 2) -> float:
    """Adam on the mean negative log joint (cross-entropy plus :math:`\\delta \\|\\theta\\|^2 / 2N`), the network
    in training mode (BatchNorm on batch statistics), left in eval mode; batches smaller than ``min_batch`` are
    skipped (BatchNorm needs two examples in training mode); returns the seconds."""
    start = time.perf_counter()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    n = len(y)
    net.train()
    for _ in range(epochs):
        for idx in torch.randperm(n, generator=g).split(batch_size):
            if len(idx) < min_batch:
                continue
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            prior = 0.5 * delta * sum(p.square().sum() for p in net.parameters()) / n
            (loss + prior).backward()
            opt.step()
    net.eval()
    return time.perf_counter() - start


class Report:
    """Rows of :data:`HEADERS` for the test inputs ``x_te, y_te`` and the out-of-distribution inputs ``x_ood``
    (OOD AUROC: telling them apart by predictive entropy); ``entropies`` keeps both entropies per method."""

    def __init__(self, x_te: Tensor, y_te: Tensor, x_ood: Tensor | None, chunk: int = 250) -> None:
        self.x_te, self.y_te, self.x_ood, self.chunk = x_te, y_te, x_ood, chunk
        self.rows: list[list[object]] = []
        self.entropies: dict[str, tuple[Tensor, Tensor | None]] = {}

    def _probs(self, probs_fn: Callable[[Tensor], Tensor], x: Tensor, no_grad: bool) -> Tensor:
        with torch.set_grad_enabled(not no_grad):
            return torch.cat([probs_fn(chunk).detach() for chunk in x.split(self.chunk)]).double()

    def add(self, name: str, probs_fn: Callable[[Tensor], Tensor], seconds: float, no_grad: bool = True) -> None:
        """Predict the test and OOD inputs with ``probs_fn`` (class probabilities ``(n, C)``) and add a row; the
        seconds of predicting are added to ``seconds``."""
        start = time.perf_counter()
        probs = self._probs(probs_fn, self.x_te, no_grad)
        ood = self._probs(probs_fn, self.x_ood, no_grad) if self.x_ood is not None else None
        seconds += time.perf_counter() - start
        h_in = predictive_entropy(probs)
        h_out = predictive_entropy(ood) if ood is not None else None
        self.entropies[name] = (h_in, h_out)
        self.rows.append([name, categorical_nlpd(probs, self.y_te), accuracy(probs, self.y_te),
                          expected_calibration_error(probs, self.y_te),
                          None if h_out is None else ood_auroc(h_in, h_out), f"{seconds:.1f}"])

    def table(self) -> str:
        return format_table(HEADERS, self.rows)


def laplace_torch_rows(report: Report, net: nn.Module, x: Tensor, y: Tensor, batch_size: int = 64,
                       subsets: tuple[str, ...] = ("all", "last_layer")) -> list[str]:
    """laplace-torch's ``Laplace(net, "classification", subset_of_weights=subset, hessian_structure="kron")`` on
    a copy of ``net``, fitted on ``(x, y)``, prior precision by its evidence (``method="marglik"``), GLM probit
    predictive; a row of ``report`` per subset it fits, and a line per subset it refuses (or a line saying it is
    not installed). Returns the lines."""
    try:
        from laplace import Laplace
    except ImportError:
        return ["laplace-torch: not installed (optional; `pip install laplace-torch` for its columns)"]
    from torch.utils.data import DataLoader, TensorDataset

    notes = []
    for subset in subsets:
        name = f"laplace-torch {subset} kron"
        start = time.perf_counter()
        try:
            la = Laplace(copy.deepcopy(net).eval(), "classification", subset_of_weights=subset,
                         hessian_structure="kron")
            la.fit(DataLoader(TensorDataset(x, y), batch_size=batch_size))
            la.optimize_prior_precision(method="marglik")
            report.add(name, lambda xb: la(xb, pred_type="glm", link_approx="probit"),
                       time.perf_counter() - start, no_grad=False)
        except Exception as error:  # noqa: BLE001 — what laplace-torch refuses is the point of the line
            message = " ".join(str(error).split())
            notes.append(f"{name}: refused after {time.perf_counter() - start:.1f} s — "
                         f"{type(error).__name__}: {message[:300]}")
    return notes


def plot_entropies(entropies: dict, num_classes: int, in_label: str, path: Path) -> None:
    """Histograms of the predictive entropy in and out of distribution, one panel per method, written to
    ``path`` (skipped when matplotlib is not installed); prints a line naming the figure."""
    try:
        import matplotlib
    except ImportError:
        print("figure: skipped (matplotlib is not installed)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(entropies), figsize=(3.0 * len(entropies), 2.8), sharey=True, squeeze=False)
    bins = torch.linspace(0, math.log(num_classes), 31).numpy()
    for ax, (name, (h_in, h_out)) in zip(axes[0], entropies.items()):
        ax.hist(h_in.numpy(), bins=bins, alpha=0.6, density=True, label=in_label)
        if h_out is not None:
            ax.hist(h_out.numpy(), bins=bins, alpha=0.6, density=True, label="OOD")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("predictive entropy (nats)")
    axes[0][0].set_ylabel("density")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
