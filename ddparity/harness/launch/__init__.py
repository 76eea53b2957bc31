"""Running inside someone else's launch (torchrun, Slurm, any ``env://`` launcher): the
launch's environment and process groups (:mod:`.torchrun`), the watch threads every
process runs (:mod:`.watch`), the reference server for ranks off rank 0's node
(:mod:`.refserve`), and a launch in which every rank runs one task (:mod:`.everyone`)."""
