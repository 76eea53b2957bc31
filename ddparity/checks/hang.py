"""Hang verdicts: who is stuck, where each rank is, and who arrives late.

Input is what the ranks left in the side channel (progress and ledger, readable while
they are wedged) plus their stacks, taken by the World before it killed them, and in a
launch what each rank's own Flight Recorder held (:func:`flight_finding`).
"""

from __future__ import annotations

from typing import Any

from ddparity.checks.collectives import slots
from ddparity.records import Entry, Position, parse_ledger, parse_progress
from ddparity.verdicts import FlightFinding, Hang, RankPlace, Straggler


def positions(records: dict[int, Any]) -> dict[int, Position | None]:
    return {r: parse_progress(s.progress) for r, s in records.items()}


WAITING_IN_C10D = ("c10d::", "distributed_c10d.py")
"""A stack with one of these frames waits inside a collective (torch's C++ process group, or
its Python API): one the ledger may not have seen, such as DDP's reducer syncing its rebuilt
buckets at the start of the second step."""


def waits_in_a_collective(stack: str) -> bool:
    return any(marker in stack for marker in WAITING_IN_C10D)


def waiting_for(records: dict[int, Any], where: dict[int, Position | None], stacks: dict[int, str],
                pending: list[int]) -> dict[int, set[int]]:
    """Per pending rank that waits inside a collective (its stack in c10d's frames), the ranks
    of the last collective's group that never issued it, by their ledgers: whom it waits for.
    A subgroup's collective (FSDP2's all-gather in an HSDP shard group) is not in the world
    group's sequence that positions order the ranks by."""
    issued: dict[str, dict[int, int]] = {}
    last: dict[int, Entry] = {}
    for rank, record in records.items():
        pos = where.get(rank)
        for e in [*parse_ledger(record.ledger), *(pos.recent if pos is not None else ())]:
            if e.group != "p2p":
                group = issued.setdefault(e.group, {})
                group[rank] = max(group.get(rank, -1), e.seq)
                if e.t >= (last[rank].t if rank in last else float("-inf")):
                    last[rank] = e
    for rank in records:  # every rank is in the world group, whether it issued there or not
        issued.setdefault("world", {}).setdefault(rank, -1)
    waits: dict[int, set[int]] = {}
    for rank in pending:
        latest = last.get(rank)
        if latest is None or not waits_in_a_collective(stacks.get(rank, "")):
            continue
        behind = {r for r, seq in issued.get(latest.group, {}).items() if seq < latest.seq}
        if behind:
            waits[rank] = behind
    return waits


def suspect_ranks(where: dict[int, Position | None], pending: list[int],
                  stacks: dict[int, str] | None = None, waits: dict[int, set[int]] | None = None) -> list[int]:
    """The ranks most likely to cause a hang, in this order of evidence:

    1. pending ranks behind the others (earlier step, phase or collective), less those
       waiting inside a collective for another of them (``waits``: :func:`waiting_for`);
    2. ranks that finished the task while others still wait in a collective;
    3. pending ranks not inside a blocking collective (by their ledger, or by their stack:
       torch's own collectives, which the ledger does not see, wait in c10d's frames);
    4. every pending rank (all sit in the same collective: the transport is stuck).
    """
    if not pending:
        return []
    never = (-2, -2, -1)  # a rank that never started the task is the furthest behind
    order = {r: (p.order() if (p := where.get(r)) is not None else never) for r in pending}
    ahead = max(order.values())
    behind = sorted(r for r in pending if order[r] < ahead)
    if behind:
        waits = waits or {}
        waited_for = [r for r in behind if not (waits.get(r) and waits[r] <= set(behind) - {r})]
        return waited_for or behind
    finished = sorted(r for r in where if r not in pending)
    if finished:
        return finished
    stacks = stacks or {}
    outside = sorted(r for r in pending if ((p := where.get(r)) is None or p.inflight is None)
                     and not waits_in_a_collective(stacks.get(r, "")))
    if outside and len(outside) < len(pending):
        return outside
    return sorted(pending)


def _collective_text(pos: Position | None) -> tuple[int, str]:
    if pos is None:
        return -1, "none (the rank had not started the task)"
    last = pos.last
    if last is None:
        return -1, "none issued yet"
    state = "inside" if pos.inflight == last.seq else "last issued"
    return last.seq, f"{state}: {last.render()}"


def rank_places(records: dict[int, Any], stacks: dict[int, str], pending: list[int]) -> dict[int, RankPlace]:
    """Per rank: collective sequence position, the collective, step, phase and stack."""
    out: dict[int, RankPlace] = {}
    for rank, pos in sorted(positions(records).items()):
        seq, text = _collective_text(pos)
        out[rank] = RankPlace(
            collective_seq=seq,
            collective=text,
            step=pos.step if pos else -1,
            phase=(pos.phase or "") if pos else "",
            finished=rank not in pending,
            stack=stacks.get(rank, "") if rank in pending else "(finished the task)",
        )
    return out


