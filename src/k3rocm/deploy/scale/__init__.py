"""Scale-out beyond one node: N replicas behind vllm-router. See docs/scale.md."""
