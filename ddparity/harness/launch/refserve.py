"""The reference for ranks that cannot read rank 0's spool: served over the network.

Under torchrun the reference trains on rank 0 and writes its steps to rank 0's spool
(:mod:`ddparity.harness.ranks.spool`). Ranks on rank 0's node read that spool in place; a rank
on another node (no shared ``/tmp``) asks rank 0 instead, over a gloo group of its own
(never the group the model trains on, so the collective ledger and the user's collectives
are untouched). Rank 0 runs one :class:`ReferenceServer` thread per rank; each answers
its rank's requests in order: the initial state (streamed into the rank's own spool, in
chunks), one step (its manifest, then each tensor's bytes as the rank compares it: one
tensor in memory at a time, as with the spool), or a file of the spool by name (the
reference's record of a step, module by module, for a re-run that localises:
:mod:`ddparity.harness.launch.localise`).

Point-to-point calls go to the group's backend object directly, past the recorder's
patched ``torch.distributed`` functions: serving the reference is not a collective of
the user's program.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from typing import Any

from ddparity.harness.ranks.comparer import wait_for
from ddparity.harness.spool_files import STATE, Stored, mapped_bytes, typed

STATE_REQUEST, GRADS_REQUEST, AFTER_REQUEST, FILE_REQUEST, BYE = 0, 1, 2, 3, -1
CHUNK_BYTES = 64 << 20
"""The initial state travels in pieces of this size (bounded memory on both ends)."""


def _send(pg: Any, t: Any, peer: int) -> None:
    pg.send([t], peer, 0).wait()


def _recv(pg: Any, t: Any, peer: int) -> None:
    pg.recv([t], peer, 0).wait()


def _send_int(pg: Any, value: int, peer: int) -> None:
    import torch

    _send(pg, torch.tensor([value], dtype=torch.int64), peer)


def _recv_int(pg: Any, peer: int) -> int:
    import torch

    box = torch.zeros(1, dtype=torch.int64)
    _recv(pg, box, peer)
    return int(box[0])


def _stem(kind: int, step: int) -> str:
    return f"{'g' if kind == GRADS_REQUEST else 'a'}{step}"


class ReferenceServer:
    """Rank 0's end: a daemon thread per peer answers from ``spool`` until it says bye (or
    is gone: a peer that died ends its thread with an error, which is not ours to report:
    the launch watch reports the peer)."""

    def __init__(self, pg: Any, spool: str, peers: list[int], limit_s: float) -> None:
        self._pg, self._spool, self._limit = pg, spool, limit_s
        self._threads = [threading.Thread(target=self._serve, args=(peer,), name=f"ddparity-serve-{peer}",
                                          daemon=True) for peer in peers]
        for thread in self._threads:
            thread.start()

    def _serve(self, peer: int) -> None:
        import torch

        request = torch.zeros(2, dtype=torch.int64)
        try:
            while True:
                _recv(self._pg, request, peer)
                kind, step = int(request[0]), int(request[1])
                if kind == BYE:
                    return
                if kind == STATE_REQUEST:
                    self._send_file(peer, STATE)
                elif kind == FILE_REQUEST:  # the name follows, ``step`` its length
                    name = torch.empty(step, dtype=torch.uint8)
                    _recv(self._pg, name, peer)
                    self._send_file(peer, bytes(name.numpy().data).decode())
                else:
                    self._send_step(peer, _stem(kind, step))
        except Exception:  # the peer is gone (or the launch is ending)
            return

    def _send_file(self, peer: int, name: str) -> None:
        import torch

        path = os.path.join(self._spool, os.path.basename(name))  # never a path out of the spool
        size = os.path.getsize(path)
        _send_int(self._pg, size, peer)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                _send(self._pg, torch.frombuffer(bytearray(chunk), dtype=torch.uint8), peer)

    def _send_step(self, peer: int, stem: str) -> None:
        import torch

        json_path = os.path.join(self._spool, stem + ".json")
        wait_for(self._spool, json_path, self._limit)
        with open(json_path, "rb") as f:
            meta = f.read()
        _send_int(self._pg, len(meta), peer)
        _send(self._pg, torch.frombuffer(bytearray(meta), dtype=torch.uint8), peer)
        maps: dict[str, Any] = {}
        for entry in Stored.read(json.loads(meta)["tensors"]):
            if entry.dtype is not None and entry.nbytes:
                _send(self._pg, mapped_bytes(self._spool, entry, maps).contiguous(), peer)


class RemoteReference:
    """A rank's end: fetches the initial state into its own spool, and opens steps for its
    :class:`~ddparity.harness.ranks.comparer.Comparer` (``open_step``)."""

    def __init__(self, pg: Any, server: int = 0) -> None:
        self._pg, self._server = pg, server

    def _ask(self, kind: int, step: int = 0) -> None:
        import torch

        _send(self._pg, torch.tensor([kind, step], dtype=torch.int64), self._server)

    def fetch_state(self, spool: str) -> None:
        self._ask(STATE_REQUEST)
        self._receive_file(spool, STATE)

    def fetch_file(self, spool: str, name: str) -> None:
        """The file ``name`` of rank 0's spool, into ``spool`` under the same name."""
        import torch

        raw = name.encode()
        self._ask(FILE_REQUEST, len(raw))
        _send(self._pg, torch.frombuffer(bytearray(raw), dtype=torch.uint8), self._server)
        self._receive_file(spool, name)

    def _receive_file(self, spool: str, name: str) -> None:
        import torch

        left = _recv_int(self._pg, self._server)
        tmp = os.path.join(spool, name + ".tmp")
        with open(tmp, "wb") as f:
            while left > 0:
                chunk = torch.empty(min(left, CHUNK_BYTES), dtype=torch.uint8)
                _recv(self._pg, chunk, self._server)
                f.write(chunk.numpy().data)
                left -= chunk.numel()
        os.replace(tmp, os.path.join(spool, name))

    def open_step(self, stem: str) -> _RemoteStep:
        kind = GRADS_REQUEST if stem[0] == "g" else AFTER_REQUEST
        self._ask(kind, int(stem[1:]))
        return _RemoteStep(self._pg, self._server)

    def close(self) -> None:
        self._ask(BYE)


class _RemoteStep:
    """One step of the reference as it arrives: the same ``items()`` as a mapped step."""

    def __init__(self, pg: Any, server: int) -> None:
        import torch

        self._pg, self._server = pg, server
        meta = torch.empty(_recv_int(pg, server), dtype=torch.uint8)
        _recv(pg, meta, server)
        data = json.loads(bytes(meta.numpy().data))
        self.stepped: bool = data["stepped"]
        self.tensors = Stored.read(data["tensors"])
        self._next = 0

    def items(self) -> Iterator[tuple[tuple[str, str], Any]]:
        while self._next < len(self.tensors):
            entry = self.tensors[self._next]
            self._next += 1
            yield (entry.kind, entry.name), None if entry.dtype is None else self._receive(entry)

    def _receive(self, entry: Stored) -> Any:
        import torch

        raw = torch.empty(entry.nbytes, dtype=torch.uint8)
        if entry.nbytes:
            _recv(self._pg, raw, self._server)
        return typed(entry, raw)

    def close(self) -> None:
        """Receive what was not read, so the next step's answer starts where it should."""
        for _ in self.items():
            pass
