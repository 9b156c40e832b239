"""``NTKGP``: the Laplace-GGN linearized network as a GPyTorch GP.

* :mod:`.model` — :class:`NTKGP`: construction, options, data, prior, evidence, site posterior;
* :mod:`.arguments` — validation of the constructor's arguments (network dtype, random networks, batch mode);
* :mod:`.kernel_options` — the kernel's options as attributes of the model;
* :mod:`.newton_step` — the ``"gp"`` mean as the network output plus the Newton step's correction;
* :mod:`.prediction` — ``predictive_distribution`` and ``posterior`` in chunks of test points;
* :mod:`.conditioning` — ``condition_on`` and ``get_fantasy_model``;
* :mod:`.exact_model`, :mod:`.laplace_model` — the Gaussian (``ExactGP``) and classification classes.
"""

from .exact_model import ExactNTKGP
from .laplace_model import LaplaceNTKGP
from .model import DEFAULT_PREDICTIVE_MEAN, NTKGP

__all__ = ["DEFAULT_PREDICTIVE_MEAN", "NTKGP", "ExactNTKGP", "LaplaceNTKGP"]


def __getattr__(name: str):
    if name == "PREDICTION_BUDGET":  # deprecated: the budget is in bytes now
        import warnings

        from ...memory import PREDICTION_BYTES

        warnings.warn(
            "ntkgp.models.ntkgp.PREDICTION_BUDGET (numbers) is deprecated: the prediction budget is "
            "ntkgp.memory.PREDICTION_BYTES, in bytes", FutureWarning, stacklevel=2,
        )
        return PREDICTION_BYTES // 8
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
