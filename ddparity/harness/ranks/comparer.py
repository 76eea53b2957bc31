"""A run's side of the spool (:mod:`ddparity.harness.ranks.spool`): the reference's step
files read in place (memory-mapped, one tensor at a time) as the run reaches each step,
waiting for the reference if it is behind, and compared with the run's own tensors into one
distance per tensor (:class:`Comparer`). A launch's ranks on other nodes read the same
steps through rank 0 (:mod:`ddparity.harness.launch.refserve`, which serves these files).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ddparity.distances import Distances, max_abs, moved
from ddparity.harness.ranks.spool import gradient
from ddparity.harness.shards import local_part, optimizer_state
from ddparity.harness.spool_files import ABORT, STATE, ReferenceFailed, Stored, load_state, mapped

POLL_MIN_S = 0.001
POLL_MAX_S = 0.05
"""How often a run looks for the reference's next step: often at first, then every POLL_MAX_S."""


def wait_for(spool: str, path: str, limit_s: float, failed: tuple[str, str] | None = None,
             what: str | None = None) -> None:
    """Until the reference wrote ``path`` (``what``: how the wait names it; raises
    :class:`ReferenceFailed` when the spool is aborted, when ``failed``'s file appears (with
    its message), or after ``limit_s``)."""
    started = time.monotonic()
    while not os.path.exists(path):
        if os.path.exists(os.path.join(spool, ABORT)):
            raise ReferenceFailed("the reference run stopped before this step")
        if failed is not None and os.path.exists(failed[0]):
            raise ReferenceFailed(failed[1])
        waited = time.monotonic() - started
        if waited > limit_s:
            raise ReferenceFailed(f"the reference wrote no {what or os.path.basename(path)} in {limit_s:g} s")
        # a small model's step is milliseconds: look often at first, then every POLL_MAX_S
        time.sleep(POLL_MIN_S if waited < 1.0 else POLL_MAX_S)


class _Step:
    """One of the reference's step files, mapped: its tensors by (kind, name)."""

    def __init__(self, spool: str, stem: str, wait: Callable[[str], None]) -> None:
        json_path = os.path.join(spool, stem + ".json")
        wait(json_path)
        with open(json_path) as f:
            meta = json.load(f)
        self.spool = spool
        self.stepped: bool = meta["stepped"]
        self.tensors = Stored.read(meta["tensors"])
        self._maps: dict[str, Any] = {}

    def items(self) -> Iterator[tuple[tuple[str, str], Any]]:
        """((kind, name), tensor or None) for every tensor, in order."""
        for entry in self.tensors:
            yield (entry.kind, entry.name), None if entry.dtype is None else self._tensor(entry)

    def _tensor(self, entry: Stored) -> Any:
        return mapped(self.spool, entry, self._maps)

    def close(self) -> None:
        self._maps.clear()


class Comparer:
    """A run's sink: compares every step with the reference's, where both are."""

    def __init__(self, spool: str, mode: str, rank: int, world_size: int, limit_s: float,
                 own_values: bool = False,
                 open_step: Callable[[str], Any] | None = None) -> None:
        self.spool = spool
        self._open = open_step or (lambda stem: _Step(self.spool, stem, self._wait))
        """Where the reference's steps come from: the spool here, or (another node of a
        launch, :mod:`ddparity.harness.launch.refserve`) rank 0 over the network."""
        self.limit_s = limit_s
        self.result = Distances(mode, rank, world_size)
        self.own_values = own_values
        """The twin: also its own tensors' magnitudes and its summands' sizes."""
        self.values: dict[tuple[int, str, str], float] = {}
        self.scales: dict[tuple[int, str, str], float] = {}
        self._grads_done = -1

    def _wait(self, path: str) -> None:
        wait_for(self.spool, path, self.limit_s)

    def note_scales(self, step: int, loss_scale: Any, grad_scales: dict[str, Any]) -> None:
        """The twin's summand sizes of this step (see :mod:`ddparity.harness.ranks.modes.twin`)."""
        if loss_scale is not None:
            self.scales[(step, "loss", "loss")] = max_abs(loss_scale)
        for name, scale in grad_scales.items():
            self.scales[(step, "grad", name)] = max_abs(scale)

    def grads(self, step: int, model: Any) -> None:
        self._compare(step, f"g{step}", {("grad", n): gradient(p) for n, p in model.named_parameters()})
        self._grads_done = step

    def after(self, step: int, loss: Any, stepped: bool, model: Any, optimizer: Any = None) -> None:
        if self._grads_done != step:  # this run did not step: every gradient the reference has is missing
            self._compare(step, f"g{step}", {})
        mine = {("loss", "loss"): loss}
        mine.update({("param", n): p for n, p in model.named_parameters()})
        mine.update({("optimizer", n): t for n, t in optimizer_state(model, optimizer)})
        mine.update({("buffer", n): b for n, b in model.named_buffers()})
        self._compare(step, f"a{step}", mine, start=self._initial() if step == 0 and stepped else None)

    def _compare(self, step: int, stem: str, mine: dict[tuple[str, str], Any],
                 start: dict[str, Any] | None = None) -> None:
        """``mine`` against the reference's step file ``stem``; with ``start`` (the initial
        state, at step 0) also how far each parameter moved against the reference's move."""
        self.result.steps.extend({} for _ in range(step + 1 - len(self.result.steps)))
        ref = self._open(stem)
        sums, dots = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        try:
            for key, whole in ref.items():
                if key[0] == "optimizer" and key not in mine:
                    self.result.not_held(step, key)
                    continue
                expected, got = local_part(whole, mine.get(key))  # a shard against its slice
                self.result.compare(step, key, expected, got)
                if self.own_values:
                    self.values[(step, key[0], key[1])] = max_abs(got)
                if key[0] == "grad" and got is not None and expected is not None and expected.shape == got.shape:
                    dots = [a + b for a, b in zip(dots, moved(None, expected, got))]
                initial = start.get(key[1]) if start is not None and key[0] == "param" else None
                if initial is not None and got is not None and expected is not None and expected.shape == got.shape:
                    begun, _ = local_part(initial, mine[key])
                    if begun.shape == got.shape:
                        sums = [a + b for a, b in zip(sums, moved(begun, expected, got))]
        finally:
            ref.close()
        if start is not None:
            self.result.moved = (sums[0], sums[1], sums[2])
        if stem.startswith("g"):
            self.result.grad_dots[step] = (dots[0], dots[1], dots[2])

    def _initial(self) -> dict[str, Any] | None:
        """The state every run started from (memory-mapped), where this rank can read the
        reference's spool (not on a launch's other nodes)."""
        if not os.path.exists(os.path.join(self.spool, STATE)):
            return None
        return load_state(self.spool)

    def finish(self) -> Distances:
        return self.result
