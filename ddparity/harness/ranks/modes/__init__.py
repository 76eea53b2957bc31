"""The ways to train a replica, one per file, each an implementation of
:class:`ddparity.harness.ranks.training.Mode`: :mod:`.single` (the reference), :mod:`.twin`
(its calibration twin), :mod:`.dp` (DataParallel), :mod:`.ddp` (DistributedDataParallel,
real or simulated ranks), :mod:`.fsdp` (FSDP2 and HSDP), and :mod:`.timed` and
:mod:`.timed_sharded` (the profile's timed passes). What tells the modes apart outside
these files is their row in :mod:`ddparity.run_kinds`."""
