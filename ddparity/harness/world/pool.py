"""Warm worlds kept across checks: one :class:`WorldPool` per process (per pytest-xdist
worker), with a cap on the rank processes it keeps alive."""

from __future__ import annotations

import atexit

from ddparity.harness.world import spawn
from ddparity.harness.world.world import World
from ddparity.settings import default_max_ranks, validate_max_ranks

THREADS = "threads"
"""The role of the world whose one rank hosts simulated ranks (threads)."""
STARTS_CLEAN = frozenset({THREADS})
"""The roles whose worlds start their ranks from the forkserver (a process that only
imported torch: :attr:`~ddparity.settings.WorldSpec.clean_start`), never forked from this
process: the simulated ranks' host runs many threads of torch work."""


class WorldPool:
    """Warm worlds, one per (world size, backend, role), reused across checks.

    At most ``max_ranks`` rank processes stay alive (``None``: no cap): before a world
    starts, the least recently used idle worlds are closed to make room. A world in use
    is never closed, so a check that alone needs more ranks than the cap still runs.
    """

    def __init__(self, max_ranks: int | None = None) -> None:
        self.max_ranks = validate_max_ranks(max_ranks, "WorldPool(max_ranks=...)")
        self._worlds: dict[tuple[int, str, str], World] = {}  # least recently used first
        self.closed_for_room = 0

    def get(self, world_size: int, backend: str, role: str = "ddp") -> World:
        """The warm world for ``role``: the reference has its own 1-rank world, so that it
        can train while the DDP worlds (a 1-rank one included) run."""
        key = (world_size, backend, role)
        world = self._worlds.pop(key, None)
        if world is None:
            world = World(world_size, backend, clean_start=role in STARTS_CLEAN)
        if not world.pids:
            self._make_room(world_size)
        self._worlds[key] = world
        return world.start()

    def expect(self, world_size: int, backend: str, role: str = "ddp") -> None:
        """A world for ``role`` will be asked for soon: where it is not live yet and starts
        from the forkserver (:data:`STARTS_CLEAN`), the forkserver starts now, in the
        background."""
        world = self._worlds.get((world_size, backend, role))
        if role in STARTS_CLEAN and (world is None or not world.pids):
            spawn.warm_forkserver()

    def _make_room(self, needed: int) -> None:
        if self.max_ranks is None:
            return
        for key, world in list(self._worlds.items()):
            if len(self.pids) + needed <= self.max_ranks:
                return
            if not world.busy:
                world.close()
                del self._worlds[key]
                self.closed_for_room += 1

    @property
    def pids(self) -> set[int]:
        """The rank processes of every live world in the pool."""
        return {pid for world in self._worlds.values() for pid in world.pids}

    def interrupt(self) -> list[tuple[str, list[str]]]:
        """Ctrl-C: for every world still running a task (runs train side by side), the run
        and where each of its ranks was; those ranks stopped."""
        return [found for world in list(self._worlds.values()) if world.busy and (found := world.interrupt())[1]]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


_default_pool: WorldPool | None = None


def default_pool() -> WorldPool:
    global _default_pool
    if _default_pool is None:
        _default_pool = WorldPool(max_ranks=default_max_ranks())
        atexit.register(_default_pool.close)
    return _default_pool
