"""Deploy: the host's view of one deployment. Settings -> URL/model/paths (deployment), the
Docker engine, the compose server's lifecycle and readiness, the server's provenance, the run
record, preflight, the checkpoint, and scale-out beyond one node (scale/)."""
