"""What a process doing distributed training is seen to do, recorded as it happens: the
collective ledger and phases (:mod:`.recorder`, one call as the ledger records it:
:mod:`.calls`), DDP's gradient buckets (:mod:`.ddp_buckets`), fingerprints of a replica's
state (:mod:`.fingerprint`) and a watched script's DDP and FSDP2 modules (:mod:`.replicas`).
Installed in local ranks, simulated ranks and every process of a launch alike; it imports
nothing from them."""
