"""Everything that judges: pure functions from recorded data (traces, side-channel
records, measurements, a world failure) to typed verdicts (:mod:`ddparity.verdicts`).
Imports nothing from :mod:`ddparity.harness`, so it reads and tests without a process."""