def judge_hang(records: dict[int, Any], stacks: dict[int, str], pending: list[int],
               flight: dict[int, dict[str, Any]] | None = None) -> Hang:
    """The suspect ranks and every rank's position and stack (and the Flight Recorders'
    finding, where the ranks read theirs)."""
    finding = flight_finding(flight) if flight else None
    where = positions(records)
    suspects = suspect_ranks(where, pending, stacks, waiting_for(records, where, stacks, pending))
    if (finding is not None and finding.kind == "host" and suspects == sorted(pending)
            and finding.not_issued_by and set(finding.not_issued_by) < set(suspects)):
        # positions and stacks left every waiting rank suspect (a ledger not yet written, a
        # stack not read): the recorders tell the ranks that never issued the collective
        suspects = sorted(finding.not_issued_by)
    return Hang(suspects, rank_places(records, stacks, pending), finding)


def flight_finding(states: dict[int, dict[str, Any]]) -> FlightFinding | None:
    """A hang's kind from each rank's Flight Recorder state
    (:func:`ddparity.harness.launch.flight.own_flight_state`): per process group, the
    collective the furthest rank issued; a group whose members all issued it and none
    completed it is stalled *inside* it; members that never issued it are stuck on the
    *host* side (named first: the likelier cause). None when no rank's recorder was read."""
    read = {r: s["groups"] for r, s in states.items() if "groups" in s}
    if not read:
        return None
    unread = sorted(r for r in states if r not in read)
    found: list[FlightFinding] = []
    for name in sorted({g for groups in read.values() for g in groups}):
        seen = {r: groups[name] for r, groups in read.items() if name in groups}
        members = next((g["ranks"] for g in seen.values() if g.get("ranks")), None) or sorted(seen)
        top = max(g["issued"] for g in seen.values())
        waiting = sorted(r for r, g in seen.items() if g["issued"] == top and g["completed"] < top)
        if top < 0 or not waiting:
            continue
        head = next(g for g in seen.values() if g["issued"] == top)
        what = _collective(head)
        where = "the default group" if name == "0" else f"group {name!r} (ranks {members})"
        behind = sorted(r for r, g in seen.items() if g["issued"] < top)
        if behind:
            found.append(FlightFinding(
                "host", f"rank(s) {behind} never issued {what} ({where}'s collective #{top} in the recorder's "
                        f"count), which rank(s) {waiting} issued and wait in: the hang is on the host side of "
                        f"rank(s) {behind} (their stacks show where they are)",
                name, top, what, waiting, behind, [], unread))
            continue
        cold = sorted(r for r, g in seen.items() if 0 <= g["started"] < top)
        tail = (f"; its kernel had not started on rank(s) {cold} (their stream is busy with earlier work)"
                if cold else "")
        found.append(FlightFinding(
            "inside", f"every rank of {where} that was read issued {what} (its collective #{top} in the "
                      f"recorder's count) and none completed it: the collective itself is stalled (the "
                      f"transport, the network or a device), not a desync{tail}",
            name, top, what, waiting, [], cold, unread))
    if not found:
        return FlightFinding("idle", "no collective was unfinished on any rank: the ranks wait outside "
                                     "collectives (the script's own code, a store or a file)", unread=unread)
    # the end of the chain of waits: ranks behind in one group that wait in no group's collective
    # (HSDP: rank 3 stalled; rank 2 waits in their shard group's all-gather, so is behind in the
    # replicate group's all-reduce that rank 0 waits in; rank 3 is the host-side hang, not 2)
    waiting_somewhere = {r for f in found for r in f.issued_by}
    hosts = [f for f in found if f.kind == "host"]
    return next((f for f in hosts if not set(f.not_issued_by) & waiting_somewhere), hosts[0] if hosts else found[0])


def _collective(state: dict[str, Any]) -> str:
    sizes = ", ".join(f"{d.lower()}{list(s)}" for s, d in zip(state.get("sizes", []), state.get("dtypes", [])))
    return f"{state.get('op') or 'unknown'}({sizes})"


STRAGGLER_MIN_LATE_S = 0.05
"""A rank is called a straggler when it arrives last at most collectives and on average
this much later than the first rank: smaller delays are ordinary scheduling noise."""


def stragglers(records: dict[int, Any]) -> list[Straggler]:
    """Ranks that arrive last at most shared collectives, by a margin worth reporting."""
    ledgers = {r: parse_ledger(s.ledger) for r, s in records.items()}
    if len(ledgers) < 2:
        return []
    shared = [by_rank for by_rank in slots(ledgers).values() if len(by_rank) == len(ledgers)]
    if not shared:
        return []
    late = {r: 0.0 for r in ledgers}
    last = {r: 0 for r in ledgers}
    for by_rank in shared:
        first = min(e.t for e in by_rank.values())
        latest = max(by_rank, key=lambda r: by_rank[r].t)
        last[latest] += 1
        for r, e in by_rank.items():
            late[r] += e.t - first
    n = len(shared)
    found = [Straggler(r, last[r], n, late[r] / n) for r in ledgers]
    return [x for x in found if x.last_count * 2 >= n and x.mean_late_s >= STRAGGLER_MIN_LATE_S]
