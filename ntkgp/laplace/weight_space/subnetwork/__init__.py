r"""The subnetwork approximation: a full posterior over chosen parameters (or entries of them), the others fixed at
:math:`\theta^*` (:mod:`~ntkgp.laplace.weight_space.subnetwork.laplace`).

The public names are documented under :mod:`ntkgp.laplace.weight_space`.
"""
