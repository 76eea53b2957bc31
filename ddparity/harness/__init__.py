"""Everything that runs: worlds of rank processes and their launch, the rank program and
its protocol, rendezvous and the side channel, the rank-side recorders, the one training
loop and its modes, the rank tasks of check, profile and health, torchrun."""
