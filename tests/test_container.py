"""The serving image (integration/container/Dockerfile), checked by reading it: docker cannot run here.

Every file the build takes from the context exists and survives Dockerfile.dockerignore; calibrations are a mount
point unless BAKE_CALIBRATIONS=1; the manifests mount a volume on that mount point and name calibrations under it.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "integration" / "container" / "Dockerfile"
IGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")


def _instructions() -> list[str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continuation lines
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _kept_by_dockerignore(rel: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    keep = True
    for pat in (p.strip() for p in IGNORE.read_text().splitlines()):
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        if fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel, pat.rstrip("/*")) or pat == "**":
            keep = neg
    return keep


def _context_sources() -> list[str]:
    out = []
    for ins in _instructions():
        if ins.startswith("COPY "):
            args = [a for a in ins.split()[1:] if not a.startswith("--")]
            out += args[:-1]
        out += re.findall(r"--mount=type=bind,source=([^,\s]+)", ins)
    return out


def test_every_build_context_source_exists_and_is_not_ignored():
    sources = _context_sources()
    assert "calibrations" in sources and "." in sources
    for src in sources:
        path = ROOT / src
        assert path.exists(), src
        if src != ".":
            assert _kept_by_dockerignore(src.rstrip("/") + "/x"), f"{src} is excluded by {IGNORE.name}"
    needed_files = (
        "pyproject.toml", "README.md", "dynamo_kvtc/cli/main.py", "dynamo_kvtc/connector/offloading/tier.py"
    )
    for needed in needed_files:
        assert _kept_by_dockerignore(needed), needed


def test_calibrations_are_mounted_not_baked():
    ins = _instructions()
    assert not any(i.startswith("COPY") and "calibrations" in i for i in ins)
    assert "ARG BAKE_CALIBRATIONS=0" in ins
    assert "ENV DYN_KVTC_CALIBRATIONS=/opt/dynamo_kvtc/calibrations" in ins
    bake = next(i for i in ins if 'BAKE_CALIBRATIONS" = "1"' in i)
    assert "mkdir -p /opt/dynamo_kvtc/calibrations" in bake


def test_manifests_mount_the_calibrations_where_their_paths_point():
    seen = 0
    for path in sorted((ROOT / "manifests").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "DynamoGraphDeployment":
                continue
            for name, svc in doc["spec"]["services"].items():
                pod = svc.get("extraPodSpec", {})
                c = pod.get("mainContainer", {})
                text = " ".join(c.get("args", []))
                if "dynamo_kvtc.connector.vllm" not in text:
                    continue
                cals = re.findall(r'"calibration":\s*"([^"]+)"', text)
                assert cals and all(p.startswith("/opt/dynamo_kvtc/calibrations/") for p in cals), (path.name, name)
                mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
                vols = {v["name"]: v for v in pod.get("volumes", [])}
                m = mounts["kvtc-calibrations"]
                assert m["mountPath"] == "/opt/dynamo_kvtc/calibrations" and m["readOnly"] is True
                assert vols["kvtc-calibrations"]["persistentVolumeClaim"]["claimName"] == "kvtc-calibrations"
                seen += 1
    assert seen == 7  # every KvtcConnector service of manifests/ (the TP=2 worker and the two pool workers included)
