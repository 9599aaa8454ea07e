"""The fusion table: one row per fusion. Everything in k3rocm that names a fusion derives from it
(settings, rendering, decision records, the upstream hook, base checks, census, A/B);
tests/test_fusions_table.py adds a third row and sees each follow. The overlay file imports
nothing of k3rocm; a test keeps its names equal to these.
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
    states: tuple[str, ...]
    # census kernel roles (checks/census/kernels.json): the launches it adds / replaces
    fused: tuple[str, ...]
    stock: tuple[str, ...]
    op: str  # the op whose call in an upstream amd/mla.py means upstream ships the fusion
    # upstream amd/mla.py (vLLM >= 0.30): the per-layer attribute its gates set (True = fused)
    # and those that follow it off (bool -> False, buffer freed); the upstream hook switches them
    attr: str = ""
    follows: tuple[str, ...] = ()
    # the KV cache dtype (prefix) it needs (the base check turns it off or refuses without it)
    kv_cache: str = ""

    @property
    def field(self) -> str:
        """The Settings field (``K3_FUSE_QK_NORM`` -> ``fuse_qk_norm``)."""
        return self.env.removeprefix("K3_").lower()

    @property
    def roles(self) -> tuple[str, ...]:
        return (*self.fused, *self.stock)

    def asked(self, raw: str | None) -> bool | None:
        """``raw`` as the overlay's ``_asked`` reads it: unset = default, None = not a switch."""
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
