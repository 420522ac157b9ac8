"""Control calls are dispatched through one explicit table (worker/worker.py's CONTROL_HANDLERS), with their fields
as keyword arguments: every call type of the wire has exactly one handler, whose parameters are the call's fields."""
import inspect

import msgspec

from devharness.protocol.messages import CONTROL_CALLS, ArmRequestFault, InitKvCache
from devharness.worker.worker import CONTROL_HANDLERS, Worker


def test_every_control_call_has_one_handler_taking_its_fields_by_name():
    assert set(CONTROL_HANDLERS) == set(CONTROL_CALLS)
    for call, handler in CONTROL_HANDLERS.items():
        params = [p for p in inspect.signature(handler).parameters if p != "self"]
        assert params == list(call.__struct_fields__), (call.__name__, handler.__name__, params)
        assert getattr(Worker, handler.__name__) is handler


def test_a_call_reaches_its_handler_with_its_fields_by_name():
    seen = []

    class Probe:
        pass

    probe = Probe()
    original = dict(CONTROL_HANDLERS)
    try:
        CONTROL_HANDLERS[ArmRequestFault] = lambda self, request_id, where: seen.append((self, request_id, where))
        CONTROL_HANDLERS[InitKvCache] = lambda self, num_blocks: seen.append((self, num_blocks))
        Worker.control(probe, ArmRequestFault(request_id="r1", where="sample"))
        Worker.control(probe, msgspec.msgpack.decode(msgspec.msgpack.encode(InitKvCache(num_blocks=7)),
                                                     type=InitKvCache))
    finally:
        CONTROL_HANDLERS.clear()
        CONTROL_HANDLERS.update(original)
    assert seen == [(probe, "r1", "sample"), (probe, 7)]
