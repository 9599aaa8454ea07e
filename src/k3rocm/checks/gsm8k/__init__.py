"""GSM8K accuracy gate: lm-evaluation-harness in the client container against the server.

``k3rocm gsm8k``: the flow in :mod:`.cli`, the verdict in :mod:`.results`; docs/gsm8k.md.
"""
