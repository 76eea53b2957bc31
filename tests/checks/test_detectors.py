"""The detectors' decisions on hand-made evidence: minority, collective mismatch,
fingerprint desync, hang suspects, stragglers, stack tidying."""

from __future__ import annotations

import json

import pytest
import torch

from ddparity.checks.collectives import LiveWatch, collective_mismatch, minority
from ddparity.checks.desync import first_desync
from ddparity.checks.hang import flight_finding, judge_hang, stragglers, suspect_ranks, waiting_for
from ddparity.frames import tidy_stack
from ddparity.harness.recording.fingerprint import fingerprint
from ddparity.records import Entry, Position, RankRecords, encode_progress, parse_fingerprints


def entry(seq: int, key: str = "all_reduce|SUM|None|tensor=float32[4]", t: float = 0.0, step: int = 0,
          group: str = "world") -> Entry:
    return Entry(group, seq, key.split("|")[0], key, key, "train.py:1 in step", "", step, "backward", t, False)


@pytest.mark.parametrize(
    "groups, wrong, expected",
    [
        ({"a": [0, 2, 3], "b": [1]}, (), [1]),  # a clear majority
        ({"a": [0], "b": [1]}, (), [0, 1]),  # two ranks, no evidence: both (neither picked)
        ({"a": [0], "b": [1]}, (1,), [1]),  # rank 1 diverges from the reference
        ({"a": [0], "b": [1]}, (0,), [0]),  # rank 0 does
        ({"a": [0], "b": [1]}, (0, 1), [0, 1]),  # both do: every rank is reported
        ({"a": [0], "b": [1], "c": [2], "d": [3]}, (), [0, 1, 2, 3]),  # nobody agrees
        ({"a": [0, 1], "b": [2, 3]}, (2,), [2, 3]),
    ],
)
def test_minority(groups, wrong, expected):
    assert minority(groups, wrong) == expected


def test_collective_mismatch_finds_the_first_differing_slot_and_the_odd_rank():
    same = [entry(0), entry(1)]
    odd = [entry(0), entry(1, "all_reduce|SUM|None|tensor=float32[2]")]
    found = collective_mismatch({0: same, 1: odd, 2: same, 3: same})
    assert (found.seq, found.ranks) == (1, [1])
    assert "float32[2]" in found.what()
    assert collective_mismatch({0: same, 1: same}) is None
    # p2p entries are pairwise: never compared across the group
    p2p = {0: [entry(0, "send|None", group="p2p")], 1: [entry(0, "recv|None", group="p2p")]}
    assert collective_mismatch(p2p) is None


def _call(seq: int, step: int, site: str, key: str = "all_reduce|SUM|None|tensor=float32[1]", via: str = "") -> Entry:
    return Entry("world", seq, key.split("|")[0], key, key, site, via, step, "forward", 0.0, False)


def _bucket(seq: int, step: int) -> Entry:
    return _call(seq, step, "", "all_reduce|SUM|None|tensor=float32[100]", via="DDP gradient bucket 0")


@pytest.mark.parametrize("odd", [0, 1])
def test_a_call_issued_by_one_rank_alone_blames_that_rank_at_two_ranks(odd):
    """``if rank == 0: dist.all_reduce(metric)``: the metric's call site appears in no other
    rank's ledger; the other rank is at its DDP bucket at that slot. (It blamed rank 1.)"""
    alone = [_call(0, 0, "train.py:9 in step"), _bucket(1, 0)]
    others = [_bucket(0, 0)]
    found = collective_mismatch({odd: alone, 1 - odd: others})
    assert found.ranks == [odd]


