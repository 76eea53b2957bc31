"""What each launched rank tells the reporter about itself when a launch fails.

The reporter (:class:`ddparity.harness.launch.watchdog.LaunchWatch`) cannot look into other
machines' processes, so it asks through the launch's store (its keys:
:mod:`ddparity.harness.store_keys`): ``STACKS_ASKED`` counts the requests (``NEWS`` too,
which every rank reads), ``NATIVE_ASKED`` marks a hang's. Each rank's watch thread answers
with ``stacks(r)`` and, in a hang, ``flight(r)``, its own Flight Recorder's state. A hang's stacks carry native frames (py-spy on itself, where gloo or NCCL waits); a
crash's or a desync's are the Python stacks, taken at once.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ddparity.frames import own_stacks
from ddparity.harness import store_keys
from ddparity.harness.launch.flight import own_flight_state
from ddparity.harness.world.stacks import own_native_stacks

STACKS_WAIT_S = 3.0
"""How long the reporter waits for every rank's Python stacks."""
NATIVE_STACK_S = 3.0
"""The most a rank's own native stack dump may take (py-spy unwinding a busy process)."""
HANG_WAIT_S = STACKS_WAIT_S + NATIVE_STACK_S
"""How long the reporter waits for every rank's answer in a hang (stacks, Flight Recorder)."""


def answer(store: Any, rank: int, answered: int) -> int:
    """Answer a request newer than ``answered``; the number of the latest request."""
    asked = int(store.add(store_keys.STACKS_ASKED, 0))
    if asked <= answered:
        return answered
    if store.check([store_keys.NATIVE_ASKED]):
        store.set(store_keys.flight(rank), json.dumps(own_flight_state()))
        store.set(store_keys.stacks(rank), own_native_stacks(NATIVE_STACK_S) or own_stacks())
    else:
        store.set(store_keys.stacks(rank), own_stacks())
    store.add(store_keys.STACKS_WRITTEN, 1)
    return asked


def gather(store: Any, rank: int, answered: int, alive: list[int],
           hang: bool) -> tuple[int, dict[int, str], dict[int, dict[str, Any]]]:
    """Ask every rank in ``alive`` (this one, ``rank``, answers at once): the latest request's
    number, their stacks and (in a hang) their Flight Recorder states."""
    before = int(store.add(store_keys.STACKS_WRITTEN, 0))
    if hang:
        store.set(store_keys.NATIVE_ASKED, "1")
    store.add(store_keys.STACKS_ASKED, 1)
    store.add(store_keys.NEWS, 1)  # every rank reads D at its next beat
    answered = answer(store, rank, answered)
    deadline = time.monotonic() + (HANG_WAIT_S if hang else STACKS_WAIT_S)
    while int(store.add(store_keys.STACKS_WRITTEN, 0)) < before + len(alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    stacks = {r: v.decode("utf-8", "replace") for r, v in zip(alive, store.multi_get([store_keys.stacks(r) for r in alive]))}
    flight: dict[int, dict[str, Any]] = {}
    for r in alive if hang else []:
        if store.check([store_keys.flight(r)]):
            flight[r] = json.loads(store.get(store_keys.flight(r)))
    return answered, stacks, flight
