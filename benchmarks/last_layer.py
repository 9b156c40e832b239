r"""Last-layer Laplace fit time: ntkgp (full GGN, KFAC, diagonal GGN, from the layer's features) against
laplace-torch's ``Laplace(..., subset_of_weights="last_layer")`` (``"full"``, ``"kron"``, ``"diag"``), side by side
in one run, one interpreter, on a LeNet-5 trained briefly on Fashion-MNIST.

The network: LeNet-5 (conv 6 and conv 16, 5×5, ReLU and 2×2 max-pool after each, FC 120, FC 84, FC 10; float32), trained
for ``--epochs`` epochs of Adam on the first ``--train-n`` training images (not timed; cached in ``--cache``, a temporary
folder by default). The last layer has :math:`P = 10 \cdot 85 = 850` parameters. Each row fits both libraries' posterior on the
first ``--n`` training images (default 10,000) in batches of ``--batch-size``, CPU time of the process, the smaller
of ``--repeats`` alternating runs per side (after one untimed warm-up fit of each on 256 images: imports, first
backward passes); the fit includes the pass over the data and nothing else (neither library factorizes its
precision in the fit), beside the bound of a fit from features: one forward pass over the same images in the same
batches, without a graph. The last column compares :math:`\log|H + \delta I|` of both libraries at :math:`\delta = 1`
(relative difference): the same curvature, each in its own parameter order.

Run it in an interpreter where laplace-torch and ntkgp are both importable (one torch build for both sides)::

    python3 -m venv LT && LT/bin/pip install laplace-torch && LT/bin/pip install -e .
    LAPLACE_PYTHON benchmarks/last_layer.py --data-dir DATA [--write-docs]     # LAPLACE_PYTHON = LT/bin/python

Without laplace-torch the laplace-torch columns say so. ``--write-docs`` writes the table into docs/predictive.md
(generated region ``last-layer-fit``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ntkgp
from ntkgp._doctable import command_line, markdown_table, write_block
from ntkgp.likelihoods import SoftmaxLikelihood
from ntkgp.laplace import PassOptions

#: ntkgp's structure → laplace-torch's hessian_structure, per row.
ROWS = [("full_ggn", "full"), ("kfac", "kron"), ("diag_ggn", "diag")]


def lenet5() -> nn.Module:
    """LeNet-5 for 28 × 28 images (the first convolution padded to keep 28 × 28)."""
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )


def trained(args, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """The LeNet-5, trained for ``args.epochs`` epochs (or loaded from ``args.cache``)."""
    path = Path(args.cache) / f"lenet5_n{args.train_n}_e{args.epochs}.pt"
    x, y = x[: args.train_n], y[: args.train_n]
    torch.manual_seed(0)
    net = lenet5()
    if path.exists():
        net.load_state_dict(torch.load(path))
        return net.eval()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for epoch in range(args.epochs):
        perm = torch.randperm(x.shape[0])
        for idx in perm.split(128):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
        print(f"epoch {epoch + 1}: loss {nn.functional.cross_entropy(net(x[:2000]), y[:2000]).item():.3f}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), path)
    return net.eval()


def cpu_time(fit) -> tuple[float, object]:
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        out = fit()
        return time.process_time() - start, out
    finally:
        gc.enable()


def forward_pass(net, x, y, batch_size: int) -> None:
    """The bound of a fit from features: one forward pass over the data in batches, without a graph."""
    with torch.no_grad():
        for xb in x.split(batch_size):
            net(xb)


def ntkgp_fit(net, x, y, structure: str, batch_size: int):
    return ntkgp.laplace.laplace_posterior(net, x, y, SoftmaxLikelihood(10), structure=structure,
                                          subset="last_layer", prior_precision=1.0, options=PassOptions(batch_size=batch_size))


def laplace_torch_fit(net, x, y, structure: str, batch_size: int):
    from laplace import Laplace

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    la = Laplace(net, "classification", subset_of_weights="last_layer", hessian_structure=structure,
                 prior_precision=1.0)
    la.fit(loader)
    return la


def have_laplace_torch() -> str | None:
    try:
        import laplace  # noqa: F401
    except ImportError:
        return None
    from importlib.metadata import version

    return version("laplace-torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-n", type=int, default=20_000, help="training images of the (untimed) MAP fit")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "ntkgp-lenet5"))
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    x_train, y_train, x_test, y_test = ntkgp.datasets.load_fashion_mnist(args.data_dir)
    net = trained(args, x_train, y_train)
    with torch.no_grad():
        accuracy = (net(x_test).argmax(-1) == y_test).float().mean().item()
    print(f"LeNet-5 test accuracy {accuracy:.3f}", flush=True)
    x, y = x_train[: args.n], y_train[: args.n]
    version = have_laplace_torch()
    rows = []
    for ours, theirs in ROWS:
        ntkgp_fit(net, x[:256], y[:256], ours, args.batch_size)  # warm-up
        if version:
            laplace_torch_fit(copy.deepcopy(net), x[:256], y[:256], theirs, args.batch_size)
        times_ours, times_theirs, times_forward = [], [], []
        for _ in range(args.repeats):
            times_forward.append(cpu_time(lambda: forward_pass(net, x, y, args.batch_size))[0])
            t, post = cpu_time(lambda: ntkgp_fit(net, x, y, ours, args.batch_size))
            times_ours.append(t)
            if version:
                copied = copy.deepcopy(net)
                t, la = cpu_time(lambda: laplace_torch_fit(copied, x, y, theirs, args.batch_size))
                times_theirs.append(t)
        row = {"structure": ours, "theirs": theirs, "ntkgp": min(times_ours), "forward": min(times_forward)}
        if version:
            mine = post.log_det_precision().item()
            other = la.log_det_posterior_precision.item()
            row |= {"laplace_torch": min(times_theirs), "log_det": (mine, other)}
        rows.append(row)
        print(row, flush=True)
    if args.write_docs:
        write_docs(rows, args, version, accuracy)


def write_docs(rows, args, version: str | None, accuracy: float) -> None:
    header = ["ntkgp structure", "ntkgp fit s", "bound: forward pass s", f"laplace-torch {version or '(not installed)'}",
              "fit s", "ratio ntkgp / laplace-torch", "log det rel. diff"]
    table = []
    for row in rows:
        if "laplace_torch" in row:
            mine, other = row["log_det"]
            table.append([row["structure"], f"{row['ntkgp']:.3g}", f"{row['forward']:.3g}", f"\"{row['theirs']}\"",
                          f"{row['laplace_torch']:.3g}", f"{row['ntkgp'] / row['laplace_torch']:.2f}",
                          f"{abs(mine - other) / abs(other):.1e}"])
        else:
            table.append([row["structure"], f"{row['ntkgp']:.3g}", f"{row['forward']:.3g}", f"\"{row['theirs']}\"",
                          "—", "—", "—"])
    text = markdown_table(header, table)
    text += (f"\n\nLeNet-5 ({args.epochs} epochs of Adam on {args.train_n:,} images, test accuracy {accuracy:.3f}), "
             f"the last layer (P = 850) on "
             f"{args.n:,} Fashion-MNIST images in batches of {args.batch_size}; CPU time of the process, "
             f"{torch.get_num_threads()} thread(s), the smaller of {args.repeats} alternating fits per side, both in "
             "one interpreter on one torch build.")
    write_block("docs/predictive.md", "last-layer-fit", text, command_line({"--cache": "CACHE"}))


if __name__ == "__main__":
    main()
