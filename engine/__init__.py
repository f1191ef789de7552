"""diffcast engine: models, sampling, streaming runtime, serving policy, simulator."""
