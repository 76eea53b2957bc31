import pickle

import pytest

from ddparity.errors import RemoteError, TaskTimeout
from ddparity.harness import protocol

MESSAGES = [
    protocol.RankSpec(0, 2, "gloo", "cpu", "127.0.0.1", 1234, "ddparity/gen1", 60.0, 1, "lo"),
    protocol.RankContext(1, 2, "gloo", "cpu"),
    protocol.RunTask(7, b"payload", ("/a", "/b")),
    protocol.Shutdown(),
    protocol.RankReady(1, 4242, 0.25),
    protocol.RankStartFailed(1, "RuntimeError: x", "Traceback..."),
    protocol.TaskDone(7, 1, False, b"exc", "ValueError: bad", "Traceback...", 0.5),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert pickle.loads(pickle.dumps(message)) == message


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_are_frozen(message):
    field = message.__slots__[0] if message.__slots__ else None
    if field:
        with pytest.raises(AttributeError):
            setattr(message, field, None)


def test_remote_error_round_trips_with_its_fields():
    err = pickle.loads(pickle.dumps(RemoteError("Weird", "cannot pickle", "tb")))
    assert (err.type_name, err.message, err.traceback) == ("Weird", "cannot pickle", "tb")
    assert str(err) == "Weird: cannot pickle"


def test_output_mark_is_unambiguous():
    assert b"\x00" in protocol.OUTPUT_END_MARK % 3
    assert protocol.OUTPUT_END_MARK % 3 != protocol.OUTPUT_END_MARK % 33


def test_timeout_error_keeps_ranks_and_stacks():
    err = TaskTimeout("msg", [1], {1: "stack"})
    assert err.pending_ranks == [1] and err.stacks == {1: "stack"}
