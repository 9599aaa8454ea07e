"""Scale-out beyond one node: N replicas behind vllm-router (supported), dp-ep and pd
(experimental renderings, not validated on MI355X). See docs/scale.md."""
