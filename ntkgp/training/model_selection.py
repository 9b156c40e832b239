"""Comparing trained networks by their Laplace evidence."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..likelihoods import hyperparameter_values, log_likelihood
from ..models import NTKGP


@dataclass
class EvidenceRow:
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
    r"""Compare trained networks by their Laplace-GGN evidence (model selection without validation data).

    Each entry is an :class:`~ntkgp.NTKGP` of a trained network on the *same* training data (e.g.
    ``result.model(x, y)`` from :func:`~ntkgp.training.train_marglik`). Returns a table sorted by
    :math:`\log q(D)/N`, with the training NLL per point, the number of parameters P and the hyperparameters.
    """
    if not models:
        raise ValueError("models must hold at least one NTKGP")
    sizes = {name: m.num_data for name, m in models.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"models must share the training data; got sizes {sizes}")
    rows = []
    for name, model in models.items():
        if not isinstance(model, NTKGP):
            raise TypeError(f"models[{name!r}] must be an ntkgp.NTKGP, got {type(model).__name__}")
        with torch.no_grad():
            evidence = model.log_marginal_likelihood(curvature=curvature).item()
            nll = -log_likelihood(model.likelihood, model._f_train, model._y).sum().item()
        hypers = hyperparameter_values(model.likelihood)
        rows.append(EvidenceRow(name, evidence / model.num_data, nll / model.num_data, model.covar_module.engine.num_params,
                                model.covar_module.prior_precision.detach().tolist(), hypers))
    return EvidenceTable(sorted(rows, key=lambda r: -r.log_evidence_per_n))
