"""Runs an `Engine` on its own thread and streams outputs to asyncio callers.

The engine is single-threaded by design (scheduler state, block tables). Callers on the
event loop never touch it: they post commands to an inbox that the engine thread drains
between steps, and receive outputs through per-request `OutputStream`s. A forward pass
therefore never blocks the event loop, and validation errors still reach the caller that
sent the bad request, as an exception from `generate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from model_service.engine.handle import EngineHandle
from model_service.engine.output_stream import OutputStream
from model_service.engine.sequence import RequestOutput
from model_service.errors import UnavailableError
from model_service.lora.control import ControlOp, ControlResult

log = logging.getLogger(__name__)


E = TypeVar("E", bound=EngineHandle)
MAX_FAILED_STEPS = 3  # engine steps raising in a row before the engine counts as lost
T = TypeVar("T")


class AsyncEngine(Generic[E]):
    def __init__(self, engine: E) -> None:
        self.engine = engine
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        self._adding: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[str]]] = {}
        self._stop = threading.Event()
        self._lost: Callable[[str], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="spindle-engine", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, **request: Any) -> AsyncIterator[RequestOutput]:
        """Add a request (same keywords as `Engine.add_request`) and yield its outputs until finished
        (those that came while the caller was busy merged into one: `generate_batches`).

        Closing the iterator early (client went away, deadline hit) aborts the request in the engine.
        """
        async with contextlib.aclosing(self.generate_batches(request_id, **request)) as batches:
            async for batch in batches:
                for out in batch:
                    yield out

    async def generate_batches(
        self, request_id: str, *, stream_interval: int = 1, **request: Any
    ) -> AsyncIterator[list[RequestOutput]]:
        """`generate`, but each item is every output that came since the caller last asked, merged
        into one (`OutputStream`): a consumer slower than the engine's steps (a busy server loop,
        a slow client) then sends one message for several steps instead of falling behind, and
        what waits for it is at most its request's output, however far behind it is.

        `stream_interval` N > 1 also holds outputs back until they add N tokens (vLLM's
        `--stream-interval`): a stream costs its senders and receivers one message per N tokens
        instead of one per step. The first token goes out at once (time to first token stays)
        and the last item carries whatever is left."""
        outputs = await self._add(request_id, request)
        finished, tokens = False, 0
        try:
            while not finished:
                hold = stream_interval if tokens and stream_interval > 1 else 0
                batch = await outputs.take(hold)
                last = batch[-1]
                finished = isinstance(last, Exception) or last.finished
                tokens += sum(len(out.new_token_ids) for out in batch if not isinstance(out, Exception))
                if isinstance(last, Exception):  # fail_streams: the engine cannot answer any more
                    if len(batch) > 1:
                        yield batch[:-1]
                    raise last
                yield batch
        finally:
            if not finished:
                self.abort(request_id)

    async def _add(self, request_id: str, request: dict[str, Any]) -> OutputStream:
        """Hand the request to the engine's thread and wait until it is accepted (or refused:
        the engine's error is raised here); returns the stream its outputs will arrive on."""
        loop = asyncio.get_running_loop()
        outputs = OutputStream()
        added: asyncio.Future[str] = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(request_id=request_id, **request)
                self._streams[request_id] = (loop, outputs)
                loop.call_soon_threadsafe(_set_result, added, request_id)
            except Exception as e:
                loop.call_soon_threadsafe(_set_exception, added, e)

        self._adding[request_id] = (loop, added)
        self._inbox.put(add)
        try:
            await added
        except asyncio.CancelledError:
            # The caller went away (cancel, deadline) before the engine took the request: `add`
            # still runs, and without this the request would run to its end with nobody reading.
            self._inbox.put(lambda: self._abort_stream(request_id, outputs))
            raise
        finally:
            self._adding.pop(request_id, None)
        return outputs

    def _abort_stream(self, request_id: str, outputs: OutputStream) -> None:
        """On the engine thread: abort `request_id` if its stream is `outputs` (`add` took it),
        never a later request that reuses the id."""
        stream = self._streams.get(request_id)
        if stream is not None and stream[1] is outputs:
            self.engine.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(lambda: self.engine.abort(request_id))

    def submit_control(self, op: ControlOp) -> Future[ControlResult]:
        """Queue an adapter operation; it runs on the engine thread at its next quiescent point."""
        future = self.engine.submit_control(op)
        self._inbox.put(lambda: None)  # wake an idle engine thread so the step that runs it happens
        return future

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(why)` from the engine thread if its steps keep raising (`_step_failed`)."""
        self._lost = callback

    def fail_streams(self, error: Exception) -> None:
        """End every open stream with `error`, from any thread, without the engine thread: it may be
        stuck in a collective that will never complete (a lost tensor-parallel rank)."""
        for loop, q in list(self._streams.values()):
            loop.call_soon_threadsafe(q.put, error)
        for loop, added in list(self._adding.values()):
            loop.call_soon_threadsafe(_set_exception, added, error)

    def call(self, fn: Callable[[E], T]) -> T:
        """Run `fn(engine)` on the engine thread and wait for its result (for stats, control ops).
        Raises UnavailableError once the thread has stopped without running it (shut down while
        the call was queued): the caller's thread must not wait forever on a closed pod."""
        done: queue.Queue[tuple[bool, Any]] = queue.Queue()

        def run() -> None:
            try:
                done.put((True, fn(self.engine)))
            except Exception as e:
                done.put((False, e))

        self._inbox.put(run)
        while True:
            try:
                ok, value = done.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and done.empty():
                    raise UnavailableError("the engine has shut down") from None
        if not ok:
            raise value
        return value

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        failed = 0  # steps that raised in a row
        while not self._stop.is_set():
            # Block for work when idle; otherwise drain the inbox without waiting.
            busy = self.engine.has_unfinished()
            with contextlib.suppress(queue.Empty):
                _run(self._inbox.get(timeout=None if not busy else 0))
                while True:
                    _run(self._inbox.get_nowait())
            if self._stop.is_set():
                break
            try:
                outputs = self.engine.step()
            except Exception as e:  # the engine contains per-request faults; this is the last guard
                failed += 1
                self._step_failed(e, failed)
                continue
            failed = 0
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                loop, q = stream
                if out.finished:
                    del self._streams[out.request_id]
                try:
                    loop.call_soon_threadsafe(q.put, out)
                except RuntimeError:  # the caller's event loop is gone: nobody will read this
                    self._streams.pop(out.request_id, None)
                    self.engine.abort(out.request_id)

    def _step_failed(self, e: Exception, failed: int) -> None:
        """A step raised, the `failed`-th in a row. One that kept raising was stepped again
        forever: every stream on the pod waited with no output while its health said SERVING.
        From MAX_FAILED_STEPS on, the open streams end UNAVAILABLE (the gateway resumes them
        elsewhere; streams added later end so at the next failure) and the pod is told
        (`on_lost`: NOT_SERVING, exit)."""
        log.error("engine step failed (%d in a row)", failed, exc_info=e)
        if failed < MAX_FAILED_STEPS:
            return
        why = f"{failed} engine steps in a row failed, the last with {type(e).__name__}: {e}"
        self.fail_streams(UnavailableError(f"model pod cannot serve any more ({why}); retry on another pod"))
        if self._lost is not None:
            self._lost(why)


def _run(command: Callable[[], object]) -> None:
    """One inbox command (an abort, a wake-up, a `call`). A command that raises must not end the
    engine thread: every stream would then wait forever on a pod that still answers health checks."""
    try:
        command()
    except Exception:
        log.exception("engine command failed")


def _set_result(fut: asyncio.Future[str], value: str) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[str], e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
