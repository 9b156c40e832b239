r"""``train_fsvi``: function-space variational inference for a whole network, in one call."""

from __future__ import annotations

import copy
import math
import numbers
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from gpytorch.likelihoods import Likelihood
from torch import Tensor, nn

from ..likelihoods import num_outputs, validate_targets
from ..option_groups import accepts_flat_keywords, check_group
from ..options import ContextKind, choose
from ..progress import Progress, check_progress, progress_bar
from ..validation import positive_int, real_number
from . import context as contexts
from .inputs import structured_training
from .model import FSVI
from .objective import FunctionSpaceELBO
from .training_options import FSVIOptimization, FSVIOptions

Batches = Iterable[tuple[Tensor, Tensor]]


@dataclass
class FSVIResult:
    """What :func:`train_fsvi` returns.

    Attributes:
        model: the trained :class:`~ntkgp.fsvi.FSVI` model (in eval mode), carrying a copy of the likelihood.
        history: one dict per epoch: ``epoch``, ``elbo`` (the objective divided by N, mean over the epoch's
            steps), ``expected_log_likelihood`` and ``kl`` (totals, means over steps), ``seconds`` (cumulative).
        seconds: the training time.
    """

    model: FSVI
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def _loader_inputs(batches: Batches, max_values: int) -> Tensor:
    """Inputs of the first batches of ``batches``, until ``max_values`` numbers per input feature are collected."""
    xs, count = [], 0
    for x, _ in batches:
        xs.append(x)
        count += x.shape[0]
        if count * max(1, math.prod(x.shape[2:])) >= max_values:
            break
    return torch.cat(xs)


def _build_context(
    context: object, batches: Batches, x_first: Tensor, input_shape: tuple[int, ...] | None, generator: torch.Generator,
    progress: bool | None = False,
) -> contexts.ContextDistribution:
    """The context distribution ``context`` asks for; ``"uniform"`` reads every batch for the box's bounds, with the
    progress ``progress`` asks (``"FSVI context bounds"``, batches: :mod:`ntkgp.progress`)."""
    if isinstance(context, contexts.ContextDistribution):
        return context
    if isinstance(context, Tensor):
        return contexts.DatasetContext(context)
    if callable(context) and not isinstance(context, str):
        return contexts.SamplerContext(context)
    if not isinstance(context, str):
        raise TypeError(
            "context must be 'auto', 'uniform', 'monochrome', a ContextDistribution, a tensor of inputs or a "
            f"callable sampler, got {type(context).__name__}"
        )
    kind = choose(ContextKind, context, "context")
    image_shape = input_shape if input_shape is not None and len(input_shape) >= 2 else None
    if not x_first.is_floating_point():  # token ids: context points are rows of the data, never real-valued draws
        if kind is not ContextKind.AUTO:
            raise ValueError(f"context={context!r} draws real-valued inputs, but train_x holds {x_first.dtype} "
                             "values (token ids, or the packed rows of a dict): use context='auto' (random training "
                             "inputs), inputs or a sampler")
        return contexts.DatasetContext(_loader_inputs(batches, 2**20))
    if kind is ContextKind.AUTO:
        kind = ContextKind.MONOCHROME if image_shape is not None else ContextKind.UNIFORM
    if kind is ContextKind.MONOCHROME:
        if image_shape is None:
            raise ValueError(
                "context='monochrome' needs image inputs (N, channels, H, W) or input_shape=(channels, H, W)"
            )
        return contexts.MonochromeContext.from_data(_loader_inputs(batches, 2**20), image_shape, generator=generator)
    lower, upper = x_first.min(0).values, x_first.max(0).values
    for x, _ in progress_bar(batches, None, "FSVI context bounds", progress, unit="batch"):
        lower, upper = torch.minimum(lower, x.min(0).values), torch.maximum(upper, x.max(0).values)
    return contexts.UniformBoxContext(lower, upper)


