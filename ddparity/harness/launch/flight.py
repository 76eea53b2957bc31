"""A watched rank's collective ledger as a PyTorch Flight Recorder dump, so users can read
it with the tool they know: ``python -m torch.distributed.flight_recorder.fr_trace DIR``.

Each rank writes its own file, ``DIR/ddparity_fr_<rank>``, in Flight Recorder's dump
format (the pickled dict ``torch._C._distributed_c10d._dump_fr_trace()`` returns, version
2.10): one entry per recorded collective with its process group, sequence number,
operation, input and output sizes and dtypes, creation time and the user's source line as
its frame. Entries are ``completed`` except, in a run that failed, the rank's last one
where it may still have been running when the run was stopped (``started``: a blocking call
that had not returned or that raised; DDP's buckets of the step the rank was still in). DDP's gradient all-reduces are
recorded from its bucket layout (one entry per bucket).

The other way round, :func:`own_flight_state` reads this process's own Flight Recorder
(on by default in torch 2.13, gloo's and NCCL's) when a launch hangs: per process group,
the last collective enqueued, started and completed. Ranks that all enqueued a collective
none completed are stalled inside it; a rank that never enqueued it is stuck on its host
side (:func:`ddparity.checks.hang.flight_finding` judges).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import threading
from collections.abc import Iterable
from typing import Any

FR_VERSION = "2.10"
PREFIX = "ddparity_fr_"
_TENSOR = re.compile(r"(\w+)=(?:(\d+)x)?(\w+)\[([\d, ]*)\]")
_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
           "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool",
           "complex64": "ComplexFloat", "complex128": "ComplexDouble"}


def _sizes(desc: str) -> tuple[list[list[int]], list[str], list[list[int]], list[str]]:
    """Input and output sizes and dtypes of a ledger entry's description
    (``all_gather_single(output_tensor=float32[132], input_tensor=float32[66])``)."""
    ins: list[tuple[list[int], str]] = []
    outs: list[tuple[list[int], str]] = []
    for name, count, dtype, dims in _TENSOR.findall(desc):
        shape = [int(d) for d in dims.replace(" ", "").split(",") if d]
        tensors = [(shape, _DTYPES.get(dtype, dtype))] * (int(count) if count else 1)
        (outs if name.startswith("output") else ins).extend(tensors)
        if not name.startswith(("output", "input")):
            outs.extend(tensors)  # in place (all_reduce's tensor, broadcast's)
    if not outs:
        outs = list(ins)
    return [s for s, _ in ins], [d for _, d in ins], [s for s, _ in outs], [d for _, d in outs]


_FR_OPS = {"all_gather_into_tensor": "_all_gather_base", "reduce_scatter_tensor": "_reduce_scatter_base",
           "monitored_barrier": "barrier", "all_gather_object": "all_gather", "broadcast_object_list": "broadcast",
           "gather_object": "gather", "scatter_object_list": "scatter", "isend": "send", "irecv": "recv"}
"""ddparity's names of the recorded calls, as Flight Recorder names the operation they issue."""


def _profiling_name(backend: str, op: str, desc: str, rank: int) -> str:
    name = _FR_OPS.get(op, op)
    root = re.search(r"root=(\d+)", desc)
    if name == "send" and root:
        return f"{backend}:send {rank}->{root.group(1)}"
    if name == "recv" and root:
        return f"{backend}:recv {rank}<-{root.group(1)}"
    return f"{backend}:{name}"


def _frame(site: str) -> list[dict[str, Any]]:
    """``file.py:12 in fn`` as Flight Recorder's frames (the innermost first)."""
    m = re.match(r"(.*):(\d+) in (.*)$", site)
    return [{"name": m.group(3), "filename": m.group(1), "line": int(m.group(2))}] if m else []


