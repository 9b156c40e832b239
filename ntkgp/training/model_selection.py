"""Comparing trained networks by their Laplace evidence."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..likelihoods import hyperparameter_values, log_likelihood
from ..models import NTKGP
from ..options import CurvatureKind, choose


@dataclass
class EvidenceRow:
    """One row of :func:`compare_models`' table: per-point log marginal likelihood and training NLL, P, hyperparameters."""

    name: str
    log_evidence_per_n: float
    train_nll_per_n: float
    num_params: int
    prior_precision: list[float]
    likelihood_hypers: dict[str, list[float]]


class EvidenceTable(list):
    """Rows of :class:`EvidenceRow`, best evidence first; ``str(table)`` prints it."""

    def __str__(self) -> str:
        lines = [f"{'model':<20} {'log evidence/N':>15} {'train NLL/N':>12} {'P':>8}  hyperparameters"]
        for r in self:
            hyper = ", ".join(f"{k}={[round(v, 4) for v in vals]}" for k, vals in r.likelihood_hypers.items())
            lines.append(
                f"{r.name:<20} {r.log_evidence_per_n:>15.4f} {r.train_nll_per_n:>12.4f} {r.num_params:>8d}  "
                f"δ={[round(v, 4) for v in r.prior_precision]} {hyper}"
            )
        return "\n".join(lines)

    @property
    def best(self) -> EvidenceRow:
        return self[0]


def compare_models(models: Mapping[str, NTKGP], curvature: str = "ggn") -> EvidenceTable:
    r"""Compare trained networks by their Laplace-GGN log marginal likelihood (model selection without validation data).

    Each entry is an :class:`~ntkgp.NTKGP` of a trained network on the *same* training data (e.g.
    ``result.model(x, y)`` from :func:`~ntkgp.training.train_marglik`). Returns a table sorted by
    :math:`\log q(D)/N`, with the training NLL per point, the number of parameters P and the hyperparameters.

    Args:
        models: a non-empty mapping of names (strings) to models.
        curvature: ``"ggn"`` or ``"ef"``.

    Raises:
        TypeError: for a non-mapping, a non-string name or an entry that is not an NTKGP.
        ValueError: for an empty mapping, an unknown curvature or models on different training data.
    """
    if not isinstance(models, Mapping):
        raise TypeError(f"models must be a mapping of names to NTKGP models, got {type(models).__name__}")
    if not models:
        raise ValueError("models must hold at least one NTKGP")
    curvature = choose(CurvatureKind, curvature, "curvature")
    for name, model in models.items():
        if not isinstance(name, str):
            raise TypeError(f"model names must be strings, got {name!r}")
        if not isinstance(model, NTKGP):
            raise TypeError(f"models[{name!r}] must be an ntkgp.NTKGP, got {type(model).__name__}")
    sizes = {name: m.num_data for name, m in models.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"models must share the training data; got sizes {sizes}")
    first_name, first = next(iter(models.items()))
    for name, model in models.items():
        same_y = model.train_y.shape == first.train_y.shape and torch.equal(model.train_y.to(first.train_y), first.train_y)
        if not same_y:
            raise ValueError(f"models must share the training data; the targets of {name!r} differ from those of {first_name!r}")
    rows = []
    for name, model in models.items():
        with torch.no_grad():
            evidence = model.log_marginal_likelihood(curvature=curvature).item()
            nll = -log_likelihood(model.likelihood, model.train_outputs, model.train_y).sum().item()
        hypers = hyperparameter_values(model.likelihood)
        rows.append(EvidenceRow(name, evidence / model.num_data, nll / model.num_data, model.covar_module.engine.num_params,
                                model.covar_module.prior_precision.detach().tolist(), hypers))
    return EvidenceTable(sorted(rows, key=lambda r: -r.log_evidence_per_n))
