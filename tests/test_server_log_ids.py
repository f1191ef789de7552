"""No stream id, nor a prefix of one, in a log line or a task name (docs/security.md, Logs): the
redaction recognises whole ids only, and asyncio names tasks in its own messages. The input
watchdog closing a vanished client's stream is an expected end, not a crash: no ERROR, no traceback."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import pytest
from _security_fixtures import Api, asgi_api, tiny_factory  # noqa: F401

from app.server.edge.logs import install_log_redaction

ApiFactory = Callable[..., AbstractAsyncContextManager[Api]]
PREFIX = 6  # characters of an id that would already tell it apart from the other streams'


async def test_the_input_watchdog_ends_a_stream_quietly_and_nothing_names_its_id(
    asgi_api: ApiFactory, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    install_log_redaction()
    caplog.set_level(logging.DEBUG)
    async with asgi_api(max_streams=1, input_timeout_s=1.0) as api:
        stream = await api.create()  # its peer never connects: no input frame ever comes
        sessions = api.app.state.manager.sessions
        task_names = {task.get_name() for task in asyncio.all_tasks()}
        deadline = time.monotonic() + 60
        while stream.stream_id in sessions:
            assert time.monotonic() < deadline, "the input watchdog did not close the stream"
            await asyncio.sleep(0.1)
    ids = [stream.stream_id, stream.owner, stream.viewer]
    prefixes = {secret[i:i + PREFIX] for secret in ids for i in range(len(secret) - PREFIX + 1)}
    assert not [name for name in task_names if any(p in name for p in prefixes)], task_names
    lines = [record.getMessage() + (record.exc_text or "") for record in caplog.records]
    assert not [line for line in lines if any(p in line for p in prefixes)], lines
    closed = [r for r in caplog.records if "no input frame" in r.getMessage()]
    assert closed and all(r.levelno == logging.WARNING and r.exc_info is None for r in closed), lines
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], lines
