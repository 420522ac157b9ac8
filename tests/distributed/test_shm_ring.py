"""ShmBroadcast: every reader process gets every message, in order, across wrap-around and chunking."""
import hashlib
import multiprocessing
import os
import re
import threading
import time

import pytest

from devharness.distributed.shm_ring import SHM_PREFIX, ShmBroadcast, ShmHandle

pytestmark = pytest.mark.timeout(120)


def my_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"{SHM_PREFIX}{os.getpid()}_")}


def message(i: int) -> bytes:
    # Sizes from empty to several slots, content tied to the index so a mix-up shows.
    size = [0, 1, 100, 1000, 5000][i % 5]
    return bytes((i + k) % 251 for k in range(size))


def _read_all(handle: ShmHandle, reader_index: int, count: int, out) -> None:
    with ShmBroadcast.attach(handle, reader_index) as ch:
        for i in range(count):
            if ch.read(timeout_s=30) != message(i):
                out.send(f"reader {reader_index}: message {i} differs")
                return
        out.send("ok")


def run_readers(ch: ShmBroadcast, count: int, payloads) -> list[str]:
    # fork: these readers never touch torch, and spawning would import it (via devharness/__init__)
    # once per reader; test_large_message attaches from a spawned process, as a Ray actor would.
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(ch.handle().num_readers)]
    procs = [ctx.Process(target=_read_all, args=(ch.handle(), i, count, send), daemon=True)
             for i, (_, send) in enumerate(pipes)]
    for p in procs:
        p.start()
    for data in payloads:
        ch.write(data, timeout_s=30)
    results = [recv.recv() if recv.poll(60) else "no answer" for recv, _ in pipes]
    for p in procs:
        p.join(10)
    return results


def test_broadcast_in_order_with_wrap_around_and_chunks():
    # 3 slots of 1 KiB and 40 messages: the ring wraps many times; 5000-byte messages take 5 chunks,
    # more than the ring holds, so they stream while the readers drain.
    with ShmBroadcast.create(num_readers=3, slot_bytes=1024, num_slots=3) as ch:
        assert run_readers(ch, 40, [message(i) for i in range(40)]) == ["ok"] * 3


def test_large_message():
    big = os.urandom(3 * 1024 * 1024 + 7)
    with ShmBroadcast.create(num_readers=1, slot_bytes=64 * 1024, num_slots=4) as ch:
        reader = ShmBroadcast.attach(ch.handle(), 0)
        for data in (b"small", big[:4 * 64 * 1024], b""):   # exactly the ring's size, then an empty one
            ch.write(data, timeout_s=5)
            assert reader.read(timeout_s=5) == data
        reader.close()
    # 49 chunks through a ring of 4: needs a reader draining concurrently.
    ctx = multiprocessing.get_context("spawn")
    with ShmBroadcast.create(num_readers=1, slot_bytes=64 * 1024, num_slots=4) as ch:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_echo_length, args=(ch.handle(), send), daemon=True)
        proc.start()
        ch.write(big, timeout_s=30)
        assert recv.poll(60) and recv.recv() == (len(big), hashlib.sha256(big).hexdigest())
        proc.join(10)


def _echo_length(handle, out) -> None:
    with ShmBroadcast.attach(handle, 0) as ch:
        data = ch.read(timeout_s=30)
        out.send((len(data), hashlib.sha256(data).hexdigest()))


def test_message_larger_than_the_ring_reaches_a_reader_slower_than_the_write_timeout():
    # 11 chunks through a ring of 2; the reader takes what is there, then sleeps 4x the writer's timeout.
    big = os.urandom(10 * 1024 + 5)
    stalls, errors = [], []
    with ShmBroadcast.create(num_readers=1, slot_bytes=1024, num_slots=2) as ch:
        reader = ShmBroadcast.attach(ch.handle(), 0)

        def write_all():
            try:
                for data in (big, b"after"):
                    ch.write(data, timeout_s=0.05, on_stall=stalls.append)
            except BaseException as e:
                errors.append(e)
        writer = threading.Thread(target=write_all, daemon=True)
        writer.start()
        got, give_up = [], time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < give_up:
            try:
                got.append(reader.read(timeout_s=0))
            except TimeoutError:
                time.sleep(0.2)
        writer.join(10)
        reader.close()
    assert not errors and got == [big, b"after"]
    # It stalled mid-message (the first 2 chunks went at once), and every stall named the slow reader.
    assert len(stalls) >= 4 and all("readers [0]" in str(e) for e in stalls), stalls


