"""Server-sent events: the ``data:`` lines of a streamed answer, ending ``data: [DONE]`` (an error
while streaming becomes one last error event), and the interleaving of several requests'
output streams into one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from pagedserve.engine.async_engine import EngineDeadError, EngineStepError
from pagedserve.outputs import RequestOutput
from pagedserve.server.errors import error_body
from pagedserve.server.protocol import ResponseModel, UsageInfo


def sse_data(model) -> str:
    """One server-sent event carrying ``model`` as JSON."""
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"


def sse_chunk(
    chunk_type: type[ResponseModel],
    request_id: str,
    created: int,
    model: str,
    choices: list,
    usage: UsageInfo | None = None,
) -> str:
    """One streamed chunk (``CompletionChunk``, ``ChatCompletionChunk``) as an event."""
    return sse_data(
        chunk_type(id=request_id, created=created, model=model, choices=choices, usage=usage)
    )


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    async def with_done() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except EngineDeadError as e:  # as serving.engine_dead answers it before streaming
            yield f"data: {json.dumps(error_body(503, str(e), code='engine_dead'))}\n\n"
        except (EngineStepError, ValueError) as e:
            status = 400 if isinstance(e, ValueError) else 500
            yield f"data: {json.dumps(error_body(status, str(e)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        with_done(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def merge_streams(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output); closing it aborts them all."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except BaseException as e:  # noqa: BLE001 - re-raised on the consumer side
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
