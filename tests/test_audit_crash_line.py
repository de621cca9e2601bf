"""A crash is named by the exception the rank that raised ended with, not by the hang it left
on the ranks still waiting for it; a bare ``assert`` is named by its statement."""

import pytest

pytest.importorskip("megatron.core")

from shardcheck.megatron.audit.outcome import first_line  # noqa: E402
from shardcheck.parity.pool import PoolFailure  # noqa: E402

FRAME = '  File "/x/megatron/core/models/common/language_module/language_module.py", line 497, in tie\n'
HANG = "hang: ranks [0] did not finish within 30 s; the pool was restarted"


def _raised(source: str, exception: str, hang: str = HANG) -> PoolFailure:
    traceback = f"Traceback (most recent call last):\n{FRAME}    {source}\n    ^^^^^^\n{exception}\n"
    return PoolFailure("error", f"rank 1 raised:\n{traceback}{hang}\nlast collective entered: rank 0: #2",
                       {1: traceback})


def test_the_raising_ranks_exception_names_the_crash_not_the_hang_it_left():
    failure = _raised("x = a + b", "RuntimeError: The size of tensor a (32) must match the size of tensor b (16)")
    assert first_line(failure) == "RuntimeError: The size of tensor a (32) must match the size of tensor b (16)"


def test_an_assertion_that_only_prints_values_is_named_by_its_statement():
    failure = _raised("assert key not in state_dict, state_dict.keys()", "AssertionError: dict_keys(['a', 'b'])")
    assert first_line(failure) == "AssertionError: assert key not in state_dict, state_dict.keys()"
    bare = _raised("assert x == y", "AssertionError")
    assert first_line(bare) == "AssertionError: assert x == y"


@pytest.mark.parametrize("message", ["the pipeline needs an even number of layers", "3 is not divisible by 2"])
def test_an_assertion_with_a_message_in_words_keeps_its_message(message):
    failure = _raised(f"assert ok, {message!r}", f"AssertionError: {message}")
    assert first_line(failure) == f"AssertionError: {message}"


def test_a_hang_without_a_raise_is_named_by_the_hang():
    failure = PoolFailure("hang", f"{HANG}\nlast collective entered: rank 0: #2 all_reduce")
    assert first_line(failure) == HANG
