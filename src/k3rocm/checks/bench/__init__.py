"""Latency/throughput measurement with aiperf in the client container, and fusion A/B runs."""
