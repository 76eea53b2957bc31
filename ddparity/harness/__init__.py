"""Everything that runs, one folder per process role:

* :mod:`.world` — the controller: worlds of local rank processes, the pool, starting and
  stopping them, deciding that a task failed, their stacks and output;
* :mod:`.ranks` — what runs inside a rank: the rank program, the one training loop and its
  modes, batches and randomness, the spool, the recorders, the tasks of check, profile and
  health (real ranks, or simulated ones in threads);
* :mod:`.launch` — running inside someone else's launch (torchrun, Slurm): its environment,
  the launch watch, the reference server, every rank's part of a launched verb.

Shared by all three, here: the messages between controller and ranks (:mod:`.protocol`),
the side channel (:mod:`.sidechannel`) and the janitor that removes a dead process's
folders (:mod:`.janitor`)."""
