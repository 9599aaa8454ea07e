"""Latency/throughput measurement with aiperf in the client container, and fusion A/B runs."""

# The step-delay test double's switch: a calibration's arm B (k3rocm.checks.ab.arms sets it).
STEP_DELAY_ENV = "K3_TEST_STEP_DELAY_MS"
