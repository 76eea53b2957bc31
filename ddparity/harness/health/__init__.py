"""What a rank measures for ``ddparity health`` (:mod:`.probe`, its tasks and fault drills):
all-reduces timed over the world and pair by pair (:mod:`.allreduce_timing`), copy
bandwidths (:mod:`.transfer_probe`), the GPU as NVML reports it (:mod:`.nvml_probe`) and the
``--long`` stress pass (:mod:`.stress_probe`). Runs inside local ranks and every process of
a launch; imports nothing from the training rooms beside it."""
