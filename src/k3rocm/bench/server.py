"""The bench modules' view of the server: readiness (:mod:`k3rocm.readiness`), provenance
(:mod:`k3rocm.provenance`) and the CPU stand-in's EngineCore pin (:mod:`k3rocm.lifecycle`).

Servers are started and stopped only by :mod:`k3rocm.lifecycle` (compose).
"""

from __future__ import annotations

from k3rocm.lifecycle import pin_engine_core  # noqa: F401 - re-exported
from k3rocm.provenance import (  # noqa: F401 - re-exported
    FUSION_ENV,
    MANIFEST_PATH,
    _exec_text,
    collect_provenance,
    find_server_container,
)
from k3rocm.readiness import answers, url_port, wait_ready  # noqa: F401 - re-exported
