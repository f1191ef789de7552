"""Media in and out: the WebRTC gateway, SDP and ICE checks, WHIP/WHEP, the WebSocket fallback,
the per-stream frame path, the VP8 encoder, audio in sync, frame IDs and NDI in and out."""
