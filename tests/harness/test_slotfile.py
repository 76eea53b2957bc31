"""The slot file a local rank's progress record is overwritten in: a reader gets a whole
record, the latest written, whatever the writer is doing."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

from ddparity.harness import slotfile
from ddparity.harness.slotfile import SlotWriter, read_slot


def test_reads_the_latest_record_of_any_length(tmp_path):
    path = str(tmp_path / "P0")
    assert read_slot(path) == ""  # no file yet
    writer = SlotWriter(path)
    assert read_slot(path) == ""  # nothing written yet
    for text in ["short", "x" * 9000, "mid" * 100, "", "é" * 3000, "tail"]:
        writer.write(text)
        assert read_slot(path) == text
    writer.close()
    assert read_slot(path) == "tail"  # closed: the last record stays
    size = os.path.getsize(path)
    assert size < 4 * slotfile.FIRST + 2 * 9000 * 2  # it alternates, it does not grow per write


def test_a_reader_racing_the_writer_never_sees_half_a_record(tmp_path):
    path = str(tmp_path / "P0")
    writer = SlotWriter(path)
    records = [f"{i:06d}" + chr(65 + i % 26) * (100 + (i * 7919) % 20000) for i in range(3000)]
    writer.write(records[0])
    valid = set(records)
    done = threading.Event()

    def write_all() -> None:
        for text in records:
            writer.write(text)
        done.set()

    thread = threading.Thread(target=write_all)
    thread.start()
    seen = 0
    while not done.is_set():
        text = read_slot(path)
        if text:
            assert text in valid
            seen += 1
    thread.join()
    assert read_slot(path) == records[-1]
    assert seen > 0


def _write_forever(path: str, ready) -> None:  # noqa: ANN001
    writer = SlotWriter(path)
    i = 0
    while True:
        writer.write(f"record {i} " + "y" * (i % 5000))
        if i == 100:
            ready.set()
        i += 1


def test_a_writer_killed_mid_write_leaves_a_whole_record(tmp_path):
    path = str(tmp_path / "P0")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_write_forever, args=(path, ready))
    proc.start()
    try:
        assert ready.wait(60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    text = read_slot(path)
    number = int(text.split()[1])
    assert number >= 100 and text == f"record {number} " + "y" * (number % 5000)


def test_a_corrupt_file_reads_as_nothing(tmp_path):
    path = str(tmp_path / "P0")
    writer = SlotWriter(path)
    writer.write("whole")
    writer.close()
    with open(path, "r+b") as f:
        f.seek(slotfile.FIRST)
        f.write(b"W")  # the record no longer matches its crc32
    assert read_slot(path) == ""
