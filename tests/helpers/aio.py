"""Waiting on the async engine's clients in tests."""

from __future__ import annotations

import asyncio


async def until(condition, what: str, timeout: float):
    """Poll ``condition`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"{what} took over {timeout} s"
        await asyncio.sleep(0.005)


async def collect(stream) -> list:
    return [out async for out in stream]
