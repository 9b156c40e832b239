r"""The training data of :func:`~ntkgp.training.train_marglik`, checked in full before training, and the
mini-batches of every epoch.

Two forms: tensors ``(N, ...)`` (validated by building an :class:`~ntkgp.NTKGP`: every row, the network's
outputs, the targets; a seeded shuffle per epoch), or a re-iterable loader of ``(x, y)`` batches (a
``torch.utils.data.DataLoader``: its own batches and shuffling; read once to check every batch). Both bring
the batches to the network's device and dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ..distributed import all_gather_rows, all_reduce_max, all_reduce_sum, rank, together
from ..kernels import NTKKernel
from ..likelihoods import is_gaussian, num_outputs, validate_targets
from ..models import NTKGP
from ..ntk.inputs import is_structured
from ..ntk.packed_inputs import structure_batches, structure_network
from ..progress import progress_bar
from .arguments import MarglikOptions

__all__ = ["LoaderData", "TensorData", "structured_data", "training_data"]

Batch = tuple[Tensor, Tensor]


def structured_data(net: nn.Module, train_x: object, train_y: object) -> tuple[nn.Module, object]:
    """Structured inputs (a dict or tuple of tensors with ``train_y``, or a loader of such batches): the view of
    ``net`` that takes their packed rows, and the data packed (:mod:`ntkgp.ntk.packed_inputs`); the MAP steps, the
    curvature and the returned ``net`` and ``kernel`` all take the view (which takes the structure itself too).
    Other data: ``(net, train_x)`` unchanged. Checked (every leaf, a common leading dimension) before any side
    effect; a loader's first batch is read without moving its random state."""
    if train_y is not None and is_structured(train_x):
        return structure_network(net, train_x, "train_x")
    if train_y is None and not torch.is_tensor(train_x):
        return structure_batches(net, train_x, "train_x")
    return net, train_x


def training_data(net: nn.Module, train_x: object, train_y: object, likelihood: Likelihood, prior_precision: object,
                  options: MarglikOptions) -> TensorData | LoaderData:
    """Check the data (and the network and likelihood against them) and build the kernel: no side effect."""
    with together("checking the training data", options.distributed):
        if torch.is_tensor(train_x):
            return TensorData(net, train_x, train_y, likelihood, prior_precision, options)
        return LoaderData(net, train_x, likelihood, prior_precision, options)


def _merge(a: tuple[float, Tensor, Tensor], b: tuple[float, Tensor, Tensor]) -> tuple[float, Tensor, Tensor]:
    """Count, mean and sum of squared deviations of two sets of rows together (Chan et al.'s pairwise update:
    no sum of squares minus a squared sum)."""
    (n_a, mean_a, m2_a), (n_b, mean_b, m2_b) = a, b
    total = n_a + n_b
    delta = mean_b - mean_a
    return total, mean_a + delta * (n_b / total), m2_a + m2_b + delta.square() * (n_a * n_b / total)


def _moments(y: Tensor) -> tuple[float, Tensor, Tensor]:
    rows = y.detach().to(torch.float64).reshape(y.shape[0], -1)
    mean = rows.mean(0)
    return float(rows.shape[0]), mean, (rows - mean).square().sum(0)


def _mean_variance(moments: tuple[float, Tensor, Tensor], distributed: bool) -> float:
    """The mean over outputs of the targets' population variance, the moments of every rank merged; floored
    at 1e-12 (1 for a single example)."""
    count, mean, m2 = moments
    c = mean.numel()
    stats = all_gather_rows(torch.cat([torch.tensor([count], dtype=torch.float64, device=mean.device), mean, m2])[None],
                            distributed)
    merged = (float(stats[0, 0]), stats[0, 1 : 1 + c], stats[0, 1 + c :])
    for row in stats[1:]:
        merged = _merge(merged, (float(row[0]), row[1 : 1 + c], row[1 + c :]))
    n_all, _, m2_all = merged
    return max(float((m2_all / n_all).mean()) if n_all > 1 else 1.0, 1e-12)


