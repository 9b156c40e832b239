r"""The KFAC approximation: one Kronecker block :math:`G_l \otimes A_l` per layer
(:mod:`~ntkgp.laplace.weight_space.kfac.blocks`), the running factor sums of the pass over the data
(:mod:`~ntkgp.laplace.weight_space.kfac.factor_sums`), the curvature :class:`~ntkgp.laplace.weight_space.KroneckerGGN` and
the pass that computes it (:mod:`~ntkgp.laplace.weight_space.kfac.curvature`), and its posterior
(:mod:`~ntkgp.laplace.weight_space.kfac.laplace`).

The public names are documented under :mod:`ntkgp.laplace.weight_space`.
"""
