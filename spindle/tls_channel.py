"""A TLS client channel that follows its certificate files: made again when they change.

gRPC reads a channel's credentials once, when it is made. A service's channels to the pods live
as long as the process, so without this a renewed (or re-issued) client certificate would only
be used after a restart, and an expired one would fail the next reconnect. Here every RPC asks
for the current channel; at most once a second the files are checked, and when they changed
(and the new pair matches) a new channel is made with them. Calls in flight on the old one run
on, and it is closed once they end (or after RETIRE_GRACE seconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import grpc

from spindle import tls as tls_files

log = logging.getLogger(__name__)

CHECK_EVERY = 1.0  # seconds between looks at the files
RETIRE_GRACE = 600.0  # seconds a replaced channel's calls get before it is closed


def aio_channel(
    target: str,
    tls: tls_files.TlsConfig,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] = (),
) -> grpc.aio.Channel:
    """A channel to `target`: TLS when a CA (or the system's) is configured, made again when the
    files change; else plaintext."""
    opts, icpt = [*options, *tls_files.channel_options(tls)], list(interceptors)
    if tls.dials_tls:
        return ReloadingChannel(target, tls, opts, icpt)
    return grpc.aio.insecure_channel(target, options=opts, interceptors=icpt)


class ReloadingChannel(grpc.aio.Channel):
    def __init__(
        self, target: str, tls: tls_files.TlsConfig, options: list[tuple[str, Any]], interceptors: list[Any]
    ) -> None:
        self._target, self._tls, self._options, self._interceptors = target, tls, options, interceptors
        self._paths = tls_files.paths(tls)
        self._stamp = tls_files.stamp(self._paths)
        self._channel = self._make()
        self._checked = time.monotonic()
        self._retiring: set[asyncio.Task] = set()

    def _make(self) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            self._target,
            tls_files.channel_credentials(self._tls),
            options=self._options,
            interceptors=self._interceptors,
        )

    def current(self) -> grpc.aio.Channel:
        """The channel made with the files as they are now (checked at most every CHECK_EVERY s)."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY:
            return self._channel
        self._checked = now
        try:
            stamp = tls_files.stamp(self._paths)
            if stamp == self._stamp:
                return self._channel
            tls_files.check_pair(self._tls)
            fresh = self._make()
        except (OSError, ValueError) as e:  # mid-rotation: keep the channel that works
            log.warning("TLS files for %s changed but are not usable yet (%s)", self._target, e)
            return self._channel
        old, self._channel, self._stamp = self._channel, fresh, stamp
        task = asyncio.get_running_loop().create_task(old.close(grace=RETIRE_GRACE))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        log.info("TLS files changed: new calls to %s use a channel made with them", self._target)
        return self._channel

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Multicallable(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Multicallable(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Multicallable(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Multicallable(self, "stream_stream", method, args, kwargs)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(None)


class _Multicallable:
    """A stub's method: each call goes to the current channel (its multicallable made once per channel)."""

    def __init__(self, parent: ReloadingChannel, kind: str, method: str, args: tuple, kwargs: dict) -> None:
        self.parent, self.kind, self.method, self.args, self.kwargs = parent, kind, method, args, kwargs
        self._made: tuple[grpc.aio.Channel, Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self.parent.current()
        if self._made is None or self._made[0] is not channel:
            self._made = (channel, getattr(channel, self.kind)(self.method, *self.args, **self.kwargs))
        return self._made[1](*args, **kwargs)
