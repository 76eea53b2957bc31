"""The controller side of a local run: a :class:`~.world.World` of warm rank processes
(:mod:`.spawn` starts them, :mod:`.rendezvous` gives them a store), the pool that keeps
worlds warm between checks, deciding that a task failed and gathering its evidence
(:mod:`.outcomes`, :mod:`.stacks`), the ranks' output and the progress line."""