@pytest.mark.parametrize("odd", [0, 1])
def test_a_rank_that_changes_what_it_calls_from_one_step_is_blamed_at_two_ranks(odd):
    """A metric all_reduce skipped (or reshaped) by one rank from step 1: that rank breaks
    its own step-0 pattern, the other repeats it."""
    step0 = [_call(0, 0, "train.py:9 in step"), _bucket(1, 0)]
    keeps = step0 + [_call(2, 1, "train.py:9 in step"), _bucket(3, 1)]
    skips = step0 + [_bucket(2, 1)]
    reshaped = step0 + [_call(2, 1, "train.py:9 in step", "all_reduce|SUM|None|tensor=float32[2]"), _bucket(3, 1)]
    for bad in (skips, reshaped):
        found = collective_mismatch({odd: bad, 1 - odd: keeps})
        assert (found.seq, found.ranks) == (2, [odd])


def test_two_ranks_without_evidence_are_both_reported_as_disagreeing():
    from ddparity.checks.judge import mismatch_desync
    from ddparity.render import _differs

    found = collective_mismatch({0: [_call(0, 0, "a.py:1 in f")], 1: [_call(0, 0, "a.py:1 in f", "broadcast|None|1|x")]})
    assert found.ranks == [0, 1]
    assert "vs" in found.what() and found.what().count("rank ") == 2
    assert _differs(mismatch_desync(found)).startswith("ranks 0 and 1 disagree")


def _progress(entries: list[Entry], inflight: int | None = None) -> str:
    recent = [{"g": e.group, "s": e.seq, "op": e.op, "k": e.key, "d": e.desc, "site": e.site,
               "step": e.step, "phase": e.phase, "t": e.t} for e in entries]
    return json.dumps({"n": 1, "step": 0, "phase": "backward", "inflight": inflight, "recent": recent})


def test_live_watch_waits_for_every_rank_before_naming_the_minority():
    watch = LiveWatch(settle=60)
    good, bad = [entry(0)], [entry(0, "broadcast|None|0|tensor=float32[4]")]
    assert watch([_progress(good), _progress(bad), _progress([])]) is None  # rank 2 not there yet
    reason = watch([_progress(good), _progress(bad), _progress(good)])
    assert reason and watch.found.ranks == [1]


def test_first_desync_names_the_step_tensors_and_ranks():
    same = {"param w": 1, "param b": 2, "rng cpu": 5}
    prints = {r: {0: dict(same), 1: dict(same)} for r in range(4)}
    prints[3][1] = {"param w": 9, "param b": 2, "rng cpu": 6}
    found = first_desync(prints)
    assert (found.step, found.ranks, found.names) == (1, [3], ["param w", "rng cpu"])
    assert first_desync({r: {0: dict(same)} for r in range(2)}) is None


def test_a_step_inside_backward_is_evidence_never_a_difference():
    """Every rank's step inside backward (an optimizer in backward) is recorded, compared by no
    one, and read as the drift's evidence; a rank that alone lacks it is no difference either."""
    from ddparity.checks.desync_causes import desync_cause
    from ddparity.checks.judge import state_desync
    from ddparity.records import IN_BACKWARD

    prints = {r: {0: {"param w": 1 + r, IN_BACKWARD: 1}} for r in range(2)}
    found = first_desync(prints)
    assert (found.names, found.in_backward) == (["param w"], True)
    assert desync_cause(state_desync(found), 1, []).startswith("likely cause: the optimizer stepped inside backward")
    prints[1][0].pop(IN_BACKWARD)
    prints[1][0]["param w"] = 1
    assert first_desync(prints) is None


def test_hsdp_shards_are_compared_among_their_replicas_only():
    """Under HSDP (2 replicas x 2 shards: ranks 0, 2 hold shard 0; 1, 3 shard 1) each shard's
    fingerprints are compared among the ranks holding it: different shards never differ
    "across ranks"; one replica's shard that drifts is a desync naming its rank; a name
    every rank publishes that one rank lacks still differs there."""
    prints = {r: {0: {f"param w [shard {r % 2}]": 10 + r % 2}} for r in range(4)}
    assert first_desync(prints) is None
    prints[3][0]["param w [shard 1]"] = 99
    assert first_desync(prints).ranks == [1, 3]  # two replicas: either may be the odd one
    found = first_desync(prints, prefer_wrong=(3,))  # rank 3 diverges from the reference: the tie broken
    assert (found.ranks, found.agreeing, found.names) == ([3], [1], ["param w [shard 1]"])
    every = {r: {0: {"rng cpu": 5}} for r in range(3)}
    del every[2][0]["rng cpu"]
    assert first_desync(every).ranks == [2]


