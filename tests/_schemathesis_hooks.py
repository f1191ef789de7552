"""schemathesis hooks for tests/test_server_fuzz.py: WHIP/WHEP bodies are `application/sdp` text,
which schemathesis has no serializer for."""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.serializer("application/sdp")
def sdp_text(ctx: Any, value: Any) -> dict[str, Any]:
    return {"data": value if isinstance(value, bytes) else str(value).encode("utf-8", "surrogatepass")}