def fr_dump(lines: Iterable[str], rank: int, world_size: int, groups: dict[str, list[int]],
            running: bool, backend: str = "gloo") -> dict[str, Any]:
    """The dump of one rank's ledger ``lines`` (:func:`ddparity.records.encode_entry`'s JSON);
    ``running``: its last entry had not completed (:meth:`Recorder.last_running`)."""
    names = {"world": ("0", "default_pg")}
    pg_config = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world_size)))}}
    for name, ranks in groups.items():
        names[name] = (name, name)
        pg_config[name] = {"name": name, "desc": name, "ranks": str(ranks)}
    entries = []
    parsed = [json.loads(line) for line in lines if line.strip()]
    p2p = 0
    for i, e in enumerate(parsed):
        ins, in_dtypes, outs, out_dtypes = _sizes(e["d"])
        is_p2p = e["g"] == "p2p"
        p2p += is_p2p
        entries.append({
            "frames": _frame(e.get("site", "")), "record_id": i, "pg_id": 0,
            "process_group": names.get(e["g"], (e["g"], e["g"])), "thread_name": "python", "thread_id": "0",
            "collective_seq_id": 0 if is_p2p else e["s"] + 1, "p2p_seq_id": p2p if is_p2p else 0, "op_id": i + 1,
            "profiling_name": _profiling_name(backend, e["op"], e["d"], rank), "time_created_ns": int(e["t"] * 1e9),
            "input_sizes": ins, "input_dtypes": in_dtypes, "output_sizes": outs, "output_dtypes": out_dtypes,
            "state": "started" if running and i == len(parsed) - 1 else "completed",
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": True,
            "timeout_ms": 0, "is_p2p": is_p2p,
        })
    return {"version": FR_VERSION, "pg_config": pg_config, "comm_lib_version": "ddparity ledger", "pg_status": {},
            "entries": entries}


def write_fr_dump(folder: str, rank: int, dump: dict[str, Any]) -> str:
    """Write ``dump`` as ``folder/ddparity_fr_<rank>`` (the folder made if missing)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{PREFIX}{rank}")
    with open(path, "wb") as f:
        pickle.dump(dump, f)
    return path


FR_READ_S = 1.0
"""The most reading this process's own Flight Recorder may take (a dump can block on an
unhealthy process: pytorch#167023)."""


def own_flight_state(timeout: float = FR_READ_S) -> dict[str, Any]:
    """Per process group (by name) of this process: ``ranks`` (global), the sequence numbers
    of the last collective ``issued`` (enqueued), ``started`` (-1 where the backend does not
    track it: gloo; NCCL with timing) and ``completed``, and the issued one's ``op``,
    ``sizes`` and ``dtypes``: ``{"groups": {...}}``, or ``{"error": why}``."""
    box: dict[str, Any] = {}

    def read() -> None:
        try:
            box["state"] = _read_flight_recorder()
        except Exception as exc:  # an old torch, a recorder switched off, a dump that failed
            box["state"] = {"error": f"{type(exc).__name__}: {exc}"}

    reader = threading.Thread(target=read, name="ddparity-flight", daemon=True)
    reader.start()
    reader.join(timeout)
    return box.get("state") or {"error": f"reading the Flight Recorder took over {timeout:g} s"}


def _read_flight_recorder() -> dict[str, Any]:
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    dumps = [pickle.loads(getattr(c10d, name)(True, False, False))  # collectives, no stacks, not only active
             for name in ("_dump_fr_trace", "_dump_nccl_trace") if hasattr(c10d, name)]  # gloo's, NCCL's
    if not any(d.get("pg_status") for d in dumps):
        return {"error": "the Flight Recorder recorded nothing (TORCH_FR_BUFFER_SIZE=0?)"}
    from torch.distributed.distributed_c10d import _world

    members = {name: dist.get_process_group_ranks(pg) for pg, name in list(_world.pg_names.items())}
    groups: dict[str, Any] = {}
    for dump in dumps:
        entries = dump.get("entries", [])
        names = {str(e["pg_id"]): e["process_group"][0] for e in entries}
        for pg_id, status in dump.get("pg_status", {}).items():
            name = names.get(pg_id, pg_id)
            issued = int(status.get("last_enqueued_collective", -1))
            last = [e for e in entries if e["process_group"][0] == name and e["collective_seq_id"] == issued
                    and not e.get("is_p2p")]
            groups[name] = {"ranks": members.get(name), "issued": issued,
                            "started": int(status.get("last_started_collective", -1)),
                            "completed": int(status.get("last_completed_collective", -1)),
                            "op": last[-1]["profiling_name"] if last else "",
                            "sizes": last[-1]["input_sizes"] if last else [],
                            "dtypes": last[-1]["input_dtypes"] if last else []}
    return {"groups": groups}
