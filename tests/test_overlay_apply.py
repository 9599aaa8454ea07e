"""`k3rocm overlay apply|status|probe` on copies of the real vLLM sources of every release
0.27.1 ... 0.34.0 (``conftest.upstream_tree``)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import REPO, k3_in_process, run_cli, upstream_tree

from k3rocm.errors import UsageError
from k3rocm.serving import overlay

OVERLAY = REPO / "overlay"
MLA = "vllm/models/kimi_k3/amd/mla.py"
BACKUP = MLA + ".k3rocm-upstream"
LINEAR = "vllm/models/kimi_k3/amd/linear.py"


def release(version, tmp_path):
    site = tmp_path / f"vllm-{version}"
    shutil.copytree(upstream_tree(version), site)
    return site


def apply(site, *extra, env=None):
    """``k3rocm overlay apply`` in-process (the real python -m k3rocm entry point:
    test_bad_mode_and_dir_are_usage_errors)."""
    return k3_in_process("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site),
                         *extra, env=env)


def one_line_error(p, code, *fragments):
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code and len(lines) == 1, p.stdout + p.stderr
    assert all(f in lines[0] for f in fragments), lines[0]


def test_bad_mode_and_dir_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="--mode 'sometimes' is not valid"):
        overlay.apply(OVERLAY, "sometimes", site=tmp_path)
    p = run_cli("overlay", "apply", "--overlay-dir", str(tmp_path / "nope"), "--site",
                str(tmp_path))
    one_line_error(p, 2, "is not a directory")


APPLIED = "overlay: applied 1 files (vLLM has no amd/mla.py)"
LACKS = "overlay: applied 1 files (upstream amd/mla.py lacks decode_qprep; kept as " \
        "mla.py.k3rocm-upstream)"
SKIPPED = "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep; switchable " \
          "through the plugin's upstream hook"
BOTH = ["qk_norm", "decode_qprep"]
RELEASES = [("0.27.1", APPLIED, None), ("0.28.0", APPLIED, None), ("0.29.0", APPLIED, None),
            ("0.30.0", LACKS, ["qk_norm"]), ("0.31.0", LACKS, ["qk_norm"]),
            ("0.32.0", SKIPPED, BOTH), ("0.33.0", SKIPPED, BOTH), ("0.34.0", SKIPPED, BOTH)]


@pytest.mark.parametrize("version,line,fusions", RELEASES, ids=[r[0] for r in RELEASES])
def test_auto_on_every_release(version, line, fusions, tmp_path):
    """`auto` applies where vLLM has no amd/mla.py or upstream's lacks a fusion (kept as the
    backup), skips where it ships both; idempotent; status healthy."""
    site = release(version, tmp_path)
    upstream = (site / MLA).read_bytes() if fusions else None
    p = apply(site, "--report", str(tmp_path / "r.json"))
    assert p.returncode == 0 and p.stdout.splitlines() == [line], p.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["vllm_version"] == version and rep.get("upstream_fusions") == fusions
    s = k3_in_process("overlay", "status", "--site", str(site), "--json")
    st = json.loads(s.stdout)
    assert s.returncode == 0 and st["healthy"] is True and st["upstream_fusions"] == fusions
    if fusions == BOTH:
        assert rep["decision"] == "skipped-upstream" and (site / MLA).read_bytes() == upstream
        assert st["amd_mla"] == "upstream" and st["overlay"].startswith("skipped: upstream")
        return
    assert rep["decision"] == "applied"
    assert rep["files"] == [{"path": MLA, "sha256": overlay.sha256_file(site / MLA),
                             "action": "applied"}]
    assert (site / MLA).read_bytes() == (OVERLAY / MLA).read_bytes()
    assert st["amd_mla"] == "k3rocm overlay" and st["verified"] is True
    if fusions is None:  # the plugin rebinds the base wrapper name in amd/linear.py
        assert rep["upstream_backup"] is None and st["anchor"] == "present"
        assert rep["anchor"]["hook"].startswith("global name MultiHeadLatentAttentionWrapper")
    else:  # linear.py imports the class by name from amd/mla.py
        assert rep["anchor"]["hook"].startswith("upstream import of KimiK3Multi")
        assert (site / BACKUP).read_bytes() == upstream
        assert rep["upstream_backup"]["path"] == BACKUP
        assert "lacks decode_qprep" in st["overlay"] and "kept as" in st["overlay"]
    p = apply(site)
    assert p.returncode == 0 and p.stdout.strip() == "overlay: already applied 1 files (no-op)"


def test_modified_target_fails_and_a_new_overlay_needs_force(tmp_path):
    site = release("0.27.1", tmp_path)
    overlay.apply(OVERLAY, "auto", site=site)
    newer = tmp_path / "overlay2"
    shutil.copytree(OVERLAY, newer)
    with open(newer / MLA, "a") as fh:
        fh.write("# v2\n")
    with pytest.raises(overlay.OverlayError, match="different overlay version"):
        overlay.apply(newer, "auto", site=site)
    with open(site / MLA, "a") as fh:
        fh.write("# edited by hand\n")
    one_line_error(apply(site), 3, "stale target", "modified since applied")
    assert overlay.status(site=site)["verified"] is False
    rep = overlay.apply(newer, "force", site=site)
    assert rep["decision"] == "applied" and (site / MLA).read_bytes().endswith(b"# v2\n")


@pytest.mark.parametrize("version,old,new,why", [
    ("0.27.1", "MultiHeadLatentAttentionWrapper(", "SomethingElse(", "hook point is gone"),
    ("0.31.0", "KimiK3MultiHeadLatentAttentionWrapper", "K3Wrapper", "would not switch the class")])
def test_a_linear_py_that_would_not_build_the_overlay_fails_the_build(version, old, new, why,
                                                                       tmp_path):
    """0.27.1: the global name the plugin rebinds; 0.30+: the class imported by name."""
    site = release(version, tmp_path)
    before = (site / MLA).read_bytes() if (site / MLA).exists() else None
    linear = site / LINEAR
    linear.write_text(linear.read_text().replace(old, new))
    one_line_error(apply(site), 3, "overlay: cannot apply", why)
    assert not (site / BACKUP).exists()
    assert ((site / MLA).read_bytes() if (site / MLA).exists() else None) == before
    if version == "0.27.1":
        linear.unlink()
        one_line_error(apply(site), 3, "linear.py is missing")


def test_off_touches_nothing(tmp_path, capsys):
    site = release("0.27.1", tmp_path)
    rep = overlay.apply(OVERLAY, "off", site=site)
    assert rep["decision"] == "off" and not (site / MLA).exists()
    assert capsys.readouterr().out.startswith("overlay: off")


def test_force_over_upstream_032_keeps_the_backup(tmp_path):
    site = release("0.32.0", tmp_path)
    upstream = (site / MLA).read_bytes()
    p = apply(site, env={"K3_OVERLAY": "force"})  # K3_OVERLAY is the default mode
    assert p.returncode == 0 and "forced over upstream" in p.stdout
    assert (site / BACKUP).read_bytes() == upstream
    assert overlay.status(site=site)["amd_mla"] == "k3rocm overlay"
    p = apply(site, "--mode", "force")
    assert p.returncode == 0 and "already applied" in p.stdout


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_force_is_refused_on_033_and_034(version, tmp_path):
    """K3's output gate fused into the QKV projection and forward(..., skip_o_proj=True)."""
    site = release(version, tmp_path)
    upstream = (site / MLA).read_bytes()
    one_line_error(apply(site, "--mode", "force"), 3, "--mode force refused", "skip_o_proj",
                   "KimiK3MergedQKVGateLinear")
    assert (site / MLA).read_bytes() == upstream and not (site / BACKUP).exists()


