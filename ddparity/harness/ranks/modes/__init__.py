"""The ways to train a replica, one per file, each an implementation of
:class:`ddparity.harness.ranks.training.Mode`: :mod:`.single` (the reference), :mod:`.twin`
(its calibration twin), :mod:`.dp` (DataParallel), :mod:`.ddp` (DistributedDataParallel,
real or simulated ranks) and :mod:`.timed` (the profile's timed passes)."""
