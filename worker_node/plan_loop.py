"""The worker's serving loop: this thread owns the ZMQ socket, a step thread runs the plans.

Because the socket thread never blocks on the model, it answers heartbeats during long steps, notices a
scheduler that is gone (and exits cleanly), and drops anything malformed without disturbing the step (counted, and
logged at a bounded rate: proto/drop_log.py).
A plan that fails on the worker is answered with a StepError instead of killing the process — unless a collective
failed (WorldBroken): then the process exits with EXIT_WORLD_BROKEN, the scheduler sees the rank lost, and every
rank of the world restarts (an answer would leave the world half-broken and the request failed). A collective that
fails while the scheduler's link is down is the scheduler's death seen through the peers (each rank gives up on its
own clock): that rank exits cleanly, like the others.

A scheduler is gone when it has been silent for twice its heartbeat timeout *and* the connection is down:
libzmq's own heartbeats keep the connection up while the scheduler process lives, however busy its event loop.
A worker that leaves while a step still runs (blocked in a collective with a peer cut off by the network) exits at
once instead of waiting out the collective: only then can its replacement rejoin.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import queue
import threading
import time
from typing import Callable, NoReturn, Protocol, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from proto.drop_log import DropLog
from proto.wire import Heartbeat, Interrupt, Message, Shutdown, StepError, StepPlan, decode, encode
from worker_node.faults import RequestFault
from worker_node.runtime.parallel import WorldBroken
from worker_node.step_overlap import Launched, may_follow

logger = logging.getLogger(__name__)
R = TypeVar("R")


# The scheduler declares a silent worker lost after its heartbeat timeout; a worker gives a silent scheduler
# longer, so that a loaded machine makes the scheduler (the one that decides) act first.
SILENCE_FACTOR = 2.0
EXIT_WORLD_BROKEN = 3  # the exit status of a worker whose torch.distributed world broke under a step
RETRY_SEND_S = 0.05  # how soon an answer the socket would not take is tried again (besides its POLLOUT)
STEP_GRACE_S = 1.0  # how long a leaving worker lets a running step finish before it exits without it


class Overlapping(Protocol):
    """A runner whose steps may overlap (worker_node/step_overlap.py): ModelRunner."""

    def launch(self, plan: StepPlan) -> Launched: ...


class StepThread(threading.Thread):
    """Runs plans one at a time, in arrival order, and hands each reply to `deliver` (from this thread), in order.

    With `overlap`, a launched step whose tokens are still on the device is finished only after the next plan is
    launched, when that plan is already waiting and may follow it; with none waiting, at once."""

    def __init__(
        self,
        rank: int,
        execute: Callable[[StepPlan], Message],
        deliver: Callable[[Message], None],
        setup: Callable[[], None] = lambda: None,
        scheduler_lost: Callable[[], bool] = lambda: False,
        overlap: Overlapping | None = None,
    ) -> None:
        super().__init__(name=f"step-{rank}", daemon=True)  # a hung step must not keep the process from exiting
        self.rank = rank
        self.execute = execute
        self.deliver = deliver
        self.setup = setup
        self.scheduler_lost = scheduler_lost
        self.overlap = overlap
        self.inbox: queue.Queue[StepPlan | None] = queue.Queue()

    def run(self) -> None:
        self.setup()
        if self.overlap is not None:
            self._run_overlapped(self.overlap)
            return
        while (plan := self.inbox.get()) is not None:
            self.deliver(self._guarded(plan.step_id, functools.partial(self.execute, plan)))

    def _run_overlapped(self, runner: Overlapping) -> None:
        held: Launched | None = None  # launched, its tokens still on the device
        while True:
            if held is None:
                plan = self.inbox.get()
            else:
                try:
                    plan = self.inbox.get_nowait()
                except queue.Empty:  # nothing to launch behind it: finish it now
                    self._finish(held)
                    held = None
                    continue
            if plan is None:
                break
            if held is not None and not may_follow(plan):
                self._finish(held)
                held = None
            launched = self._guarded(plan.step_id, functools.partial(runner.launch, plan))
            if held is not None:  # its tokens reach the host while the device runs the plan just launched
                self._finish(held)
                held = None
            if not isinstance(launched, Launched):
                self.deliver(launched)  # the StepError of a plan that could not be launched
            elif launched.overlaps:
                held = launched
            else:
                self._finish(launched)
        if held is not None:
            self._finish(held)

    def _finish(self, launched: Launched) -> None:
        self.deliver(self._guarded(launched.step_id, launched.finish))

    def _guarded(self, step_id: int, work: Callable[[], R]) -> R | StepError:
        """`work`'s outcome, or the StepError of a step this worker cannot run (it stays alive); a collective
        that failed leaves the world (`_leave_broken`)."""
        try:
            return work()
        except WorldBroken as exc:
            self._leave_broken(step_id, exc)
        except RequestFault as exc:  # some requests' own fault: they fail alone
            logger.warning("step %d: request(s) %s cannot run: %s", step_id, exc.handles, exc.reason)
            return StepError(step_id, self.rank, exc.reason, handles=exc.handles, adapters=exc.adapters)
        except Exception as exc:  # a plan this worker cannot run: say so, stay alive
            logger.exception("step %d failed", step_id)
            return StepError(step_id, self.rank, f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self.inbox.put(None)

    def _leave_broken(self, step_id: int, exc: WorldBroken) -> NoReturn:
        """A collective failed. With the scheduler's link down, the peers most likely left because the scheduler
        is gone (each rank notices on its own clock): this rank leaves too, cleanly. Otherwise the world itself
        broke and the status tells the scheduler to restart every rank."""
        if self.scheduler_lost():
            logger.error("step %d: a collective failed (%s) with the scheduler gone; exiting", step_id, exc)
            code = 0
        else:
            logger.critical("step %d: a collective failed (%s); leaving so the world restarts", step_id, exc)
            code = EXIT_WORLD_BROKEN
        logging.shutdown()
        os._exit(code)


class PlanLoop:
    def __init__(
        self,
        sock: zmq.Socket,
        rank: int,
        execute: Callable[[StepPlan], Message],
        initial_timeout: float,
        setup: Callable[[], None] = lambda: None,
        interrupt: Callable[[int, int], None] = lambda first, last: None,
        overlap: Overlapping | None = None,
        drops: DropLog | None = None,
    ) -> None:
        self.sock = sock
        self.overlap = overlap
        # What the socket dropped (malformed, unexpected): counted, logged at a bounded rate (proto/drop_log.py).
        self.drops = drops if drops is not None else DropLog("scheduler", logger)
        self.rank = rank
        self.execute = execute
        self.timeout = initial_timeout  # until the scheduler's first heartbeat says otherwise
        self.setup = setup
        self.interrupt = interrupt  # told at once, from this thread: the step thread may be mid-forward
        self._holding = False  # an answer waits for the socket to take it
        self._connected = True  # the link to the scheduler (the Assignment came over it)

    def run(self) -> int:
        """Serve plans until Shutdown (0) or until the scheduler is silent for twice its heartbeat timeout (0); when
        a step is still running then, the process exits (0) here."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        outbox: collections.deque[Message] = collections.deque()

        def deliver(reply: Message) -> None:
            outbox.append(reply)
            os.write(wake_w, b"\0")

        steps = StepThread(self.rank, self.execute, deliver, self.setup, lambda: not self._connected, self.overlap)
        steps.start()
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_heard = next_beat = time.monotonic()
        seq = 0
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    seq += 1
                    self._send(Heartbeat(self.rank, seq, self.timeout))
                    next_beat = now + self.timeout / 4
                give_up = last_heard + SILENCE_FACTOR * self.timeout
                wait = min(next_beat, give_up) - now
                if outbox:  # answers the socket would not take yet: wake when it can, and look again soon
                    wait = min(wait, RETRY_SEND_S)
                events = dict(poller.poll(int(max(0.0, wait) * 1000) + 1))
                if wake_r in events:
                    _drain_pipe(wake_r)
                self._flush(outbox)
                poller.modify(self.sock, zmq.POLLIN | (zmq.POLLOUT if outbox else 0))
                if monitor in events:
                    self._connected = _connection_events(monitor, self._connected)
                if events.get(self.sock, 0) & zmq.POLLIN:
                    for message in self._recv_all():
                        last_heard = time.monotonic()
                        if isinstance(message, Shutdown):
                            logger.info("shutting down: %s", message.reason)
                            return 0
                        if isinstance(message, Heartbeat):
                            self.timeout = message.timeout_s
                            next_beat = min(next_beat, last_heard + self.timeout / 4)
                        elif isinstance(message, StepPlan):
                            steps.inbox.put(message)
                        elif isinstance(message, Interrupt):
                            self.interrupt(message.first_step_id, message.last_step_id)
                        elif message is not None:
                            self.drops.drop("an unexpected %s", type(message).__name__)
                elif not events and time.monotonic() > give_up and not self._connected:  # after the poll: none queued
                    logger.error("no word from the scheduler for %.1f s; exiting", time.monotonic() - last_heard)
                    return 0
        finally:
            self.drops.flush()
            self.sock.disable_monitor()
            monitor.close(linger=0)
            steps.stop()
            steps.join(timeout=STEP_GRACE_S)
            if steps.is_alive():
                _leave_with_a_step_running(steps.rank)
            os.close(wake_r)
            os.close(wake_w)

    def _recv_all(self) -> list[Message | None]:
        """Every message waiting on the socket; None for each one that was dropped as malformed."""
        out: list[Message | None] = []
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(decode_or_none(data, self.drops))

    def _flush(self, outbox: collections.deque[Message]) -> None:
        """Send the step thread's answers in order. One the socket would block on stays first in the outbox: a
        dropped StepResult would leave the scheduler waiting out its step deadline and losing a healthy rank."""
        while outbox:
            if not self._send(outbox[0], drop=False):
                if not self._holding:
                    logger.warning("the scheduler is not taking messages; holding %d answer(s)", len(outbox))
                self._holding = True
                return
            outbox.popleft()
        self._holding = False

    def _send(self, message: Message, drop: bool = True) -> bool:
        """Send without blocking; False when the socket would block (with `drop`, the message is given up: a
        heartbeat, which the next one replaces)."""
        try:
            self.sock.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            if drop:
                logger.warning("the scheduler is not taking messages; dropped a %s", type(message).__name__)
            return False
        return True


