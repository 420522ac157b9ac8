"""The wire's JSON decoders (protocol/json_codecs.py): what the server and a bundle write reads back, the older array
form of a step record too, and what is not one is a ValueError."""
import msgspec
import pytest

from devharness.protocol.json_codecs import engine_stats, read_history, read_ledger
from devharness.protocol.messages import Ledger, LedgerEntry, LedgerGroup, StepRecord

LEDGER = Ledger(rank=1, groups=[LedgerGroup("0", "default_pg", [0, 1])],
                entries=[LedgerEntry(3, "0", "all_reduce", 1, 0, None, 4, 2, "attention all_reduce", [8, 64],
                                     "float32", [8, 64], "float32", "completed", 10, 11, 12)], count=1, capacity=64)


def test_a_ledger_reads_back_and_a_cut_one_is_refused():
    data = msgspec.json.encode(LEDGER)
    assert read_ledger(data) == LEDGER
    with pytest.raises(ValueError, match="truncated"):
        read_ledger(data[:-9])
    with pytest.raises(ValueError, match=r"Expected `int`, got `str` - at `\$.rank`"):
        read_ledger(b'{"rank": "one"}')


def test_a_history_reads_records_in_either_form():
    body = b'{"rank": 0, "steps": [{"step": 5, "phases": {"forward": 1.5}}, [6, {"sample": 0.5}, 2.0, 8]]}'
    assert read_history(body) == [StepRecord(5, {"forward": 1.5}), StepRecord(6, {"sample": 0.5}, 2.0, 8)]
    with pytest.raises(ValueError):
        read_history(b'{"steps": [[6]]}')


def test_engine_stats_keep_the_fields_the_wire_names():
    stats = engine_stats({"step": 4, "num_running": 2, "num_generated_tokens_total": 99})
    assert (stats.step, stats.num_running, stats.state) == (4, 2, "running")
    with pytest.raises(ValueError):
        engine_stats({"step": "four"})
