r"""What every weight-space Laplace posterior shares: the interface
(:class:`~ntkgp.laplace.weight_space.posterior.weight_posterior.WeightPosterior`, with the checks run before a pass
over the data), its evidence and the choice of :math:`\delta`
(:mod:`~ntkgp.laplace.weight_space.posterior.prior_tuning`), its predictive by every estimator
(:mod:`~ntkgp.laplace.weight_space.posterior.predictive_estimators`), its samples and state dict
(:mod:`~ntkgp.laplace.weight_space.posterior.posterior_state`) and the option group of its constructor
(:mod:`~ntkgp.laplace.weight_space.posterior.pass_options`).

The posteriors themselves stand above it, one folder per approximation with its curvature
(:mod:`~ntkgp.laplace.weight_space.full`, :mod:`~ntkgp.laplace.weight_space.kfac`,
:mod:`~ntkgp.laplace.weight_space.diagonal`, :mod:`~ntkgp.laplace.weight_space.subnetwork`,
:mod:`~ntkgp.laplace.weight_space.last_layer`); this package imports none of them. The public names are documented
under :mod:`ntkgp.laplace.weight_space`.
"""
