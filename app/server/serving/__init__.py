"""Streams and the engine: sessions and their lifetime, the bridge to the engines, and the live
executors of the engine core (in-process, Ray workers, pipeline ranks) with the loop that drives them."""
