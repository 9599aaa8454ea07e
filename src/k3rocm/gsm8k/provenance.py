"""Provenance of a gsm8k run, the same record as the bench's.

The server side is :func:`k3rocm.provenance.collect_provenance` itself (vLLM version over HTTP;
for a local container: image id, env with secrets redacted, the argv vLLM runs with, the overlay
manifest and the fusion toggles and log lines), so a bench result and an accuracy result from
the same server say the same thing. Added here: the client image and the host side.
"""

from __future__ import annotations

import platform
from typing import Any

from k3rocm import __version__


def server(client, url: str, api_key: str | None, container_name: str | None = None) -> dict:
    from k3rocm.provenance import collect_provenance

    container = None
    if container_name:
        try:
            container = client.containers.get(container_name)
        except Exception as exc:  # noqa: BLE001 - docker.errors.NotFound
            return {"url": url, "container": None,
                    "note": f"--server-container {container_name}: {exc.__class__.__name__}"}
    try:
        return collect_provenance(url, api_key, client=client, container=container)
    except Exception as exc:  # noqa: BLE001 - provenance must never lose a finished result
        return {"url": url, "error": f"{exc.__class__.__name__}: {exc}"[:500]}


def client_image(client, ref: str) -> dict[str, Any]:
    img = client.images.get(ref)
    return {"ref": ref, "id": img.id, "tags": img.tags,
            "labels": (img.attrs.get("Config") or {}).get("Labels") or {},
            "created": img.attrs.get("Created")}


def host() -> dict[str, Any]:
    return {"k3rocm_version": __version__, "python": platform.python_version(),
            "platform": platform.platform()}
