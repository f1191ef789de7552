"""The live WebRTC service: HTTP API, WebRTC/WHIP/WHEP gateway, WebSocket fallback, frame path."""
