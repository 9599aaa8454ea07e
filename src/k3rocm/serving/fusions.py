"""The overlay's fusions: one row each. Everything in k3rocm that names a fusion derives from
this table: the ``K3_FUSE_*`` settings and their rendering (``serving/config.py``), the compose
passthrough (``compose.yaml``, checked against the settings by a test), the run record
(``deploy/provenance.py``), the decision-record reader (``serving/decisions.py``), the upstream
hook's switches (``serving/upstream_hook.py``), the base check's KV-cache gate
(``serving/basefacts.py``), the census claim, roles and expectations of both halves
(``checks/census/``; the kernel names and per-step counts in its ``kernels.json``), the A/B
arms and comparison rows, and the selftest's "off" server and census numbers.
tests/test_fusions_table.py adds a third row and sees each of them follow.

The overlay (``overlay/vllm/models/kimi_k3/amd/mla.py``) reads the switches and writes the
decision records under these same names by itself (it imports nothing from k3rocm); a test
keeps the two in agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

# The switch spellings the overlay's ``_asked`` reads (case and blanks ignored).
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Fusion:
    name: str  # in decision records, census claims, ``--fusions`` and ``--on``
    env: str  # the switch the overlay reads in the server's environment (1/0)
    default: bool
    doc: str  # the setting's description (README settings table, ``make config``)
    label: str  # in reports
    # the states a decision record may give it ("unknown": the upstream hook found upstream's
    # attribute missing or not a bool; the census cannot judge such a process)
    states: tuple[str, ...]
    # The census kernel roles it owns (checks/census/kernels.json: names, per-step counts):
    # the launches it adds and the stock launches it replaces. The census proves both halves.
    fused: tuple[str, ...]
    stock: tuple[str, ...]
    op: str  # the op whose call in an upstream amd/mla.py means upstream ships the fusion
    # Upstream's own amd/mla.py (vLLM >= 0.30): the per-layer attribute its gates set (True =
    # fused) and attributes that must follow it off (built only for the fusion: a bool is set
    # False, a registered buffer freed; absent ones are skipped). The upstream hook
    # (serving/upstream_hook.py) reads and switches these; the names are checked against
    # the real files of vLLM 0.30 ... 0.34 by tests/test_upstream_hook.py.
    attr: str = ""
    follows: tuple[str, ...] = ()
    # The KV cache dtype (prefix) it needs: the overlay's gate and upstream's; the base check
    # (serving/basefacts.py) turns the default off, or refuses an explicit 1, without it.
    kv_cache: str = ""

    @property
    def field(self) -> str:
        """The Settings field (``K3_FUSE_QK_NORM`` -> ``fuse_qk_norm``)."""
        return self.env.removeprefix("K3_").lower()

    @property
    def roles(self) -> tuple[str, ...]:
        return (*self.fused, *self.stock)

    def asked(self, raw: str | None) -> bool | None:
        """The switch's value ``raw`` as the overlay reads it (its ``_asked``): unset or empty =
        the default; None = not a switch."""
        v = (raw or "").strip().lower()
        return self.default if not v else True if v in ON else False if v in OFF else None


FUSIONS = (
    Fusion(name="qk_norm", env="K3_FUSE_QK_NORM", default=True,
           doc="Overlay: fused q/kv RMSNorm (1/0).", label="q/kv RMSNorm",
           states=("on", "off", "unknown"), fused=("fused_qk_norm",), stock=("qk_norm",),
           op="fused_mla_dual_rms_norm", attr="_use_eager_qk_rmsnorm_fusion"),
    Fusion(name="decode_qprep", env="K3_FUSE_DECODE_QPREP", default=True,
           doc="Overlay: fused decode Q-prep (1/0).", label="decode Q-prep",
           states=("on", "off", "needs-model", "unknown"),
           fused=("fused_qprep",), stock=("cache_write", "q_concat_quant"),
           op="fused_qk_rope_concat_and_cache_mla", attr="_fused_qk_prep",
           follows=("_fold_qb_uk", "_zero_positions"), kv_cache="fp8"),
)
NAMES = tuple(f.name for f in FUSIONS)
BY_NAME = {f.name: f for f in FUSIONS}
ENV = {f.name: f.env for f in FUSIONS}  # name -> switch
NAME_OF_ENV = {f.env: f.name for f in FUSIONS}  # switch -> name


def switches(on: bool | dict[str, bool]) -> dict[str, str]:
    """The server environment that asks for ``on`` (all fusions, or per name): ``{env: 1|0}``."""
    return {f.env: "1" if (on.get(f.name, False) if isinstance(on, dict) else on) else "0"
            for f in FUSIONS}
