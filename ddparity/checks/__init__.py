"""What is true about the runs: equivalence, tolerances (and later desync, hangs, comm)."""
