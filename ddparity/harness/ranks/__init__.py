"""What runs inside a rank: the rank program (:mod:`.rank`), its tasks (:mod:`.tasks`;
health's are :mod:`ddparity.harness.health`), the one training loop (:mod:`.training`) and its modes, batches,
randomness alignment and the spool the reference writes, the recorders (collective ledger,
gradient buckets, fingerprints), and simulated ranks in threads (:mod:`.threaded`).
Imports nothing from the controller (:mod:`ddparity.harness.world`) or the launch."""
