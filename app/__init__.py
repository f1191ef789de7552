"""diffcast application layer: CLI, live service, gateway, playground."""
