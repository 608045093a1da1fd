"""The worker flags both sides share (proto/worker_flags.py): sizes with units, the attention backend, and the
command line a launcher passes on to the workers it starts."""

from __future__ import annotations

import argparse

import pytest

from proto.worker_flags import WORKER_FLAGS, add_worker_flags, parse_size, worker_argv

pytestmark = pytest.mark.unit


def test_sizes_take_units() -> None:
    assert [parse_size(t) for t in ("4GiB", "512MiB", "256KiB", "1e9", "1000", " 2kb ")] == [
        4 * 2**30, 512 * 2**20, 256 * 2**10, 10**9, 1000, 2000]  # fmt: skip
    with pytest.raises(ValueError):
        parse_size("lots")


def test_the_flags_a_launcher_passes_on_are_those_set() -> None:
    p = argparse.ArgumentParser()
    add_worker_flags(p)
    args = p.parse_args(["--kv-cache-memory", "16MiB", "--attention-backend", "my.module:Backend"])
    assert set(WORKER_FLAGS) <= set(vars(args))
    argv = worker_argv(args)
    assert argv[argv.index("--kv-cache-memory") + 1] == str(16 * 2**20)
    assert argv[argv.index("--attention-backend") + 1] == "my.module:Backend"
    assert p.parse_args(argv) == args, "what the launcher passes on parses back to the same flags"
    with pytest.raises(SystemExit):
        p.parse_args(["--attention-backend", "fastest"])
