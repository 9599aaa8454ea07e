"""Serving: what runs in the image. The one configuration (``K3_*`` settings and profiles ->
vLLM env and argv), the entrypoint's render/serve commands, the overlay (apply, runtime gates,
decision records), the vLLM plugin and the image manifest."""
