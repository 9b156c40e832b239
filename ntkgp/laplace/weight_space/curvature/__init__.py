r"""The structured weight-space curvatures, each from one pass over the data: the diagonal of the GGN or EF
(:mod:`~ntkgp.laplace.weight_space.curvature.diagonal`) and KFAC
(:mod:`~ntkgp.laplace.weight_space.curvature.kfac`, its running factor sums in
:mod:`~ntkgp.laplace.weight_space.curvature.kfac_factors`), on the layers the curvature takes by features
(:mod:`~ntkgp.laplace.weight_space.curvature.layers`, normalization layers and embeddings in
:mod:`~ntkgp.laplace.weight_space.curvature.norm_layers`).

The full GGN / EF is the shared :mod:`ntkgp.laplace.ggn`'s; the curvature of one layer from its features is
:mod:`ntkgp.laplace.weight_space.last_layer`'s. The public names are documented under
:mod:`ntkgp.laplace.weight_space`.
"""
