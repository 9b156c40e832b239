r"""The diagonal approximation: the diagonal of the GGN or empirical Fisher from one pass over the data
(:mod:`~ntkgp.laplace.weight_space.diagonal.curvature`) and its posterior (:mod:`~ntkgp.laplace.weight_space.diagonal.laplace`).

The public names are documented under :mod:`ntkgp.laplace.weight_space`.
"""