def _leave_with_a_step_running(rank: int) -> NoReturn:
    """This worker is leaving (told to, its scheduler gone, or a signal) while a step still runs: most likely blocked
    in a collective whose peer is cut off (a network partition), where gloo waits out --distributed-timeout (300 s)
    and so does the process group's teardown at interpreter exit. Nothing is left to save, and its supervisor's
    replacement can rejoin only once this process is gone: exit now."""
    logger.warning("rank %d: a step is still running (a collective waiting for a peer?); exiting without it", rank)
    logging.shutdown()
    os._exit(0)


def decode_or_none(data: bytes, drops: DropLog) -> Message | None:
    """The message, or None (counted in `drops`) when it is malformed, oversized or of an unknown kind."""
    try:
        return decode(data)
    except Exception as exc:  # WireError, or anything a hostile payload could provoke: never fatal
        drops.drop("a malformed message (%d bytes): %s", len(data), exc)
        return None


def _connection_events(monitor: zmq.Socket, connected: bool) -> bool:
    """Read the socket monitor's pending events; whether the connection to the scheduler is up after them."""
    while monitor.poll(0):
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_CONNECTED:
            connected = True
        elif event == zmq.EVENT_DISCONNECTED:
            connected = False
            logger.warning("the connection to the scheduler dropped")
    return connected


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