def test_status_fails_when_the_applied_overlay_is_not_built(tmp_path):
    site = release("0.30.0", tmp_path)
    overlay.apply(OVERLAY, "auto", site=site)
    linear = site / LINEAR
    linear.write_text(linear.read_text().replace(
        "from vllm.models.kimi_k3.amd.mla import", "from vllm.models.kimi_k3.amd.mla_v2 import"))
    p = run_cli("overlay", "status", "--site", str(site))
    assert p.returncode == 1 and "healthy: False" in p.stdout
    assert "does not import and build KimiK3MultiHeadLatentAttentionWrapper" in p.stdout


def test_status_reads_decision_records():
    data = REPO / "tests" / "data" / "census"
    final = overlay.read_decisions(data / "k3-anchor-off")
    assert final and all(r["fusions"]["qk_norm"]["state"] == "off" for r in final)
    p = k3_in_process("overlay", "status", "--json", "--site", str(upstream_tree("0.32.0")),
                      "--decisions", str(data / "records" / "server-on.log"))
    doc = json.loads(p.stdout)  # one JSON document
    assert len(doc["decisions"]) == 4 and "vllm_version" in doc


def test_probe(tmp_path):
    p = run_cli("overlay", "probe", "--json")  # no vLLM/AITER on the host: all off, exit 0
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["qprep_kernel"]["found"] is False
    assert {v["state"] for v in rep["fusions"].values()} == {"off"}
    one_line_error(run_cli("overlay", "probe", "--overlay-dir", "/nonexistent"), 2, "holds no")
    # the overlay file probed: vLLM's amd/mla.py when it is ours, else --overlay-dir's
    site = tmp_path / "site"
    (site / overlay.AMD_DIR).mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("__version__ = '0.32.0'\n")
    (site / overlay.MLA).write_text("# upstream amd/mla.py\n")
    assert overlay.overlay_source(site, OVERLAY) == OVERLAY / overlay.MLA
    (site / overlay.MLA).write_text(overlay.MARKER + "\n")
    assert overlay.overlay_source(site, OVERLAY) == site / overlay.MLA
