"""Validation of :class:`~ntkgp.NTKGP`'s constructor arguments, and the kernel and network outputs it builds from them.

Everything is checked before the model exists: tensors, shapes, the likelihood against the network's outputs,
the targets, and two properties of the network that would otherwise surface as torch's errors at the first
prediction: its dtype (float32 or float64) and whether it is deterministic. GPyTorch's batch-mode training
data (a batch of independent training sets) are refused with the alternatives (docs/ntkgp.md, "Batch-mode
training data").
"""

from __future__ import annotations

import torch
from gpytorch.likelihoods import Likelihood
from torch import nn

from ...kernels import NTKKernel
from ...kernels.arguments import check_network_dtype
from ...kernels.network_state import RANDOM_NETWORK, RandomNetworkError
from ...likelihoods import num_outputs, validate_targets
from ...ntk import GroupSpec, NTKEngine
from ...ntk.checks import OutputShapeError
from ...ntk.data_arguments import check_data
from ...ntk.inputs import check_tensor, is_structured
from ...ntk.inputs import to as to_network
from ...ntk.packed_inputs import structure_network
from ...validation import optional_positive_int, positive_int

__all__ = ["check_floating", "optional_positive_int", "positive_int", "setup"]

#: Training inputs run twice through the network to tell a random network (functional dropout) from a deterministic one.
RANDOMNESS_PROBE = 8

BATCH_MODE = (
    "GPyTorch's batch-mode training data (a batch of independent GPs, train_x of shape (*batch, N, D)) are not "
    "supported by NTKGP: its kernel and mean are the network's, linearized at the weights trained on one data set. "
    "Build one NTKGP per training set (e.g. in a gpytorch.models.IndependentModelList or a BoTorch ModelListGP); for "
    "a batch of models conditioned on extra data use model.condition_on_observations or model.fantasize"
)


def check_floating(x: object, argument: str) -> torch.Tensor:
    """A real tensor: floating point (features), or integer/boolean (token ids, masks: passed to the network as
    they are, never cast to its dtype); ``TypeError`` naming ``argument`` otherwise (the name is historical)."""
    return check_tensor(x, argument)


def _check_not_batched(likelihood: Likelihood, kernel_kwargs: dict) -> None:
    noise = getattr(getattr(likelihood, "noise_covar", None), "batch_shape", torch.Size([]))
    if len(noise) > 0:
        raise ValueError(f"likelihood has batch_shape {tuple(noise)}. {BATCH_MODE}")
    batch_shape = kernel_kwargs.get("batch_shape")
    if batch_shape is not None and len(batch_shape) > 0:
        raise ValueError(f"batch_shape={tuple(batch_shape)} is a kernel batch. {BATCH_MODE}")


def deterministic_outputs(engine: NTKEngine, x: torch.Tensor) -> torch.Tensor:
    """``f(x; θ*)``, after checking that a second pass over the first inputs gives the same outputs (a random
    operation in ``forward`` that eval mode does not switch off would not); the global random state is left as
    it was.

    Raises:
        ValueError: naming ``net`` for a random network; as :meth:`NTKEngine.outputs` for inputs it rejects.
    """
    devices = [engine.device] if engine.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        f = engine.outputs(x, "train_x")
        first, second = f[:RANDOMNESS_PROBE], engine.outputs(x[:RANDOMNESS_PROBE], "train_x")
    first, second = first.detach(), second.detach()
    scale = float(first.abs().max().clamp_min(1.0))
    if not torch.allclose(first, second, rtol=1e-3, atol=1e-3 * scale):
        raise RandomNetworkError(f"{RANDOM_NETWORK}: two passes over the same training inputs gave different outputs")
    return f


def setup(
    net: nn.Module,
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    likelihood: Likelihood,
    prior_precision: float | torch.Tensor,
    prior_structure: GroupSpec,
    kernel_kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor, NTKKernel, torch.Tensor]:
    """Check everything and build the kernel; returns ``x`` (flat), ``y`` (validated), the kernel and ``f(x)``.

    Structured ``train_x`` (a dict or tuple of tensors) is packed into rows of bytes and the kernel is built on the
    view of ``net`` that rebuilds them (:mod:`ntkgp.ntk.packed_inputs`): ``x`` is then the packed rows ``(N, B)``.

    Raises:
        TypeError: a non-likelihood, a ``train_x`` that is not a real tensor, a float16/bfloat16 network.
        ValueError: shapes, non-finite values, batch-mode data, a random network, outputs that do not match the
            likelihood, bad targets.
        NotImplementedError: an unsupported likelihood.
    """
    if not isinstance(likelihood, Likelihood):
        raise TypeError(f"likelihood must be a gpytorch Likelihood, got {type(likelihood).__name__}")
    expected = num_outputs(likelihood)  # raises for unsupported likelihoods
    if is_structured(train_x):  # a dict/tuple of tensors: packed rows, rebuilt for the network (ntk.packed_inputs)
        check_data(train_x, "train_x")  # a list of numbers is refused as such
        if kernel_kwargs.get("input_shape") is not None:
            raise ValueError(f"input_shape={kernel_kwargs['input_shape']} applies to tensor inputs, but train_x is a "
                             f"{type(train_x).__name__} of tensors: leave input_shape=None")
        net, train_x = structure_network(net, train_x, "train_x")
    check_floating(train_x, "train_x")
    check_network_dtype(net)
    _check_not_batched(likelihood, kernel_kwargs)
    if train_x.dim() < 2 or train_x.shape[0] == 0:
        raise ValueError(
            f"train_x must have shape (N, ...) with N ≥ 1 and a feature dimension, got {tuple(train_x.shape)}"
        )
    kernel_kwargs = dict(kernel_kwargs)
    input_shape = kernel_kwargs.pop("input_shape", None)
    inferred = train_x.dim() > 2 and input_shape is None
    if inferred:
        input_shape = tuple(train_x.shape[1:])
    # train_x (N, *input_shape) is N inputs of the network's shape; when that reading fails, say so naming train_x.
    batch_hint = (
        f" (train_x of shape {tuple(train_x.shape)} is read as {train_x.shape[0]} inputs of shape "
        f"{tuple(train_x.shape[1:])}. {BATCH_MODE})" if inferred else ""
    )
    try:
        kernel = NTKKernel(
            net, prior_precision=prior_precision, prior_structure=prior_structure, input_shape=input_shape,
            **kernel_kwargs,
        )
    except OutputShapeError as error:
        if not inferred:
            raise
        raise ValueError(f"net could not be applied to train_x: {error}{batch_hint}") from None
    engine = kernel.engine
    x = to_network(train_x.flatten(1), kernel.raw_prior_precision.dtype, kernel.raw_prior_precision.device)
    try:
        f = deterministic_outputs(engine, x)
    except (RuntimeError, ValueError) as error:  # the network rejects the inputs (wrong feature count, ...)
        if isinstance(error, ValueError) and not inferred:
            raise
        if isinstance(error, RandomNetworkError):
            raise
        raise ValueError(
            f"net could not be applied to train_x of shape {tuple(train_x.shape)}: {error}{batch_hint}"
        ) from None
    if f.shape[1] != expected:
        raise ValueError(
            f"net has {f.shape[1]} outputs but the likelihood {type(likelihood).__name__} expects {expected}"
        )
    y = validate_targets(likelihood, train_y, f.shape[1], num_data=x.shape[0], name="train_y")
    y = y.to(device=x.device)
    # the model's dtype, never the inputs' (token ids and packed rows are integers: f would be truncated)
    return x, y, kernel, f.to(dtype=kernel.raw_prior_precision.dtype, device=x.device)
