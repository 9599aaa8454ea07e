"""GSM8K accuracy gate: lm-evaluation-harness in the client container against the server.

``k3rocm gsm8k`` (module :mod:`k3rocm.checks.gsm8k.cli`); see docs/gsm8k.md.
"""
