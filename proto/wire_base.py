"""The building blocks of the scheduler ⇄ worker messages (proto/wire.py): a Record is an array of its fields in
order, a Message a Record whose kind (`Kind`) is its tag; `WireError` names what a malformed one got wrong."""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated

import msgspec
from msgspec import Meta

Count = Annotated[int, Meta(ge=0)]
Handle = Annotated[int, Meta(ge=0)]  # a request's id on the wire
BlockPair = tuple[int, int]


class WireError(ValueError):
    """A message that is not a valid minivllm wire message."""


class Kind(IntEnum):
    HELLO = 1
    ASSIGNMENT = 2
    READY = 3
    PLAN = 4
    RESULT = 5
    SHUTDOWN = 6
    HEARTBEAT = 7
    STEP_ERROR = 8
    INTERRUPT = 9


class Record(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A part of a message: an array of its fields in order."""


class Message(Record):
    """A whole message: its kind comes first on the wire."""

    def check(self) -> None:
        """Rules across fields, checked where the message arrives (raise WireError); types and bounds are the
        fields' own."""
