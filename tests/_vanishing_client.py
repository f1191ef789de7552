"""A WebRTC publisher in its own process, for tests that kill it without a goodbye (SIGKILL).

Usage: python tests/_vanishing_client.py BASE_URL — prints {"stream_id": ...} once the offer is
answered, then publishes until killed."""

from __future__ import annotations

import asyncio
import json
import sys

from app.client import CodedCamera, open_session


async def main(url: str) -> None:
    session = await open_session(url, CodedCamera((128, 128), fps=15))
    print(json.dumps({"stream_id": session.stream_id}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