class TensorData:
    """Tensor data, validated as :class:`~ntkgp.NTKGP` validates them; a seeded shuffle per epoch.

    Attributes:
        kernel: the :class:`~ntkgp.NTKKernel` holding the prior precisions that are learned.
        x, y: the inputs (the network's shape, dtype and device) and targets (validated).
        y_curvature: the targets in the likelihood's normal form, for the curvature of every round.
        n_local, n: the number of examples here, and on all ranks together.
        steps: MAP steps per epoch (the same on every rank).
        target_variance: the mean variance of the targets (Gaussian likelihoods; else 1).
    """

    def __init__(self, net: nn.Module, train_x: Tensor, train_y: object, likelihood: Likelihood,
                 prior_precision: object, options: MarglikOptions) -> None:
        # Builds the kernel and checks every row of train_x, the outputs and the targets: no side effect on net.
        model = NTKGP(net, train_x, train_y, likelihood, prior_precision=prior_precision,
                      prior_structure=options.prior_structure, chunk_size=options.curvature_batch_size)
        # only the kernel is kept (in training mode, as built); the user's likelihood keeps its own mode
        self.kernel = model.covar_module
        self.distributed = options.distributed
        engine = self.kernel.engine
        # detached: Algorithm 1 differentiates with respect to θ and the hyperparameters only, never the inputs
        # (a graph to a train_x that requires grad would be freed by the first backward); the user's tensors keep
        # their flags (detach makes a view)
        self.x = engine.prepare(model.train_x, "train_x").detach()
        self.y = model.train_y.detach()
        self.y_curvature = validate_targets(likelihood, self.y, engine.num_outputs(self.x), num_data=self.x.shape[0])
        self.n_local = self.x.shape[0]
        self.n = int(all_reduce_sum(torch.tensor([self.n_local], device=engine.device), self.distributed).item())
        self.batch = self.n_local if options.batch_size is None else min(options.batch_size, self.n_local)
        self.steps = all_reduce_max(-(-self.n_local // self.batch), self.distributed)
        self.full_batch = self.batch >= self.n_local
        self.target_variance = 1.0
        if is_gaussian(likelihood):
            y_all = all_gather_rows(self.y.to(self.x.dtype), self.distributed)  # one dtype on every rank
            self.target_variance = max(float(y_all.var(dim=0, unbiased=False).mean()) if self.n > 1 else 1.0, 1e-12)

    def batches(self, generator: torch.Generator) -> Iterator[Batch | None]:
        """One epoch's MAP batches (``None``: a distributed step in which this rank has no batch left)."""
        if self.full_batch and not self.distributed:
            yield self.x, self.y  # no shuffle, no copy
            return
        order = torch.randperm(self.n_local, generator=generator).to(self.x.device)
        for step in range(self.steps):
            idx = order[step * self.batch : (step + 1) * self.batch]
            yield (self.x[idx], self.y[idx]) if len(idx) else None

    def curvature_data(self, stream: bool) -> tuple[Tensor, Tensor]:
        """The data of a round's curvature: ``(x, y)`` tensors, whether or not it can take a stream of batches."""
        return self.x, self.y_curvature


class LoaderData:
    """A re-iterable loader of ``(x, y)`` batches (a ``DataLoader``), read once to check every batch.

    Attributes: as :class:`TensorData` (no ``x``, ``y``); ``steps`` is the number of batches of the check pass.

    The check pass follows ``options.progress`` (``"marglik training data"``, batches: :mod:`ntkgp.progress`; its
    estimate needs the loader's ``len``).
    """

    def __init__(self, net: nn.Module, loader: Iterable, likelihood: Likelihood, prior_precision: object,
                 options: MarglikOptions) -> None:
        if not isinstance(likelihood, Likelihood):
            raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
        expected = num_outputs(likelihood)  # raises for unsupported likelihoods
        self.loader, self.likelihood, self.distributed = loader, likelihood, options.distributed
        self.kernel: NTKKernel | None = None
        count, steps, moments = 0, 0, None
        progress = options.progress if rank() == 0 else False  # one rank reports, as for the epochs
        for pair in progress_bar(loader, None, "marglik training data", progress, unit="batch"):
            x, y = self._unpack(pair)
            if self.kernel is None:
                self.kernel = self._kernel(net, x, likelihood, prior_precision, options, expected)
            x, y = self.prepare(x, y)
            steps += 1
            count += x.shape[0]
            if is_gaussian(likelihood):  # the targets' moments, merged batch by batch
                moments = _moments(y) if moments is None else _merge(moments, _moments(y))
        if self.kernel is None:
            raise ValueError("train_x is an empty loader: no batch was seen")
        engine = self.kernel.engine
        self.n_local = count
        self.n = int(all_reduce_sum(torch.tensor([count], device=engine.device), self.distributed).item())
        self.steps = all_reduce_max(steps, self.distributed)
        self.target_variance = _mean_variance(moments, self.distributed) if is_gaussian(likelihood) else 1.0

    @staticmethod
    def _unpack(pair: object) -> tuple[object, object]:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(
                "train_x must be a tensor or a loader of (x, y) batches; a batch of "
                f"{len(pair) if isinstance(pair, (tuple, list)) else type(pair).__name__} was found "
                "(a DataLoader over a dataset of inputs only has no targets)"
            )
        return pair[0], pair[1]

    @staticmethod
    def _kernel(net: nn.Module, x: object, likelihood: Likelihood, prior_precision: object,
                options: MarglikOptions, expected: int) -> NTKKernel:
        """The kernel, from the first batch: its shape gives the network's input shape (images ``(B, C, H, W)``)."""
        if not torch.is_tensor(x):
            raise TypeError(f"train_x must give batches of tensors, got {type(x).__name__}")
        input_shape = tuple(x.shape[1:]) if x.dim() > 2 else None
        kernel = NTKKernel(net, prior_precision=prior_precision, prior_structure=options.prior_structure,
                           input_shape=input_shape, chunk_size=options.curvature_batch_size)
        outputs = kernel.engine.outputs(x[:1], "train_x").shape[1]  # the network's outputs, checked as finite
        if outputs != expected:
            raise ValueError(f"net has {outputs} outputs but the likelihood {type(likelihood).__name__} expects "
                             f"{expected}")
        return kernel

    def prepare(self, x: object, y: object) -> Batch:
        """A batch checked (every row, the targets) in the network's shape, dtype and device."""
        engine = self.kernel.engine
        x = engine.prepare(x, "train_x").detach()  # as TensorData: no graph to the inputs
        y = validate_targets(self.likelihood, y, engine.num_outputs(x), num_data=x.shape[0], name="train_y")
        return x, y.detach().to(device=x.device)

    def batches(self, generator: torch.Generator) -> Iterator[Batch | None]:
        """One epoch's MAP batches, the loader's; with ``distributed`` every rank takes as many steps as the
        rank with the most batches (``None``: this rank has none left)."""
        if not self.distributed:
            for pair in self.loader:
                yield self.prepare(*self._unpack(pair))
            return
        pairs = iter(self.loader)
        while True:
            pair = next(pairs, None)
            if all_reduce_max(int(pair is not None)) == 0:
                return
            yield None if pair is None else self.prepare(*self._unpack(pair))

    def curvature_data(self, stream: bool) -> tuple[Iterable | Tensor, Tensor | None]:
        """The data of a round's curvature: the loader itself (``y=None``) for a curvature that streams the
        batches, else all batches gathered into ``(x, y)`` tensors (the function-space Grams couple every pair)."""
        if stream:
            return self.loader, None
        pairs = [self.prepare(*self._unpack(pair)) for pair in self.loader]
        return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
