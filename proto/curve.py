"""ZMQ CURVE keys for the scheduler ⇄ worker socket (`--zmq-curve-dir`).

The folder holds two key pairs in ZMQ's certificate format: `scheduler.key_secret` (the scheduler's, which
serves CURVE) and `worker.key_secret` (shared by the workers). The scheduler admits only clients whose public
key sits in the folder's `authorized/` subfolder; `ensure_keys` creates all of it once, private files 0600.
Copy the folder to every worker host. Encryption and client authentication, no pickle, nothing else to set up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import zmq
import zmq.auth

SERVER = "scheduler"
CLIENT = "worker"
AUTHORIZED = "authorized"


class CurveError(ValueError):
    """The CURVE folder is missing keys or holds unreadable ones."""


def ensure_keys(folder: str | Path) -> Path:
    """Create the folder's key pairs if missing (never overwrites); return the folder. A complete folder is left
    untouched, so it may be read-only (a Kubernetes Secret)."""
    root = Path(folder)
    complete = [root / f"{n}.key_secret" for n in (SERVER, CLIENT)] + [root / f"{SERVER}.key"]
    if all(p.is_file() for p in complete) and any((root / AUTHORIZED).glob("*.key")):
        return root
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    for name in (SERVER, CLIENT):
        if not (root / f"{name}.key_secret").is_file():
            public, secret = zmq.auth.create_certificates(str(root), name)
            os.chmod(secret, 0o600)
    authorized = root / AUTHORIZED
    authorized.mkdir(exist_ok=True)
    if not any(authorized.glob("*.key")):
        shutil.copy(root / f"{CLIENT}.key", authorized / f"{CLIENT}.key")
    return root


def _load(folder: Path, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = folder / (f"{name}.key_secret" if secret else f"{name}.key")
    if not path.is_file():
        raise CurveError(f"--zmq-curve-dir {folder}: {path.name} is missing (vllm-scheduler creates the keys)")
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise CurveError(f"--zmq-curve-dir {folder}: cannot read {path.name}: {exc}") from exc


def configure_server(sock: zmq.Socket, folder: str | Path) -> Path:
    """Make `sock` a CURVE server with the scheduler's key pair; return the folder of authorized client keys."""
    root = Path(folder)
    public, secret = _load(root, SERVER, secret=True)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    return root / AUTHORIZED


def configure_client(sock: zmq.Socket, folder: str | Path) -> None:
    """Make `sock` a CURVE client with the worker key pair, trusting only the scheduler's public key."""
    root = Path(folder)
    public, secret = _load(root, CLIENT, secret=True)
    server_public, _ = _load(root, SERVER, secret=False)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public