class _TensorBatches:
    """Shuffled mini-batches of tensors, reshuffled at every pass by a seeded generator."""

    def __init__(self, x: Tensor, y: Tensor, batch_size: int | None, generator: torch.Generator) -> None:
        self.x, self.y, self.generator = x, y, generator
        self.batch_size = x.shape[0] if batch_size is None else min(batch_size, x.shape[0])

    def __iter__(self):
        order = torch.randperm(self.x.shape[0], generator=self.generator).to(self.x.device)
        for s in range(0, self.x.shape[0], self.batch_size):
            idx = order[s : s + self.batch_size]
            yield self.x[idx], self.y[idx]


@accepts_flat_keywords(options=FSVIOptions, optimization=FSVIOptimization)
def train_fsvi(
    net: nn.Module,
    train_x: Tensor | Batches,
    train_y: Tensor | None,
    likelihood: Likelihood,
    *,
    context: str | contexts.ContextDistribution | Tensor | Callable = "auto",
    num_context: int = 32,
    prior_precision: float | Tensor = 1.0,
    prior_structure: str | Mapping[str, str] = "layer",
    epochs: int = 100,
    batch_size: int | None = 128,
    num_data: int | None = None,
    lr: float = 1e-3,
    options: FSVIOptions | None = None,
    optimization: FSVIOptimization | None = None,
    progress: bool | None = None,
) -> FSVIResult:
    r"""Fit a mean-field Gaussian over all the weights of ``net`` by function-space variational inference.

    Maximizes :class:`~ntkgp.fsvi.FunctionSpaceELBO` with ``optimization.optimizer`` over :math:`\mu` and the raw
    :math:`s` (and the likelihood's noise or temperature with ``learn_likelihood=True``):

    .. math::
        \mathcal L(\mu, s) = \frac{N}{B} \sum_{b} \frac1S \sum_s \log p(y_b \mid f(x_b; \mu + s \odot \epsilon_s))
            - \mathrm{KL}\big(q(f_{X_C}) \,\|\, p(f_{X_C})\big),

    with ``K = num_context`` context points :math:`X_C` drawn afresh at every step (docs/fsvi.md). The network is
    not modified: :math:`\mu` starts at a copy of its weights (usually a freshly initialized network; a
    pre-trained one also works), and the likelihood is copied.

    Args:
        net: any ``nn.Module`` ``(N, *input_shape) → (N, C)``: linear layers take the structured route,
            convolutions and BatchNorm (eval mode) the Jacobian route.
        train_x: inputs ``(N, ...)`` or a dict/tuple of tensors (docs/networks.md, "Dict and tuple inputs in the
            GPyTorch models"), or an iterable of ``(x, y)`` mini-batches (a ``DataLoader``) with ``train_y=None``.
        train_y: targets (see :func:`ntkgp.likelihoods.validate_targets`), or ``None`` with a loader.
        likelihood: a supported likelihood (its number of outputs must match the network's).
        context: ``"auto"`` (``"monochrome"`` for image inputs, random training inputs for integer inputs such as
            token ids, else ``"uniform"``), ``"uniform"`` (the box of
            the training inputs), ``"monochrome"``, a :class:`~ntkgp.fsvi.ContextDistribution`, a tensor of inputs
            (a :class:`~ntkgp.fsvi.DatasetContext`) or a callable ``(K, generator) -> (K, ...)``.
        num_context: ``K``, context points per step.
        prior_precision: :math:`\delta`, float or one per group; :math:`s_0^2 = 1/\delta_g`.
        prior_structure: ``"network"``, ``"layer"`` (default), ``"parameter"`` or a mapping.
        epochs: passes over the data.
        batch_size: mini-batch size for tensors (``None``: full batch); ignored for loaders.
        num_data: ``N`` for a loader (default ``len(loader.dataset)``, else counted in one pass).
        lr: the optimizer's step size.
        options: the model's other options, an :class:`~ntkgp.fsvi.FSVIOptions` (``prior_mean``,
            ``prior_linearization``, ``init_std``, ``context_jitter``, ``kl_covariance``, ``input_shape``,
            ``strategy``, ``output``; ``None``: its defaults). Its fields as flat keywords
            (``kl_covariance="diagonal"``) still work, with a ``FutureWarning``, for one release.
        optimization: an :class:`~ntkgp.fsvi.FSVIOptimization` (``optimizer``, ``num_samples``,
            ``context_batch_fraction``, ``learn_likelihood``, ``seed``; ``None``: its defaults); its fields as flat
            keywords likewise.
        progress: over the epochs: ``None`` (auto: a bar on a terminal, else one line with a long training's
            estimated time), ``True`` (a bar) or ``False`` (silent): :mod:`ntkgp.progress`; a loader's reads before
            training too (``"FSVI context bounds"`` for ``context="uniform"``, ``"FSVI counting train_x"`` without
            ``num_data`` or a ``dataset``).

    Returns:
        :class:`FSVIResult` with the trained model and the per-epoch history.

    Raises:
        ValueError / TypeError: naming the argument, before anything is computed.
        KeyboardInterrupt: propagated as raised; the network, the likelihood and the tensors passed in (with
            their ``.grad``) are as before the call (the model trained so far is lost).

    Example:
        >>> reg_net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        >>> y_reg = torch.sin(x.sum(-1))
        >>> result = train_fsvi(reg_net, x, y_reg, GaussianLikelihood(), prior_precision=1.0, epochs=20, lr=1e-2,
        ...                     progress=False)
        >>> dist = result.model.predict(x_test, method="linearized")      # N(mean, var) over y
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if not isinstance(likelihood, Likelihood):
        raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
    expected = num_outputs(likelihood)
    options = check_group(options, FSVIOptions, "options")
    optimization = check_group(optimization, FSVIOptimization, "optimization")
    input_shape, output = options.input_shape, options.output
    optimizer, seed = optimization.optimizer, optimization.seed
    num_samples, learn_likelihood = optimization.num_samples, optimization.learn_likelihood
    context_batch_fraction = optimization.context_batch_fraction
    num_context = positive_int(num_context, "num_context")
    num_samples = positive_int(num_samples, "num_samples")
    epochs = positive_int(epochs, "epochs")
    batch_size = positive_int(batch_size, "batch_size", allow_none=True)
    num_data = positive_int(num_data, "num_data", allow_none=True)
    context_batch_fraction = real_number(context_batch_fraction, "context_batch_fraction", 0.0, 1.0, high_open=False)
    lr = real_number(lr, "lr", low_open=True)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    seed = int(seed)
    check_progress(progress)
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer class (a callable), got {optimizer!r}")
    # the model first: it checks its own options before a loader is read (reading one can draw from the global
    # random generator); the input shape, if it comes from the first batch, is set afterwards
    model = FSVI(
        net,
        copy.deepcopy(likelihood),
        prior_precision=prior_precision,
        prior_structure=prior_structure,
        prior_mean=options.prior_mean,
        prior_linearization=options.prior_linearization,
        init_std=options.init_std,
        context_jitter=options.context_jitter,
        kl_covariance=options.kl_covariance,
        input_shape=input_shape,
        strategy=options.strategy,
        output=output,
    )
    # dict/tuple inputs: packed rows and the view of the network that rebuilds them (ntkgp.ntk.packed_inputs);
    # after the model's own checks (reading a loader's first batch is a side effect)
    view, train_x, context = structured_training(model.net, train_x, train_y, context)
    if view is not model.net:
        model._use_network(view)

    generator = torch.Generator().manual_seed(seed)
    if isinstance(train_x, Tensor):
        if train_y is None:
            raise ValueError("train_y must be given when train_x is a tensor")
        if train_x.dim() < 2 or train_x.shape[0] == 0:
            raise ValueError(f"train_x must have shape (N, ...) with a feature dimension, got {tuple(train_x.shape)}")
        if train_x.is_floating_point() and not bool(torch.isfinite(train_x).all()):
            raise ValueError("train_x contains NaN or Inf values")
        y = validate_targets(likelihood, train_y, expected, num_data=train_x.shape[0], name="train_y")
        batches: Batches = _TensorBatches(train_x, y, batch_size, generator)
        num_data = train_x.shape[0]
        x_first = train_x
    else:
        if train_y is not None:
            raise TypeError(
                f"train_x must be a torch.Tensor when train_y is given (or a loader of (x, y) batches with "
                f"train_y=None), got {type(train_x).__name__}"
            )
        if isinstance(train_x, (str, bytes)) or not isinstance(train_x, Iterable):
            raise TypeError(f"train_x must be a tensor or an iterable of (x, y) batches, got {type(train_x).__name__}")
        if isinstance(train_x, Iterator):  # read once by the setup, it would leave no batch to train on
            raise TypeError(
                f"train_x must be re-iterable (a DataLoader, a list of (x, y) batches), got the one-shot "
                f"{type(train_x).__name__}: it is read once per epoch"
            )
        batches = train_x
        first = next(iter(batches), None)
        if first is None:
            raise ValueError("train_x yields no batches")
        if not (isinstance(first, (tuple, list)) and len(first) == 2 and all(isinstance(t, Tensor) for t in first)):
            kind = (f"a {type(first).__name__} of {', '.join(type(t).__name__ for t in first)}"
                    if isinstance(first, (tuple, list)) else f"a {type(first).__name__}")
            raise TypeError(f"train_x must give (x, y) batches of two tensors, its first batch is {kind}")
        x_first = first[0]
        if num_data is None:
            dataset = getattr(train_x, "dataset", None)
            counting = progress_bar(batches, None, "FSVI counting train_x", progress, unit="batch")
            num_data = len(dataset) if dataset is not None else sum(int(x.shape[0]) for x, _ in counting)
    if input_shape is None and x_first.dim() > 2:
        input_shape = tuple(x_first.shape[1:])
        model.linearized.input_shape = input_shape
    reference = model.variational_distribution.mean[0]
    model.likelihood.to(device=reference.device, dtype=reference.dtype)
    c = model._fits(model.prepare(x_first[:1], "train_x"), "train_x")
    if c != expected:
        raise ValueError(f"net has {c} outputs but the likelihood {type(likelihood).__name__} expects {expected}")
    data = [(train_x, None)] if isinstance(train_x, Tensor) else batches
    sampler = _build_context(context, data, x_first, input_shape, generator,
                             False if isinstance(train_x, Tensor) else progress)  # a tensor: one step, no pass
    if context_batch_fraction > 0:
        sampler = contexts.BatchMixedContext(sampler, context_batch_fraction)
    # one context point must fit the network too, drawn from a copy of the generator and with the global random
    # state restored afterwards (for a sampler that ignores the generator): training's draws are unchanged
    probe = torch.Generator().set_state(generator.get_state())
    with torch.random.fork_rng(devices=[]):
        point = sampler.sample(1, probe, batch_x=x_first[:1])
    model._fits(model.prepare(point, "context"), "context", c)

    elbo = FunctionSpaceELBO(model, num_data, num_samples)
    params = list(model.variational_distribution.parameters())
    if learn_likelihood:
        params += [p for p in model.likelihood.parameters() if p.requires_grad]
    opt = optimizer(params, lr=lr)
    noise = torch.Generator(device=reference.device).manual_seed(seed + 1)
    model.train()
    history: list[dict] = []
    start = time.perf_counter()
    with Progress(epochs, "FSVI", progress, unit="epoch") as bar:
        for epoch in range(epochs):
            sums, steps = [0.0, 0.0, 0.0], 0
            for x, y in batches:
                # detached: the backward pass reaches μ, s (and the likelihood's copy), never the user's tensors
                x, y = (t.detach() if isinstance(t, Tensor) else t for t in (x, y))
                x_context = sampler.sample(num_context, generator, batch_x=x).detach()
                opt.zero_grad(set_to_none=True)
                terms = elbo(x, y, x_context, generator=noise)
                (-terms.value).backward()
                opt.step()
                for i, t in enumerate(terms):
                    sums[i] += t.item()
                steps += 1
            history.append({
                "epoch": epoch + 1,
                "elbo": sums[0] / steps,
                "expected_log_likelihood": sums[1] / steps,
                "kl": sums[2] / steps,
                "seconds": time.perf_counter() - start,
            })
            bar.set_postfix(elbo=f"{history[-1]['elbo']:.4g}")
            bar.update(1)
    model.eval()
    return FSVIResult(model, history, time.perf_counter() - start)
