r"""The full approximation: the posterior :math:`N(\theta^*, (H + P_0)^{-1})` with the whole ``P × P`` GGN or empirical
Fisher (:mod:`~ntkgp.laplace.weight_space.full.laplace`; the curvature itself, :class:`~ntkgp.laplace.ggn.FullCurvature`, is
the shared :mod:`ntkgp.laplace.ggn`'s, which the function-space wing uses too).

The public names are documented under :mod:`ntkgp.laplace.weight_space`.
"""