def test_fingerprints_change_with_any_single_bit_and_only_then():
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    before = fingerprint(model, opt)
    assert fingerprint(model, opt) == before
    assert {"optimizer weight.exp_avg", "optimizer weight.exp_avg_sq", "rng cpu"} <= set(before)
    with torch.no_grad():
        bits = model.weight.view(torch.int32)
        bits[7, 3] ^= 1  # one bit of one element
    after = fingerprint(model, opt)
    assert [k for k in before if before[k] != after[k]] == ["param weight"]
    torch.rand(1)
    assert fingerprint(model, opt)["rng cpu"] != after["rng cpu"]
    line = json.dumps({"step": 0, "fp": after})
    assert parse_fingerprints(line + "\nnot json\n") == {0: after}


@pytest.mark.parametrize("shape", [(70000,), (17, 5000), (16, 4097), (300, 300), (1, 70000), (5000, 17), (2, 3, 20000)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_rotating_slices_cover_every_element_once_and_none_is_empty(shape, layout):
    """A large tensor is fingerprinted a slice a step: over SLICES steps every element
    once, and every step some (a step whose slice were empty would miss a desync that
    changes every element, until the next)."""
    from ddparity.harness.recording.fingerprint import SLICES, device_sums

    ones = torch.ones(shape, dtype=torch.int32)
    if layout == "transposed":
        ones = ones.transpose(0, -1)  # non-contiguous, as a parameter may be
    counts = [int(device_sums([ones], part)[0]) for part in range(SLICES)]
    assert sum(counts) == ones.numel() and min(counts) > 0, counts
    assert int(device_sums([ones], None)[0]) == ones.numel()  # part None: the whole tensor


def test_hang_suspects():
    def pos(step, phase, seq, inflight=None):
        return Position(step, phase, inflight, (entry(seq),) if seq >= 0 else ())

    behind = {0: pos(1, "backward", 4), 1: pos(1, "forward", 3), 2: pos(1, "backward", 4)}
    assert suspect_ranks(behind, [0, 1, 2]) == [1]
    # rank 2 finished while the others wait in collective 4
    left = {0: pos(1, "backward", 4, 4), 1: pos(1, "backward", 4, 4), 2: pos(2, "done", 4)}
    assert suspect_ranks(left, [0, 1]) == [2]
    # all inside the same collective: the transport itself
    stuck = {0: pos(0, "backward", 1, 1), 1: pos(0, "backward", 1, 1)}
    assert suspect_ranks(stuck, [0, 1]) == [0, 1]
    # a rank that never started the task is the furthest behind
    assert suspect_ranks({0: pos(0, "forward", 0), 1: None}, [0, 1]) == [1]


def test_a_rank_waiting_in_a_subgroups_collective_for_a_rank_behind_is_not_a_suspect():
    """HSDP, 2 x 2: rank 0 stalls before forward; rank 1 waits in their shard group's
    all-gather #3 (rank 0 issued up to #2); ranks 2 and 3 are in backward."""
    gather = "all_gather_into_tensor|None|None|output_tensor=float32[8]"

    def record(*entries):
        return RankRecords(ledger="\n".join(json.dumps(_as_json(e)) for e in entries))

    world = entry(0, t=1.0)
    records = {0: record(world, entry(2, gather, t=2.0, group="s01")),
               1: record(world, entry(2, gather, t=2.0, group="s01"), entry(3, gather, t=3.0, group="s01")),
               2: record(world, entry(3, gather, t=3.0, group="s23")),
               3: record(world, entry(3, gather, t=3.0, group="s23"))}
    where = {0: Position(1, "forward", None, (world,)), 1: Position(1, "forward", None, (world,)),
             2: Position(1, "backward", None, (world,)), 3: Position(1, "backward", None, (world,))}
    waiting = "c10d::Work::wait\nall_gather_single (torch/distributed/distributed_c10d.py:4394)"
    stacks = {0: "time.sleep\n_stall (faults.py:250)", 1: waiting, 2: waiting, 3: waiting}
    waits = waiting_for(records, where, stacks, [0, 1, 2, 3])
    assert waits == {1: {0}}
    assert suspect_ranks(where, [0, 1, 2, 3], stacks) == [0, 1]  # positions alone: the peer blamed too
    assert suspect_ranks(where, [0, 1, 2, 3], stacks, waits) == [0]
    # a rank waiting for a peer that is not behind stays a suspect: nothing else explains it
    assert suspect_ranks(where, [0, 1, 2, 3], stacks, {0: {2}, 1: {0}}) == [0]
    assert suspect_ranks(where, [0, 1, 2, 3], stacks, {0: {1}, 1: {0}}) == [0, 1]  # each waits for the other


def _as_json(e: Entry) -> dict:
    return {"g": e.group, "s": e.seq, "op": e.op, "k": e.key, "d": e.desc, "site": e.site, "via": e.via,
            "step": e.step, "phase": e.phase, "t": e.t, "async": e.is_async}


def _fr(issued: int, completed: int, started: int = -1, ranks: list[int] | None = None) -> dict:
    return {"ranks": ranks, "issued": issued, "started": started, "completed": completed,
            "op": "nccl:all_reduce", "sizes": [[4]], "dtypes": ["Float"]}


@pytest.mark.parametrize("behind", [0, 1, 3])
def test_flight_recorder_a_rank_that_never_issued_the_collective_is_a_host_side_hang(behind):
    states = {r: {"groups": {"0": _fr(6, 5) if r != behind else _fr(5, 5)}} for r in range(4)}
    found = flight_finding(states)
    assert (found.kind, found.seq, found.not_issued_by) == ("host", 6, [behind])
    assert found.issued_by == [r for r in range(4) if r != behind]
    assert "nccl:all_reduce(float[4])" in found.explanation


def test_flight_recorder_names_the_end_of_the_chain_of_waits_across_groups():
    """HSDP 2 x 2, rank 3 stalled: rank 2 waits in the shard group {2, 3}'s all-gather #4, so
    never issued the replicate group {0, 2}'s all-reduce #3 that rank 0 waits in. Group '1'
    sorts first: its finding (rank 2 behind) was the one shown."""
    states = {0: {"groups": {"1": _fr(3, 2, ranks=[0, 2]), "3": _fr(4, 4, ranks=[0, 1])}},
              1: {"groups": {"4": _fr(3, 2, ranks=[1, 3]), "3": _fr(4, 4, ranks=[0, 1])}},
              2: {"groups": {"1": _fr(2, 2, ranks=[0, 2]), "5": _fr(4, 3, ranks=[2, 3])}},
              3: {"groups": {"4": _fr(2, 2, ranks=[1, 3]), "5": _fr(3, 3, ranks=[2, 3])}}}
    found = flight_finding(states)
    assert (found.kind, found.group, found.not_issued_by, found.issued_by) == ("host", "4", [3], [1]), found


def test_flight_recorder_every_rank_inside_one_collective_is_a_stall_not_a_desync():
    states = {r: {"groups": {"0": _fr(6, 5, started=6 if r else 5)}} for r in range(3)}
    found = flight_finding(states)
    assert (found.kind, found.issued_by, found.not_started_on) == ("inside", [0, 1, 2], [0])
    assert "not a desync" in found.explanation and "had not started on rank(s) [0]" in found.explanation


def test_flight_recorder_judges_each_group_and_names_the_host_side_first():
    sub = [1, 3]
    states = {0: {"groups": {"0": _fr(9, 8)}},  # the default group: every rank inside #9
              1: {"groups": {"0": _fr(9, 8), "7": _fr(2, 1, ranks=sub)}},
              2: {"groups": {"0": _fr(9, 8)}},
              3: {"groups": {"0": _fr(9, 8), "7": _fr(1, 1, ranks=sub)}},
              4: {"error": "reading the Flight Recorder took over 1 s"}}
    found = flight_finding(states)
    assert (found.kind, found.group, found.not_issued_by, found.unread) == ("host", "7", [3], [4])
    assert "group '7' (ranks [1, 3])" in found.explanation


@pytest.mark.parametrize("stalled", [0, 2])
def test_the_recorders_decide_a_hang_that_positions_and_stacks_leave_open(stalled):
    # no rank's ledger written yet, no stack read (a loaded machine): positions suspect every waiting rank
    records, pending = {r: RankRecords() for r in range(3)}, [0, 1, 2]
    assert judge_hang(records, {}, pending).suspect_ranks == pending
    host = {r: {"groups": {"0": _fr(6, 5) if r != stalled else _fr(5, 5)}} for r in range(3)}
    hang = judge_hang(records, {}, pending, host)
    assert hang.suspect_ranks == [stalled] and hang.flight.not_issued_by == [stalled]
    inside = {r: {"groups": {"0": _fr(6, 5)}} for r in range(3)}  # every rank in it: the transport, all suspect
    assert judge_hang(records, {}, pending, inside).suspect_ranks == pending
    # what positions decide stands: rank 1 behind in its ledger is the suspect whatever a recorder read
    behind = {r: RankRecords(progress=encode_progress(9, 1, "forward" if r == 1 else "backward", None, ()))
              for r in range(3)}
    assert judge_hang(behind, {}, pending, host).suspect_ranks == [1]


def test_flight_recorder_with_nothing_unfinished_or_nothing_read():
    idle = flight_finding({r: {"groups": {"0": _fr(4, 4)}} for r in range(2)})
    assert idle.kind == "idle" and "outside collectives" in idle.explanation
    assert flight_finding({0: {"error": "recorded nothing"}, 1: {"error": "recorded nothing"}}) is None


def test_stragglers_need_a_rank_that_is_late_most_of_the_time():
    def ledger(times):
        return "\n".join(json.dumps({"g": "world", "s": i, "op": "all_reduce", "k": "x", "d": "x", "site": "s",
                                     "t": t}) for i, t in enumerate(times))

    late = {0: RankRecords(ledger=ledger([0.0, 1.0, 2.0])), 1: RankRecords(ledger=ledger([0.3, 1.3, 2.01]))}
    [s] = stragglers(late)
    assert s.rank == 1 and s.last_count == 3 and s.mean_late_s > 0.2
    close = {0: RankRecords(ledger=ledger([0.0, 1.0])), 1: RankRecords(ledger=ledger([0.001, 0.999]))}
    assert stragglers(close) == []


def test_tidy_stack_drops_headers_bootstrap_frames_and_template_noise():
    raw = """Process 12: python x.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 12 (idle): "MainThread"
    c10d::Work::wait (libtorch_cpu.so)
    pybind11::cpp_function::initialize<std::vector<at::Tensor, std::allocator<at::Tensor> >, bool>(foo<int>)::{lambda(int)#1}::_FUN (libtorch_python.so)
    train (model.py:10)
    _run_task (ddparity/harness/ranks/rank.py:130)
    rank_main (ddparity/harness/ranks/rank.py:176)
    BaseProcess._bootstrap (multiprocessing/process.py:314)
"""
    text = tidy_stack(raw)
    assert "Process 12" not in text and "_bootstrap" not in text
    assert "pybind11::cpp_function::initialize::{lambda}::_FUN (libtorch_python.so)" in text
    assert "train (model.py:10)" in text and "_run_task" in text
    thread = tidy_stack('Thread 9 (idle): "ddparity-simulated-rank3"\n    forward (model.py:20)\n'
                        "    Thread.run (threading.py:982)\n    Thread._bootstrap_inner (threading.py:1045)\n"
                        "    thread_run (libpython3.11.so.1.0)\n")
    assert thread == 'Thread 9 (idle): "ddparity-simulated-rank3"\n    forward (model.py:20)\n'  # no bootstrap


def test_tidy_stack_hides_ddparitys_own_threads_unless_verbose(monkeypatch):
    raw = """Thread 12 (idle): "MainThread"
    train (model.py:10)
Thread 13 (idle): "ddparity-ledger"
    Recorder._publish_loop (ddparity/harness/recording/recorder.py:179)
Thread 14 (idle): "ddparity-simulated-rank3"
    forward (model.py:20)
"""
    monkeypatch.delenv("DDPARITY_VERBOSE", raising=False)
    text = tidy_stack(raw)
    assert "ddparity-ledger" not in text and "_publish_loop" not in text
    assert "train (model.py:10)" in text and "ddparity-simulated-rank3" in text  # a simulated rank is the user's
    monkeypatch.setenv("DDPARITY_VERBOSE", "1")  # what --verbose sets
    assert "_publish_loop" in tidy_stack(raw)


def test_stacks_and_tracebacks_fold_ddparitys_own_frames_unless_verbose(monkeypatch):
    from ddparity.frames import PACKAGE, hide_own_frames

    spy = """Thread 12 (idle): "MainThread"
    Tensor.backward (torch/_tensor.py:623)
    train_step (my_training.py:30)
    record_step (ddparity/harness/ranks/stepping.py:144)
    DDPMode.step (ddparity/harness/ranks/modes/ddp.py:75)
    train (ddparity/harness/ranks/training.py:155)
    _run_task (ddparity/harness/ranks/rank.py:135)
    FaultyMLP.forward (ddparity/fixtures/faults.py:55)
"""
    own = f"{PACKAGE}harness/ranks/stepping.py"
    python = ("Traceback (most recent call last):\n"
              f'  File "{PACKAGE}harness/ranks/rank.py", line 135, in _run_task\n    value = fn(ctx)\n'
              f'  File "{own}", line 144, in record_step\n    loss = replica.step_fn(model)\n           ^^^^^\n'
              f'  File "{own}", line 199, in step\n    loss = forward(model)\n'
              '  File "/home/me/my_training.py", line 30, in train_step\n    raise ValueError("bad")\n'
              "ValueError: bad\n")
    monkeypatch.delenv("DDPARITY_VERBOSE", raising=False)
    text = hide_own_frames(spy)
    assert "stepping.py" not in text and "harness/ranks/training.py" not in text
    assert "    train_step (my_training.py:30)\n    [3 frames of ddparity's own: --verbose shows them]\n" \
           "    _run_task (ddparity/harness/ranks/rank.py:135)\n" in text
    assert "FaultyMLP.forward" in text  # the fixtures are a user's model
    tb = hide_own_frames(python)
    assert "stepping.py" not in tb and "replica.step_fn" not in tb and "^^^^^" not in tb
    assert "  [2 frames of ddparity's own: --verbose shows them]\n  File \"/home/me/my_training.py\"" in tb
    assert "value = fn(ctx)" in tb and tb.endswith('raise ValueError("bad")\nValueError: bad\n')
    monkeypatch.setenv("DDPARITY_VERBOSE", "1")
    assert hide_own_frames(spy) == spy and hide_own_frames(python) == python


def test_a_per_rank_normalisation_is_named_only_when_valid_entries_are_uneven():
    from ddparity.checks.causes import likely_cause
    from ddparity.verdicts import Divergence

    loss = [Divergence(step=0, kind="loss", name="loss", rank=0, max_abs=0.01, max_rel=0.004, tolerance=1e-6)]
    uneven = likely_cause(loss, 2, valid={"batch['labels']": [5, 5, 1, 2]})
    assert uneven.startswith("likely cause: a loss averaged over each rank's own valid entries: batch['labels'] "
                             "has 10, 3 valid entries"), uneven
    assert likely_cause(loss, 2, valid={"batch['labels']": [5, 1, 2, 4]}) is None  # 6 and 6: even
    assert likely_cause(loss, 2) is None


def test_a_scaled_gradient_is_named_by_tensors_not_by_the_ranks_reporting_them():
    from ddparity.checks.causes import likely_cause
    from ddparity.verdicts import Divergence

    def grad(name, rank):
        return Divergence(step=0, kind="grad", name=name, rank=rank, max_abs=0.01, max_rel=0.05, tolerance=1e-6)

    one_tensor = [grad("fc.weight", 0), grad("fc.weight", 1)]
    assert likely_cause(one_tensor, 2, params=4) is None
    every = [grad(name, rank) for name in ("a.weight", "a.bias", "b.weight", "b.bias") for rank in (0, 1)]
    cause = likely_cause(every, 2, params=4)
    assert cause.startswith("likely cause: all 4 gradients are scaled by the same factor (relative error 0.05"), cause
    assert likely_cause(every[:4], 2, params=4) is None  # two tensors of four


def test_a_summed_loss_with_batchnorm_on_shards_says_the_second_may_remain():
    from ddparity.checks.causes import likely_cause
    from ddparity.verdicts import Divergence

    def at(kind, name, rel=0.5):
        return Divergence(step=0, kind=kind, name=name, rank=0, max_abs=1.0, max_rel=rel, tolerance=1e-6)

    found = [at("loss", "loss"), at("buffer", "1.running_mean", 0.1), at("buffer", "1.running_var", 0.1),
             at("buffer", "5.running_mean", 0.1)]
    cause = likely_cause(found, 2, loss_scaling=lambda: 2.0)
    assert cause.startswith("likely cause: a loss summed over the batch"), cause
    assert cause.endswith("; BatchNorm statistics differ too (1, 5): BatchNorm on shards may remain once the loss "
                          "is fixed, check again"), cause
    assert "BatchNorm" not in likely_cause(found[:1], 2)
    bn = likely_cause([at("grad", "w", 0.01), *found[1:]], 2)
    assert bn.startswith("likely cause: BatchNorm on shards (1, 5):"), bn
    typed = likely_cause(found, 2, layer_types={"1": "BatchNorm2d", "5": "BatchNorm1d"})
    assert "BatchNorm statistics differ too (1 (BatchNorm2d), 5 (BatchNorm1d))" in typed, typed


def test_batchnorm_on_shards_names_the_first_layers_and_counts_the_rest():
    """A model with BatchNorm everywhere (transformers' LeViT has 20) is named in one line."""
    from ddparity.checks.causes import likely_cause
    from ddparity.verdicts import Divergence

    found = [Divergence(step=0, kind="grad", name="w", rank=0, max_abs=1.0, max_rel=0.01, tolerance=1e-6)]
    found += [Divergence(step=0, kind="buffer", name=f"b{i}.running_mean", rank=0, max_abs=1.0, max_rel=0.1,
                         tolerance=1e-6) for i in range(20)]
    cause = likely_cause(found, 2)
    assert cause.startswith("likely cause: BatchNorm on shards (b0, b1, b2 and 17 more): each rank"), cause
    assert "b3" not in cause


def test_a_buffer_differing_first_alone_is_a_statistic_of_the_shard_not_when_a_gradient_differs_too():
    from ddparity.checks.causes import likely_cause
    from ddparity.verdicts import Divergence

    def at(kind, name, step=0):
        return Divergence(step=step, kind=kind, name=name, rank=0, max_abs=1.0, max_rel=0.1, tolerance=1e-6)

    alone = likely_cause([at("buffer", "center"), at("param", "w", step=1)], 2)
    assert alone.startswith("likely cause: buffer 'center' differs first (step 0)"), alone
    assert "DDP broadcasts rank 0's buffers" in alone
    assert "broadcasts" not in likely_cause([at("buffer", "center")], 2, mode="fsdp")
    with_grads = likely_cause([at("buffer", "center"), at("grad", "w")], 2)
    assert with_grads is None or "buffer 'center'" not in with_grads, with_grads
    bn = likely_cause([at("buffer", "bn.running_mean")], 2)
    assert bn.startswith("likely cause: BatchNorm on shards"), bn
