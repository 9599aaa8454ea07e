"""Kimi-K3 on 8x AMD MI355X with vLLM: configuration, overlay, measurement and census tools."""

__version__ = "0.1.0"
