"""Same-host KV staging: a buffer the producer fills with a pull's blocks and the consumer maps, so a pull between
two processes of one host moves no KV byte through a socket (the socket carries the buffer's handle only).

One mechanism, two ways to make and open the buffer, both seen as a flat uint8 tensor:
- CPU (`shm`): a POSIX shared-memory file in /dev/shm, created O_EXCL with mode 0600 under a random 128-bit name
  (unguessable: the name is only ever sent over the authenticated KV socket), mapped by both sides. A consumer
  opens only names of this module's form, never a path.
- CUDA (`cuda`): a device tensor whose CUDA IPC handle (`UntypedStorage._share_cuda_()`: ints, bytes and a bool,
  sent in msgpack, never pickled) the consumer opens with `UntypedStorage._new_shared_cuda`; its copy into its own
  blocks is device to device. Torch's IPC reference counter keeps the memory alive while a consumer holds it, so
  the producer may drop its reference at any time.

Who owns what: the producer makes a `Staging` per pull and frees it (`Staging.free`: unlink the file, drop the
mapping) on the lease's revoke or expiry and at shutdown, and on the consumer's ack (or renames it, `Staging.rename`,
to keep it for the next pull: see exporter.py); the consumer only maps it for the duration of its
copy (`open_staging`). `host_id` says whether two processes may share one (same kernel boot and
host name).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "minivllm-kv-"
_SHM_NAME = re.compile(rf"{SHM_PREFIX}[0-9a-f]{{32}}")  # fullmatch: `$` would pass a final newline
ALIGN = 64  # every frame starts at a multiple of this: a uint8 slice views as any cache dtype (and coalesces)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

Handle = list[bytes | int | bool]  # msgpack-able: [the file's name] or CUDA's IPC handle


class StagingError(OSError):
    """A staging buffer that cannot be made or opened (the pull falls back to frames over the socket)."""


def host_id() -> str:
    """This host's identity for same-host pairing: its name and the kernel's boot id ("" when the boot id is not
    readable: then no pull is treated as same-host)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}" if boot else ""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(eq=False)
class Staging:
    """A producer's buffer for one pull: `tensor` (flat uint8) to fill, `handle` for the consumer to open it."""

    kind: str  # "shm" or "cuda"
    tensor: torch.Tensor
    handle: Handle
    size: int
    _mapping: mmap.mmap | None = field(default=None, repr=False)
    _path: Path | None = field(default=None, repr=False)

    def rename(self) -> None:
        """A new random name for a /dev/shm buffer kept for another pull: whoever knew the old one cannot open it."""
        if self._path is None:
            raise StagingError(f"a {self.kind} staging has no name")
        name = SHM_PREFIX + secrets.token_hex(16)
        os.rename(self._path, SHM_DIR / name)
        self._path, self.handle = SHM_DIR / name, [name.encode()]

    def free(self) -> None:
        """Unlink and unmap (idempotent). The consumer's mapping, if any, stays valid until it closes it."""
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a view of the tensor is still alive somewhere: the GC unmaps it later
                pass
            self._mapping = None


def make_staging(size: int, device: torch.device) -> Staging:
    """A staging buffer of `size` bytes for blocks of a cache on `device`; StagingError when it cannot be made."""
    if size < 1:
        raise StagingError(f"a staging buffer of {size} bytes")
    if device.type == "cuda":
        try:
            tensor = torch.empty(size, dtype=torch.uint8, device=device)
            handle = list(tensor.untyped_storage()._share_cuda_())
        except RuntimeError as exc:
            raise StagingError(f"no CUDA IPC staging: {exc}") from exc
        return Staging("cuda", tensor, handle, size)
    if device.type != "cpu":
        raise StagingError(f"no staging for a cache on {device.type}")
    name = SHM_PREFIX + secrets.token_hex(16)
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise StagingError(f"no shared-memory staging in {SHM_DIR}: {exc.strerror or exc}") from exc
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise StagingError(f"no shared-memory staging of {size} bytes: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    return Staging("shm", torch.frombuffer(mapping, dtype=torch.uint8), [name.encode()], size, mapping, path)


@contextmanager
def open_staging(kind: str, handle: Handle, size: int, device: torch.device) -> Iterator[torch.Tensor]:
    """The producer's staging buffer as a flat uint8 tensor of `size` bytes, for the duration of the block (a CUDA
    one on the device it lives on). StagingError when it cannot be opened here, or the handle is not well formed."""
    if kind == "cuda":
        yield _open_cuda(handle, size)
        return
    name = handle[0].decode("ascii", "replace") if len(handle) == 1 and isinstance(handle[0], bytes) else ""
    if kind != "shm" or not _SHM_NAME.fullmatch(name):
        raise StagingError(f"not a staging handle: {kind} {handle!r:.80}")
    if device.type != "cpu":
        raise StagingError(f"a shared-memory staging for a cache on {device.type}")
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR)
    except OSError as exc:
        raise StagingError(f"cannot open the staging {name}: {exc.strerror or exc}") from exc
    try:
        if os.fstat(fd).st_size < size:
            raise StagingError(f"the staging {name} is smaller than {size} bytes")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    try:
        yield tensor
    finally:
        del tensor
        try:
            mapping.close()
        except BufferError:  # a caller kept a view: the GC unmaps it later
            pass


def _open_cuda(handle: Handle, size: int) -> torch.Tensor:
    kinds = (int, bytes, int, int, bytes, int, bytes, bool)  # what _share_cuda_ returns
    if len(handle) != len(kinds) or not all(isinstance(h, k) for h, k in zip(handle, kinds, strict=True)):
        raise StagingError(f"not a CUDA IPC handle: {handle!r:.80}")
    try:
        torch.cuda._lazy_init()  # type: ignore[no-untyped-call]  # as torch's own rebuild_cuda_tensor does
        storage = torch.UntypedStorage._new_shared_cuda(*handle)  # type: ignore[attr-defined]
    except RuntimeError as exc:
        raise StagingError(f"cannot open the CUDA IPC staging: {exc}") from exc
    if storage.nbytes() < size:
        raise StagingError(f"the CUDA staging holds {storage.nbytes()} bytes, not {size}")
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (size,), (1,))
