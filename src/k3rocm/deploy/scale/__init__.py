"""Scale-out beyond one node: N replicas behind vllm-router (supported), dp-ep (an
experimental rendering, not validated on MI355X). See docs/scale.md."""
