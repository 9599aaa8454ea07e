"""Decode kernel census: launch counts per kernel and engine step from vLLM profiler traces."""
