"""tests/conftest.py's torch_threads_restored_per_test: a torch thread count that one test sets is not the count the
next test of its module finds. Two tests, in this order, in one test process (their own xdist group)."""
import pytest
import torch

pytestmark = pytest.mark.xdist_group("tests/test_torch_threads.py")

FOUND: list[int] = []   # the count the first test found


def test_a_test_sets_the_thread_count():
    FOUND.append(torch.get_num_threads())
    other = 3 if FOUND[0] != 3 else 2
    torch.set_num_threads(other)
    assert torch.get_num_threads() == other


def test_the_next_test_finds_the_count_as_it_was():
    assert FOUND, "runs after test_a_test_sets_the_thread_count, in the same process"
    assert torch.get_num_threads() == FOUND[-1]
