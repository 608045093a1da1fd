"""Stand-in HTTP doors (aiohttp apps) served on loopback for the router's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def serve_apps(apps: list[web.Application]) -> AsyncIterator[list[int]]:
    """Each app on its own free loopback port, for the block; their ports, in order."""
    runners = [web.AppRunner(app) for app in apps]
    try:
        ports = []
        for runner in runners:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            ports.append(runner.addresses[0][1])
        yield ports
    finally:
        for runner in runners:
            await runner.cleanup()
