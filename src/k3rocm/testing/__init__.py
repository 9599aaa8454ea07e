"""Test-only helpers. Nothing here is used by the serving path unless K3_TEST_REFERENCE_OPS=1."""
