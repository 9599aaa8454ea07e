"""The gsm8k-specific part of the run record: the client image. The rest (server, deployment,
command, checkpoint, topology) is :mod:`k3rocm.deploy.runrecord`, the same record as the bench's."""

from __future__ import annotations

from typing import Any


def client_image(client, ref: str) -> dict[str, Any]:
    img = client.images.get(ref)
    return {"ref": ref, "id": img.id, "tags": img.tags,
            "labels": (img.attrs.get("Config") or {}).get("Labels") or {},
            "created": img.attrs.get("Created")}
