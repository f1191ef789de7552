"""The live service: the FastAPI app (app.py) and its options (config.py), in four rooms: the HTTP
edge and security (edge/), media and WebRTC (media/), streams and the engine's executors (serving/),
control and recording (control/)."""
