"""CURVE keys (proto/curve.py): made once with private secrets, never overwritten, and a complete folder is left
exactly as it is (it may be a read-only Kubernetes Secret)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from proto.curve import AUTHORIZED, CLIENT, SERVER, CurveError, configure_server, ensure_keys

pytestmark = pytest.mark.unit


def test_keys_are_made_once_with_private_secrets(tmp_path: Path) -> None:
    keys = ensure_keys(tmp_path / "keys")
    for name in (SERVER, CLIENT):
        assert (keys / f"{name}.key_secret").stat().st_mode & 0o077 == 0, "secrets are the owner's alone"
    assert (keys / AUTHORIZED / f"{CLIENT}.key").read_bytes() == (keys / f"{CLIENT}.key").read_bytes()
    secret = (keys / f"{SERVER}.key_secret").read_bytes()
    (keys / AUTHORIZED / f"{CLIENT}.key").unlink()  # incomplete: only what is missing is made again
    ensure_keys(keys)
    assert (keys / f"{SERVER}.key_secret").read_bytes() == secret and (keys / AUTHORIZED / f"{CLIENT}.key").exists()


def test_a_complete_key_folder_is_left_untouched(tmp_path: Path) -> None:
    """A Kubernetes Secret mount is read-only: the scheduler must use complete keys there without chmod or mkdir."""
    keys = ensure_keys(tmp_path / "keys")
    os.chmod(keys, 0o750)
    before = {p: (p.stat().st_mode, p.read_bytes()) for p in keys.rglob("*") if p.is_file()}
    assert ensure_keys(keys) == keys
    assert keys.stat().st_mode & 0o777 == 0o750
    assert {p: (p.stat().st_mode, p.read_bytes()) for p in keys.rglob("*") if p.is_file()} == before


def test_a_folder_without_keys_is_a_precise_error(tmp_path: Path) -> None:
    ctx = zmq.Context()
    try:
        with pytest.raises(CurveError, match="scheduler.key_secret is missing"):
            configure_server(ctx.socket(zmq.ROUTER), tmp_path)
    finally:
        ctx.destroy(linger=0)
