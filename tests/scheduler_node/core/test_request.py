"""StopConditions: the one finish rule, applied to sampled tokens by Request.append_tokens."""

from __future__ import annotations

import pytest

from proto.wire import SamplingOptions
from scheduler_node.core.request import Request, Status, StopConditions

pytestmark = pytest.mark.unit

EOS, STOP = 2, 3


def request(max_tokens: int, min_tokens: int = 0, prompt: int = 4) -> Request:
    stop = StopConditions(max_tokens, frozenset({EOS}), frozenset({STOP}), min_tokens)
    return Request("r", list(range(10, 10 + prompt)), SamplingOptions(), stop)


@pytest.mark.parametrize(
    ("req", "tokens", "kept", "status"),
    [
        (request(8), [5, 6], [5, 6], Status.WAITING),  # not ended: the status is the scheduler's
        (request(8), [5, EOS, 6], [5, EOS], Status.FINISHED_STOPPED),
        (request(8), [STOP], [STOP], Status.FINISHED_STOPPED),
        (request(8, min_tokens=2), [EOS, STOP, 5, EOS], [EOS, STOP, 5], Status.FINISHED_LENGTH),  # max_model_len
        (request(8, min_tokens=1), [EOS, STOP], [EOS, STOP], Status.FINISHED_STOPPED),  # past min_tokens
        (request(2), [5, 6, 7], [5, 6], Status.FINISHED_LENGTH),
    ],
)
def test_the_token_that_ends_the_output_is_the_last_kept(
    req: Request, tokens: list[int], kept: list[int], status: Status
) -> None:
    assert req.append_tokens(tokens, max_model_len=7) == kept
    assert req.status is status and req.output_token_ids == kept
    assert req.stopped_by_token is (status is Status.FINISHED_STOPPED)


def test_stop_strings_follow_the_same_min_tokens() -> None:
    stop = StopConditions(8, min_tokens=2)
    assert [stop.may_stop(n) for n in (1, 2, 3)] == [False, False, True]
