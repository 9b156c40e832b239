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
from .prediction import PREDICTION_BUDGET

__all__ = ["DEFAULT_PREDICTIVE_MEAN", "NTKGP", "PREDICTION_BUDGET", "ExactNTKGP", "LaplaceNTKGP"]
