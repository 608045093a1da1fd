"""torch.distributed for one worker: the rendezvous, its TP group, its PP neighbours, and the few collectives
the model and the runner need (all-reduce, gather to TP rank 0, send/recv of hidden states, token broadcast).

Pipeline stages hand hidden states on with blocking send/recv (gloo's send returns once the receiver posted its
recv). With several plans in flight that cannot deadlock: every rank runs the plans in the same order, stage s
only ever waits for stage s+1 to take plan N's states after finishing plan N-1, and stages share no collective.

Process groups are built directly (gloo on CPU, NCCL on CUDA) instead of through torch's global default group:
nothing is global, a worker joins only the groups it belongs to, and the gloo transport binds to the worker's
own address (`--local-address`), which is what lets workers on different hosts (or loopback addresses) meet.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from proto.parallel import ParallelLayout

logger = logging.getLogger(__name__)

_PP_TAG = 7  # send/recv tag of hidden states between stages


class RendezvousAborted(RuntimeError):
    """The worker left the rendezvous before the world was complete (its scheduler stopped or vanished)."""


class WorldBroken(RuntimeError):
    """A collective failed: a peer rank is gone or the transport between them broke. A torch.distributed world
    cannot heal, so the rank leaves (and the scheduler restarts every rank) instead of answering a StepError."""


def _wait(work: Any) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # gloo raises plain RuntimeErrors ("Connection closed by peer"); NCCL, DistErrors
        raise WorldBroken(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class ParallelRank:
    """Where one worker sits in the layout: what a model shard needs to know to build itself."""

    layout: ParallelLayout
    rank: int = 0

    @property
    def tp_size(self) -> int:
        return self.layout.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank_of(self.rank)

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.pipeline_parallel_size - 1

    @property
    def is_output_rank(self) -> bool:
        return self.rank == self.layout.output_rank


SINGLE = ParallelRank(ParallelLayout(1, 1), 0)


class Comm:
    """The collectives of one worker. With a world of one every method is a no-op on local tensors."""

    def __init__(
        self,
        where: ParallelRank,
        world: Any = None,
        tp: Any = None,
        device: torch.device | None = None,
        ranks_on_host: int = 1,
    ):
        self.where = where
        self.ranks_on_host = ranks_on_host  # ranks of this world on this host, this one included (they share RAM)
        self._world = world  # c10d backend over all ranks: PP send/recv, or (one stage) the token broadcast
        self._tp = tp  # c10d backend over this stage's TP ranks (None when T == 1)
        self._device = device or torch.device("cpu")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group (after a row-parallel layer and the vocab-parallel embedding)."""
        if self._tp is not None:
            _wait(self._tp.allreduce([x]))
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every TP rank's `x` along the last dim on TP rank 0; None on the others."""
        if self._tp is None:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        first = self.where.tp_rank == 0
        out = [[torch.empty_like(x) for _ in range(self.where.tp_size)]] if first else []
        _wait(self._tp.gather(out, [x], opts))
        return torch.cat(out[0], dim=-1) if first else None

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        if self._world is not None:
            _wait(self._world.send([x.contiguous()], self.where.rank + self.where.tp_size, _PP_TAG))

    def recv_from_previous_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self._device)
        if self._world is not None:
            _wait(self._world.recv([x], self.where.rank - self.where.tp_size, _PP_TAG))
        return x

    def share_sampled(self, tokens: list[int], count: int) -> list[int]:
        """The output rank's sampled tokens, on every rank (each TP rank embeds them next). One stage only:
        across stages they travel in the next plan, so that no stage waits for the last one."""
        if self._world is None or count == 0:
            return tokens
        mine = torch.tensor(tokens, dtype=torch.int64, device=self._device) if self.where.is_output_rank else None
        return self.share_sampled_on_device(mine, count).tolist()

    def share_sampled_on_device(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor:
        """`share_sampled` for tokens left where they were sampled (int64; None on the ranks that do not
        sample): on NCCL the broadcast is queued on the device, and the host waits for nothing."""
        if self._world is None or count == 0:
            assert tokens is not None, "a world of one samples on its only rank"
            return tokens
        if self.where.is_output_rank:
            assert tokens is not None
            t = tokens.to(torch.int64)
        else:
            t = torch.empty(count, dtype=torch.int64, device=self._device)
        opts = dist.BroadcastOptions()
        opts.rootRank = self.where.layout.output_rank
        _wait(self._world.broadcast([t], opts))
        return t

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag, set if it is set on any rank of the world (a sum over every rank)."""
        if self._world is None or not flags:
            return flags
        t = torch.tensor(flags, dtype=torch.int32, device=self._device)
        _wait(self._world.allreduce([t]))
        return [bool(v) for v in t.tolist()]

    def close(self) -> None:
        for group in (self._tp, self._world):
            if group is not None and hasattr(group, "shutdown"):
                try:
                    group.shutdown()
                except RuntimeError as exc:  # a peer already gone: nothing left to flush
                    logger.debug("process group shutdown: %s", exc)
        self._tp = self._world = None


def connect(
    where: ParallelRank,
    init_address: str,
    local_address: str,
    device: torch.device,
    timeout_s: float,
    give_up: Callable[[], str] = lambda: "",
) -> Comm:
    """Meet the other ranks at `init_address` (rank 0 opens the store there) and build this rank's groups.

    The world may take long to assemble (other hosts still loading), so the wait runs on a side thread while
    this one asks `give_up` twice a second for a reason to stop waiting (the scheduler said Shutdown, or its
    connection dropped): a worker whose scheduler is gone leaves instead of waiting out `timeout_s`.
    """
    if where.layout.world_size == 1:
        return Comm(where, device=device)
    outcome: list[Comm | BaseException] = []

    def join() -> None:
        try:
            outcome.append(_join(where, init_address, local_address, device, timeout_s))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    waiter = threading.Thread(target=join, name="rendezvous", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.5)
        if waiter.is_alive() and (why := give_up()):
            raise RendezvousAborted(why)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _join(where: ParallelRank, init_address: str, local_address: str, device: torch.device, timeout_s: float) -> Comm:
    layout = where.layout
    host, _, port = init_address.rpartition(":")
    timeout = datetime.timedelta(seconds=timeout_s)
    logger.info(
        "rank %d of %d (stage %d, TP rank %d) joining the rendezvous at %s",
        where.rank,
        layout.world_size,
        where.stage,
        where.tp_rank,
        init_address,
    )
    store = dist.TCPStore(
        host, int(port), layout.world_size, is_master=where.rank == 0, timeout=timeout, wait_for_workers=False
    )
    world = _backend(dist.PrefixStore("world/", store), where.rank, layout.world_size, device, local_address, timeout)
    tp = None
    if where.tp_size > 1:
        prefix = dist.PrefixStore(f"tp{where.stage}/", store)
        tp = _backend(prefix, where.tp_rank, where.tp_size, device, local_address, timeout)
    logger.info("rank %d joined a world of %d", where.rank, layout.world_size)
    return Comm(where, world, tp, device, _ranks_on_host(store, where.rank, layout.world_size))


def _ranks_on_host(store: Any, rank: int, world_size: int) -> int:
    """How many ranks of the world run on this host (each says its host name through the rendezvous store)."""
    host = socket.gethostname()
    store.set(f"host/{rank}", host)
    return sum(store.get(f"host/{r}").decode() == host for r in range(world_size))


def _backend(
    store: Any, rank: int, size: int, device: torch.device, local_address: str, timeout: datetime.timedelta
) -> Any:
    if device.type == "cuda":  # not exercised by the CPU test suite
        nccl = dist.ProcessGroupNCCL  # type: ignore[attr-defined]
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, rank, size, options)
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()  # type: ignore[attr-defined]
    if local_address:
        options._devices = [gloo.create_device(hostname=local_address)]
    else:
        options._devices = [gloo.create_default_device()]
    options._timeout = timeout
    return gloo(store, rank, size, options)