def test_write_that_gives_up_mid_message_delivers_nothing_and_the_channel_goes_on():
    big = os.urandom(5000)   # 5 chunks through a ring of 2: it gives up after 2
    with ShmBroadcast.create(num_readers=1, slot_bytes=1024, num_slots=2) as ch:
        reader = ShmBroadcast.attach(ch.handle(), 0)

        def dead_reader(e: TimeoutError):
            raise ConnectionError(f"reader 0 is gone ({e})")
        # Given up by a timeout, then by on_stall; the second attempt also withdraws the first's chunks.
        with pytest.raises(TimeoutError, match=r"readers \[0\]"):
            ch.write(big, timeout_s=0.1)
        with pytest.raises(TimeoutError):
            reader.read(timeout_s=0.1)   # holds 2 chunks of a message that never ends
        with pytest.raises(ConnectionError, match="reader 0 is gone"):
            ch.write(b"x" * 3000, timeout_s=0.1, on_stall=dead_reader)
        with pytest.raises(TimeoutError):
            reader.read(timeout_s=0.1)

        # Retried, both get through whole, in order, and nothing of the abandoned attempts shows.
        writer = threading.Thread(target=lambda: [ch.write(m, timeout_s=10) for m in (big, b"x" * 3000, b"end")],
                                  daemon=True)
        writer.start()
        assert [reader.read(timeout_s=10) for _ in range(3)] == [big, b"x" * 3000, b"end"]
        writer.join(10)
        with pytest.raises(TimeoutError):
            reader.read(timeout_s=0.1)
        reader.close()


def test_read_timeout_names_what_it_waited_for():
    with ShmBroadcast.create(num_readers=2, slot_bytes=256, num_slots=2) as ch:
        reader = ShmBroadcast.attach(ch.handle(), 1)
        ch.write(b"first")
        assert reader.read(timeout_s=1) == b"first"
        with pytest.raises(TimeoutError, match=rf"{re.escape(ch.name)}.*reader 1 waited 0.2 s for message 1"):
            reader.read(timeout_s=0.2)
        reader.close()


def test_writer_never_overwrites_an_unread_slot():
    with ShmBroadcast.create(num_readers=2, slot_bytes=256, num_slots=2) as ch:
        fast, slow = ShmBroadcast.attach(ch.handle(), 0), ShmBroadcast.attach(ch.handle(), 1)
        ch.write(b"a")
        ch.write(b"b")
        assert fast.read(1) == b"a" and fast.read(1) == b"b"
        # Reader 1 has read nothing: both slots are still its, so a third message must wait.
        with pytest.raises(TimeoutError, match=r"readers \[1\]"):
            ch.write(b"c", timeout_s=0.2)
        assert slow.read(1) == b"a"
        ch.write(b"c", timeout_s=1)   # the failed attempt wrote nothing; retrying is safe
        assert [slow.read(1), slow.read(1), fast.read(1)] == [b"b", b"c", b"c"]
        fast.close()
        slow.close()


def test_roles_and_bad_arguments():
    with ShmBroadcast.create(num_readers=1) as ch:
        with pytest.raises(ValueError, match="reader_index=1"):
            ShmBroadcast.attach(ch.handle(), 1)
        with pytest.raises(RuntimeError, match="cannot read"):
            ch.read(0.1)
        reader = ShmBroadcast.attach(ch.handle(), 0)
        with pytest.raises(RuntimeError, match="cannot write"):
            reader.write(b"x")
        reader.close()
    with pytest.raises(ValueError, match="num_slots=0"):
        ShmBroadcast.create(num_readers=1, num_slots=0)


def test_no_segment_left_after_close():
    before = my_segments()
    ch = ShmBroadcast.create(num_readers=2)
    assert ch.name in my_segments()
    reader = ShmBroadcast.attach(ch.handle(), 0)
    reader.close()
    assert ch.name in my_segments(), "a reader's close must not unlink the creator's segment"
    ch.close()
    ch.close()   # twice is fine
    assert my_segments() == before
    # Dropped without close(): the finalizer unlinks it too.
    ch = ShmBroadcast.create(num_readers=1)
    name = ch.name
    del ch
    assert name not in my_segments()
