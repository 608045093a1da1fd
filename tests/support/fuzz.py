"""Fuzzing the decoders that face a socket (tests/proto/test_*_wire.py, test_wire.py): what a hostile peer can send,
as hypothesis strategies, and the check each decoder must pass on it.

Random bytes rarely get past msgpack's first byte, so most inputs start from valid frames: bytes flipped, set to
msgpack's length headers (a frame that claims gigabytes), cut short or spliced (`mutated`), and valid frames with one
value changed, deleted or inserted (`with_a_field_changed`), which reach the type, bound and cross-field checks.
`refused_within_bounds` runs one decode: it returns or raises the decoder's own error type, and its peak allocation
stays linear in the input (a header that claims 4 GiB must not be believed).
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import msgpack
from hypothesis import strategies as st

# msgpack's headers that say how long what follows is (bin, str, array, map, ext of 8/16/32-bit lengths), and the
# bytes around type boundaries: a flipped byte lands on these far more often than chance would have it.
HEADERS = bytes([0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xC1, 0xC0, 0x90, 0x80])
EDGES = bytes([0x00, 0x7F, 0x80, 0xFF, 0xCF, 0xD3, 0xCB])
PER_INPUT_BYTE = 256  # the most a decode may allocate per byte of input (a list of empty lists: ~64)
BASE_BYTES = 256 * 1024  # besides: error messages, msgspec's caches


def msgpack_values() -> st.SearchStrategy[Any]:
    """Any small msgpack value: scalars at their edges, bytes, text, and lists and maps of them (kept small: drawing
    values, not decoding them, is what a fuzz test spends its time on)."""
    scalars = (
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
        | st.binary(max_size=24) | st.text(max_size=12)
    )  # fmt: skip
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.integers(-4, 4) | st.text(max_size=4), inner,
                                                                     max_size=3),
        max_leaves=8,
    )  # fmt: skip


VALUES = msgpack_values()  # built once: a strategy is validated when first drawn from, which costs more than a draw


@st.composite
def mutated(draw: st.DrawFn, frames: Sequence[bytes]) -> bytes:
    """One of `frames` with a few bytes flipped, set to a length header or an edge, cut short, or spliced."""
    data = bytearray(draw(st.sampled_from(frames)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        how = draw(st.sampled_from(["flip", "header", "edge", "cut", "insert", "repeat"]))
        if how == "cut":
            del data[at:]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif how == "repeat":
            data[at:at] = data[at : at + draw(st.integers(1, 16))]
        elif data:
            value = {"flip": data[at] ^ (1 << draw(st.integers(0, 7))), "header": draw(st.sampled_from(HEADERS)),
                     "edge": draw(st.sampled_from(EDGES))}[how]  # fmt: skip
            data[at] = value
            if how == "header":  # a length after it: as often huge as small
                data[at + 1 : at + 1] = draw(st.sampled_from([b"\xff\xff\xff\xff", b"\x7f\xff", b"\x00\x10"]))
    return bytes(data)


INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]) | st.integers(-8, 70_000)


def _like(value: Any) -> st.SearchStrategy[Any]:
    """Another value of `value`'s type (a length, a count, bytes of another size): what gets past the type checks to
    the bounds and the message's own rules."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return INTS
    if isinstance(value, float):
        return st.floats()
    if isinstance(value, bytes):
        return st.binary(max_size=40)
    if isinstance(value, str):
        return st.text(max_size=20)
    return VALUES


@st.composite
def with_a_field_changed(draw: st.DrawFn, values: Sequence[Any]) -> bytes:
    """One of `values` (valid frames, msgpack-decoded: `unpacked`) with one value anywhere in it (each as likely)
    changed: most often to another of its type, else to any value, deleted from its list or map, or preceded in its
    list by an inserted value."""
    frame = _copy(draw(st.sampled_from(values)))
    places = list(_places(frame))
    if not places:
        return msgpack.packb(frame, use_bin_type=True)
    holder, key = draw(st.sampled_from(places))
    how = draw(st.sampled_from(["like", "like", "like", "any", "delete", "insert"]))
    if how == "delete":
        del holder[key]
    elif how == "insert" and isinstance(holder, list):
        holder.insert(key, draw(VALUES))
    else:
        holder[key] = draw(_like(holder[key]) if how == "like" else VALUES)
    return msgpack.packb(frame, use_bin_type=True)


def _places(value: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container, index or key) in `value`, depth first."""
    keys = range(len(value)) if isinstance(value, list) else list(value) if isinstance(value, dict) else []
    for key in keys:
        yield value, key
        yield from _places(value[key])


def unpacked(frames: Sequence[bytes]) -> list[Any]:
    """Valid frames as msgpack values, for `with_a_field_changed` (maps of integer keys included)."""
    return [msgpack.unpackb(f, strict_map_key=False) for f in frames]


Decoders = Sequence[tuple[Callable[[bytes], object], Sequence[bytes]]]  # each decoder with valid frames of its own


def random_or_mutated(decoders: Decoders) -> st.SearchStrategy[tuple[Callable[[bytes], object], bytes]]:
    """A decoder and input for it: random bytes, or one of its valid frames `mutated`."""
    return st.sampled_from(decoders).flatmap(
        lambda d: st.tuples(st.just(d[0]), st.binary(max_size=256) | mutated(d[1]))
    )


def field_changed(decoders: Decoders) -> st.SearchStrategy[tuple[Callable[[bytes], object], bytes]]:
    """A decoder and one of its valid frames `with_a_field_changed`."""
    return st.sampled_from(decoders).flatmap(lambda d: st.tuples(st.just(d[0]), with_a_field_changed(unpacked(d[1]))))


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


T = TypeVar("T")


def refused_within_bounds(decode: Callable[[bytes], T], data: bytes, error: type[Exception]) -> T | None:
    """`decode(data)`: the message, or None when it raised `error` (anything else propagates); its peak allocation
    must stay within PER_INPUT_BYTE per input byte (plus BASE_BYTES)."""
    tracemalloc.start()
    try:
        return decode(data)
    except error:
        return None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        limit = BASE_BYTES + PER_INPUT_BYTE * len(data)
        assert peak <= limit, f"decoding {len(data)} bytes allocated {peak} bytes (limit {limit})"
