"""Checks against a running deployment: latency/throughput (bench), accuracy (gsm8k), the decode
kernel census (census), and the one A/B driver on fresh servers (ab)."""
