"""Kubernetes manifests (manifests/*.yaml): DynamoGraphDeployment schema and the properties the deployment relies on.

Every document is validated against the vendored CRD (manifests/crds/, the served version's openAPIV3Schema, Draft 7)
twice: as the CRD states it, and strictly (no properties the schema does not declare, as ``kubectl apply`` with strict
field validation would reject them). On top of the schema each check below returns a list of problems, so the
negative tests can show that a broken copy of a manifest is caught.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import sys
from functools import cache
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import jsonschema
import pytest
import yaml

from dynamo_kvtc.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
MANIFEST_DIR = ROOT / "manifests"
CRD = MANIFEST_DIR / "crds" / "nvidia.com_dynamographdeployments.yaml"
MANIFESTS = sorted(MANIFEST_DIR.glob("*.yaml"))
EXPECTED = {
    "agg-kvtc.yaml",
    "agg-kvtc-tp2.yaml",
    "disagg-kvtc-prefill.yaml",
    "disagg-kvtc-transfer.yaml",
    "agg-kvtc-pool.yaml",
    "disagg-kvtc-pool.yaml",
}

KVTC = "KvtcConnector"
KVTC_MODULE = "dynamo_kvtc.connector.vllm"
WRAPPERS = ("MultiConnector", "PdConnector")
GIB = 1 << 30
# Host tier + this much: vLLM processes, torch/CUDA context, NIXL registrations, codec staging (see the manifests).
PROCESS_BASELINE_GIB = 16
# The connector's own settings and the types a JSON value may have for each (from the settings table).
_KIND_TYPES = {"gb": (int, float), "float": (int, float), "int": int, "bool": bool, "path": str, "str": str}
EXTRA_KEYS = {s.key: _KIND_TYPES[s.type] for s in SETTINGS if s.extra}
# The cluster pool's settings rows as agreed between the pool tier and its manifests (docs/cluster.md), with the types
# a JSON value may have; where the settings table already carries a row, the table's type wins.
POOL_KEYS = {
    "pool_master": str,
    "pool_metadata_server": str,
    "pool_segment_gb": (int, float),
    "pool_replicas": int,
    "pool_protocol": str,
    "pool_device": str,
    "pool_timeout_s": (int, float),
    "pool_queue_mb": int,
    "pool_insecure": bool,
}
EXTRA_KEYS = {**POOL_KEYS, **EXTRA_KEYS}
POOL_ROWS = {s.key for s in SETTINGS} >= set(POOL_KEYS)  # the table carries the pool's rows (the pool tier is in)
COMPONENT_TYPES = {"frontend", "worker", "planner"}
SUB_COMPONENT_TYPES = {"prefill", "decode"}
CALIBRATIONS = "/opt/dynamo_kvtc/calibrations/"


# ---------------------------------------------------------------------------------------------------------- loading
def load(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


@cache
def crd() -> dict:
    with open(CRD) as f:
        return yaml.safe_load(f)


@cache
def schema_for(api_version: str, strict: bool = False) -> dict:
    group, _, version = api_version.partition("/")
    doc = crd()
    assert group == doc["spec"]["group"], f"apiVersion {api_version}: CRD group is {doc['spec']['group']}"
    ver = next((v for v in doc["spec"]["versions"] if v["name"] == version), None)
    assert ver is not None and ver["served"], f"{api_version} is not a served version of the CRD"
    schema = ver["schema"]["openAPIV3Schema"]
    return _strict(copy.deepcopy(schema)) if strict else schema


def _strict(node):
    """Forbid undeclared properties wherever the schema declares properties and preserves nothing unknown."""
    if isinstance(node, dict):
        for v in node.values():
            _strict(v)
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for v in node:
            _strict(v)
    return node


def schema_problems(doc: dict, strict: bool = False) -> list[str]:
    if not isinstance(doc.get("apiVersion"), str):
        return ["apiVersion missing"]
    validator = jsonschema.Draft7Validator(schema_for(doc["apiVersion"], strict))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


# ---------------------------------------------------------------------------------------------------------- access
def services(doc: dict) -> dict[str, dict]:
    return doc.get("spec", {}).get("services", {})


def workers(doc: dict):
    return [(n, s) for n, s in services(doc).items() if s.get("componentType") == "worker"]


def container(svc: dict) -> dict:
    return svc.get("extraPodSpec", {}).get("mainContainer", {})


def arg_value(svc: dict, flag: str) -> str | None:
    args = container(svc).get("args", [])
    if flag in args:
        i = args.index(flag)
        return args[i + 1] if i + 1 < len(args) else None
    return None


def kv_config(svc: dict) -> dict | None:
    raw = arg_value(svc, "--kv-transfer-config")
    return None if raw is None else json.loads(raw)


def kvtc_entries(cfg: dict | None) -> list[dict]:
    if not cfg:
        return []
    if cfg.get("kv_connector") in WRAPPERS:
        children = cfg.get("kv_connector_extra_config", {}).get("connectors", [])
        return [c for c in children if c.get("kv_connector") == KVTC]
    return [cfg] if cfg.get("kv_connector") == KVTC else []


def env(svc: dict) -> dict[str, dict]:
    out = {e["name"]: e for e in svc.get("envs", [])}
    out.update({e["name"]: e for e in container(svc).get("env", [])})
    return out


def setting(svc: dict, entry: dict, key: str):
    extra = entry.get("kv_connector_extra_config", {})
    if key in extra:
        return extra[key]
    e = env(svc).get("DYN_KVTC_" + key.upper())
    return None if e is None else e.get("value")


def quantity(q) -> float:
    """Kubernetes quantity -> number (bytes for memory and storage)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?", str(q))
    if not m:
        raise ValueError(f"unsupported quantity {q!r}")
    mult = {None: 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    mult.update({s: 1 << (10 * (i + 1)) for i, s in enumerate(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"])})
    return float(m.group(1)) * mult[m.group(2)]


# ---------------------------------------------------------------------------------------------------------- checks
def check_components(doc: dict) -> list[str]:
    out = []
    svcs = services(doc)
    if not svcs:
        return ["no services"]
    for name, s in svcs.items():
        if s.get("componentType") not in COMPONENT_TYPES:
            out.append(f"{name}: componentType {s.get('componentType')!r} not in {sorted(COMPONENT_TYPES)}")
        sub = s.get("subComponentType")
        if sub is not None and sub not in SUB_COMPONENT_TYPES:
            out.append(f"{name}: subComponentType {sub!r} not in {sorted(SUB_COMPONENT_TYPES)}")
        mode = arg_value(s, "--disaggregation-mode")
        if (sub or mode) and sub != mode:
            out.append(f"{name}: subComponentType {sub!r} but --disaggregation-mode {mode!r}")
        if not container(s).get("image"):
            out.append(f"{name}: no image")
    if sum(s.get("componentType") == "frontend" for s in svcs.values()) != 1:
        out.append("expected exactly one frontend")
    if not workers(doc):
        out.append("no worker")
    return out


def check_connector(doc: dict) -> list[str]:
    out = []
    found = 0
    for name, s in workers(doc):
        try:
            cfg = kv_config(s)
        except json.JSONDecodeError as e:
            out.append(f"{name}: --kv-transfer-config is not JSON: {e}")
            continue
        if cfg is None:
            out.append(f"{name}: no --kv-transfer-config")
            continue
        top = cfg.get("kv_connector")
        if top in WRAPPERS:
            children = cfg.get("kv_connector_extra_config", {}).get("connectors", [])
            names = [c.get("kv_connector") for c in children]
            if KVTC in names and names[0] != KVTC:
                out.append(f"{name}: {KVTC} must be the first child of {top} (it loads from the first match): {names}")
            if KVTC in names and cfg.get("kv_load_failure_policy") != "recompute":
                # vLLM's scheduler reads the policy from the top-level config only (default "fail": a failed
                # restore would fail the request); the wrapper gives each child a fresh config
                out.append(f"{name}: {top} with {KVTC} needs top-level kv_load_failure_policy 'recompute'")
        entries = kvtc_entries(cfg)
        found += len(entries)
        if entries and "--enforce-eager" not in container(s).get("args", []):
            out.append(f"{name}: layer-wise restore needs --enforce-eager (or PIECEWISE CUDA graphs)")
        model = arg_value(s, "--model") or ""
        for e in entries:
            if e.get("kv_connector_module_path") != KVTC_MODULE:
                out.append(f"{name}: kv_connector_module_path {e.get('kv_connector_module_path')!r} != {KVTC_MODULE}")
            if e.get("kv_role") != "kv_both":
                out.append(f"{name}: kv_role {e.get('kv_role')!r} != 'kv_both'")
            extra = e.get("kv_connector_extra_config", {})
            for k, v in extra.items():
                if k not in EXTRA_KEYS:
                    out.append(f"{name}: unknown {KVTC} setting {k!r}")
                elif not isinstance(v, EXTRA_KEYS[k]) or (isinstance(v, bool) and EXTRA_KEYS[k] is not bool):
                    out.append(f"{name}: {k}={v!r} has the wrong type")
                envvar = env(s).get("DYN_KVTC_" + k.upper())
                if envvar is not None and str(envvar.get("value")).lower() != str(v).lower():
                    out.append(f"{name}: {k}={v!r} contradicts DYN_KVTC_{k.upper()}={envvar.get('value')!r}")
            cal = setting(s, e, "calibration")
            slug = model.rsplit("/", 1)[-1].lower()
            if not (isinstance(cal, str) and cal.startswith(CALIBRATIONS) and cal.rstrip("/").endswith(slug)):
                out.append(f"{name}: calibration {cal!r} is not {CALIBRATIONS}<{slug}> for model {model!r}")
            ratio, max_ratio = setting(s, e, "ratio"), setting(s, e, "max_ratio")
            if ratio is not None and max_ratio is not None and float(max_ratio) < float(ratio):
                out.append(f"{name}: max_ratio {max_ratio} < ratio {ratio}")
            transfer = setting(s, e, "transfer")
            if transfer is not None:
                if transfer != s.get("subComponentType"):
                    out.append(f"{name}: transfer={transfer!r} on a {s.get('subComponentType')!r} worker")
                if setting(s, e, "nixl_backend") != "UCX":
                    out.append(f"{name}: transfer over NIXL needs nixl_backend 'UCX'")
            if transfer == "prefill" and not _pod_ip(s, e):
                out.append(f"{name}: the prefill side must serve blobs on the pod IP (DYN_KVTC_TRANSFER_HOST)")
            if transfer is not None:
                out += _secret_problems(name, s, setting(s, e, "transfer_secret_file"))
    if not found:
        out.append(f"no worker runs {KVTC}")
    return out


def _secret_problems(name: str, svc: dict, path: str | None) -> list[str]:
    """The hand-off's shared secret is a file on a mounted Kubernetes Secret (an unauthenticated port is not
    shipped)."""
    if not path:
        return [f"{name}: the hand-off needs transfer_secret_file (an HMAC on every control message)"]
    p = PurePosixPath(path)
    mounts = [m for m in container(svc).get("volumeMounts", []) if p.is_relative_to(m["mountPath"])]
    vols = {v["name"]: v for v in svc.get("extraPodSpec", {}).get("volumes", [])}
    if not mounts or "secret" not in vols.get(max(mounts, key=lambda m: len(m["mountPath"]))["name"], {}):
        return [f"{name}: transfer_secret_file {path} is not on a mounted Secret volume"]
    return []


def _pod_ip(svc: dict, entry: dict) -> bool:
    """transfer_host is the pod IP: set from the downward API (or a literal address that is not loopback)."""
    host = entry.get("kv_connector_extra_config", {}).get("transfer_host")
    if host is not None:
        return host not in ("127.0.0.1", "localhost", "::1")
    e = env(svc).get("DYN_KVTC_TRANSFER_HOST", {})
    if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
        return True
    return e.get("value") not in (None, "", "127.0.0.1", "localhost", "::1")


def check_disk_tier(doc: dict) -> list[str]:
    out = []
    for name, s in workers(doc):
        for e in kvtc_entries(kv_config(s)):
            gb = float(setting(s, e, "disk_cache_gb") or 0)
            d = setting(s, e, "disk_cache_dir")
            if not gb and not d:
                continue
            if not d or not gb:
                out.append(f"{name}: disk tier needs both disk_cache_gb and disk_cache_dir")
                continue
            d = PurePosixPath(d)
            mounts = [m for m in container(s).get("volumeMounts", []) if d.is_relative_to(m["mountPath"])]
            if not mounts:
                out.append(f"{name}: disk_cache_dir {d} is not on a mounted volume (it would be the overlayfs)")
                continue
            mount = max(mounts, key=lambda m: len(m["mountPath"]))
            vols = {v["name"]: v for v in s.get("extraPodSpec", {}).get("volumes", [])}
            vol = vols.get(mount["name"])
            if vol is None:
                out.append(f"{name}: volumeMount {mount['name']} has no volume")
                continue
            if "emptyDir" in vol:
                ed = vol["emptyDir"] or {}
                if ed.get("medium") == "Memory":
                    out.append(f"{name}: disk tier on a tmpfs emptyDir")
                if d == PurePosixPath(mount["mountPath"]):
                    out.append(f"{name}: disk_cache_dir is the emptyDir root (world-writable, refused by the tier)")
                if "sizeLimit" not in ed or quantity(ed["sizeLimit"]) < gb * GIB:
                    out.append(f"{name}: emptyDir sizeLimit {ed.get('sizeLimit')} below disk_cache_gb {gb}")
                eph = s.get("resources", {}).get("requests", {}).get("custom", {}).get("ephemeral-storage")
                if eph is None or ("sizeLimit" in ed and quantity(eph) < quantity(ed["sizeLimit"])):
                    out.append(f"{name}: ephemeral-storage request {eph} below the emptyDir sizeLimit")
            elif not {"hostPath", "persistentVolumeClaim", "ephemeral"} & set(vol):
                out.append(f"{name}: disk tier volume {mount['name']} is not emptyDir/hostPath/PVC")
    return out


def check_memory(doc: dict) -> list[str]:
    out = []
    for name, s in workers(doc):
        for e in kvtc_entries(kv_config(s)):
            host = float(setting(s, e, "cpu_cache_gb") or 0) * GIB
            host += float(setting(s, e, "pool_segment_gb") or 0) * GIB  # the segment it contributes to the pool
            res = s.get("resources", {})
            try:
                req = quantity(res["requests"]["memory"])
                lim = quantity(res["limits"]["memory"])
            except (KeyError, TypeError):
                out.append(f"{name}: memory request and limit are required with a host tier")
                continue
            need = host + PROCESS_BASELINE_GIB * GIB
            if req <= need or lim <= need:
                out.append(
                    f"{name}: memory request {req / GIB:g}Gi / limit {lim / GIB:g}Gi not above host tier "
                    f"{host / GIB:g}Gi + {PROCESS_BASELINE_GIB}Gi"
                )
            if lim < req:
                out.append(f"{name}: memory limit below request")
    return out


def check_metrics(doc: dict) -> list[str]:
    out = []
    for name, s in workers(doc):
        for e in kvtc_entries(kv_config(s)):
            port = setting(s, e, "metrics_port")
            if port is None:
                out.append(f"{name}: no metrics_port")
                continue
            if setting(s, e, "metrics_host") in (None, "127.0.0.1", "localhost"):  # the default binds loopback only
                out.append(f"{name}: metrics_port {port} without a metrics_host a scraper can reach")
            ports = [p for p in container(s).get("ports", []) if p.get("containerPort") == int(port)]
            if not ports or not ports[0].get("name"):
                out.append(f"{name}: metrics port {port} is not exposed as a named containerPort")
            ann = s.get("extraPodMetadata", {}).get("annotations", {})
            if "prometheus.io/port" in ann and ann["prometheus.io/port"] != str(port):
                out.append(f"{name}: prometheus.io/port {ann['prometheus.io/port']} != metrics_port {port}")
    return out


def check_side_channel(doc: dict) -> list[str]:
    """dynamo.vllm sets VLLM_NIXL_SIDE_CHANNEL_HOST itself only for NixlConnector / PdConnector[NixlConnector]."""
    out = []
    for name, s in workers(doc):
        cfg = kv_config(s) or {}
        if cfg.get("kv_connector") != "MultiConnector":
            continue
        children = [c.get("kv_connector") for c in cfg.get("kv_connector_extra_config", {}).get("connectors", [])]
        host = env(s).get("VLLM_NIXL_SIDE_CHANNEL_HOST", {})
        if "NixlConnector" in children and host.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != (
            "status.podIP"
        ):
            out.append(f"{name}: MultiConnector with NixlConnector needs VLLM_NIXL_SIDE_CHANNEL_HOST=status.podIP")
    return out


CHECKS = [check_components, check_connector, check_disk_tier, check_memory, check_metrics, check_side_channel]


def problems(doc: dict) -> list[str]:
    out = schema_problems(doc)
    out += [p for p in schema_problems(doc, strict=True) if p not in out]
    for check in CHECKS:
        try:
            out += check(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a malformed document is a problem, not a crash
            out.append(f"{check.__name__}: {type(e).__name__}: {e}")
    return out


# ---------------------------------------------------------------------------------------------------------- tests
def test_manifest_set_and_vendored_crd():
    assert EXPECTED <= {p.name for p in MANIFESTS}
    head = CRD.read_text()[:2000]
    assert "SPDX-License-Identifier: Apache-2.0" in head and "Licensed under the Apache License" in head
    assert crd()["spec"]["names"]["kind"] == "DynamoGraphDeployment"
    note = (MANIFEST_DIR / "crds" / "README.md").read_text()
    assert "967e177cc5754a5c26c038744fd02f435600954c" in note


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_a_valid_dgd(path):
    docs = load(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        assert doc["apiVersion"] == "nvidia.com/v1alpha1" and doc["kind"] == "DynamoGraphDeployment"
        assert schema_problems(doc) == []
        assert schema_problems(doc, strict=True) == []


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_properties(path, check):
    for doc in load(path):
        assert check(doc) == []


def test_topologies():
    by = {p.name: load(p)[0] for p in MANIFESTS}
    agg, pre, xfer = by["agg-kvtc.yaml"], by["disagg-kvtc-prefill.yaml"], by["disagg-kvtc-transfer.yaml"]
    assert [kv_config(s)["kv_connector"] for _, s in workers(agg)] == [KVTC]

    def by_role(doc):
        return {s.get("subComponentType"): s for _, s in workers(doc)}

    p, d = by_role(pre)["prefill"], by_role(pre)["decode"]
    assert [c["kv_connector"] for c in kv_config(p)["kv_connector_extra_config"]["connectors"]] == [
        KVTC,
        "NixlConnector",
    ]
    assert kv_config(d) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert kvtc_entries(kv_config(p))[0]["kv_connector_extra_config"].get("transfer") is None

    tp2 = by["agg-kvtc-tp2.yaml"]  # one worker on two GPUs, the joint calibration (calibrate --tp-size 2)
    (_, w), (_, w1) = workers(tp2)[0], workers(agg)[0]
    assert arg_value(w, "--tensor-parallel-size") == "2" and w["resources"]["limits"]["gpu"] == "2"
    assert kv_config(w) == kv_config(w1)  # the same connector settings: TP needs none of its own

    p, d = by_role(xfer)["prefill"], by_role(xfer)["decode"]
    assert kv_config(p)["kv_connector_extra_config"]["transfer"] == "prefill"
    assert kv_config(d)["kv_connector_extra_config"]["transfer"] == "decode"
    assert container(d)["command"] == container(p)["command"] == ["python3", "-m", "dynamo.vllm"]


# ------------------------------------------------------------------ dynamo.vllm 1.6.1: which connector does PD
def _vllm_config(cfg: dict):
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id="wrapper-engine", **cfg))


def _prefill_workers():
    for path in MANIFESTS:
        for doc in load(path):
            for name, s in workers(doc):
                if s.get("subComponentType") == "prefill":
                    yield path.name, name, s


def _general_plugins() -> dict[str, str]:
    """The `vllm.general_plugins` entry points pyproject.toml declares (name -> module:function)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^(\w+) = "([\w.:]+)"', section, re.M))


def test_the_pd_protocol_plugin_acts_only_inside_dynamo_vllm(protocols, monkeypatch):
    from dynamo_kvtc.connector.vllm import dynamo_register

    assert _general_plugins()["dynamo_kvtc_pd_protocol"] == "dynamo_kvtc.connector.vllm.dynamo_register:register"
    argv = ["dynamo.vllm", "--kv-transfer-config", json.dumps({"kv_connector": KVTC, "kv_role": "kv_both"})]
    multi = ["dynamo.vllm", '--kv-transfer-config={"kv_connector": "MultiConnector"}']
    monkeypatch.delitem(sys.modules, dynamo_register.PROTOCOLS_MODULE)
    assert dynamo_register.register(argv) is False  # plain vLLM: nothing imported, nothing registered
    monkeypatch.setitem(sys.modules, dynamo_register.PROTOCOLS_MODULE, protocols)
    assert dynamo_register.register(multi) is False  # KvtcConnector beside NixlConnector: Nixl stays the PD one
    assert KVTC not in protocols.KV_CONNECTOR_PROTOCOLS
    assert dynamo_register.register(argv) is True
    assert protocols.KV_CONNECTOR_PROTOCOLS[KVTC] is protocols.NixlConnectorProtocol


@pytest.fixture
def protocols(monkeypatch):
    mod = pytest.importorskip("dynamo.vllm.kv_connector_protocols")
    monkeypatch.setattr(mod, "KV_CONNECTOR_PROTOCOLS", dict(mod.KV_CONNECTOR_PROTOCOLS))  # undo the plugin's edit
    return mod


def test_dynamo_rejects_a_bare_custom_pd_connector(protocols):
    """The finding the transfer manifest works around; if a Dynamo release changes it, revisit dynamo_register.py."""
    cfg = {"kv_connector": KVTC, "kv_connector_module_path": KVTC_MODULE, "kv_connector_extra_config": {}}
    with pytest.raises(ValueError, match="Unsupported kv_connector"):
        protocols.make_kv_connector_protocol(_vllm_config(cfg))
    only = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [{"kv_connector": KVTC}]}}
    with pytest.raises(ValueError, match="no PD-capable sub-connector"):
        protocols.make_kv_connector_protocol(_vllm_config(only))


@pytest.mark.parametrize("where", list(_prefill_workers()), ids=lambda w: f"{w[0]}:{w[1]}")
def test_prefill_worker_resolves_a_pd_protocol(protocols, monkeypatch, where):
    _, _, svc = where
    cmd = container(svc)["command"]
    cfg = kv_config(svc)
    assert cmd == ["python3", "-m", "dynamo.vllm"], cmd
    # What vLLM does in dynamo.vllm when it builds EngineArgs: run the package's `vllm.general_plugins` entry points
    # (with this worker's command line).
    monkeypatch.setattr(sys, "argv", [*cmd, *container(svc)["args"]])
    for target in _general_plugins().values():
        module, func = target.split(":")
        getattr(importlib.import_module(module), func)()
    proto = protocols.make_kv_connector_protocol(_vllm_config(cfg))
    assert isinstance(proto, protocols.NixlConnectorProtocol)
    assert proto.prefill_request_kv_transfer_params()["do_remote_decode"] is True
    bound = proto._vllm_config.kv_transfer_config
    if cfg["kv_connector"] in WRAPPERS:
        assert bound.kv_connector == "NixlConnector"  # the hand-off goes through NIXL, our tiers ride along
    else:
        assert bound.kv_connector == KVTC  # our connector does the hand-off
    # The decode side gets the prefill engine's params unchanged.
    marker = {"kvtc": "params"}
    assert proto.decode_request_kv_transfer_params(SimpleNamespace(kv_transfer_params=marker)) is marker


def test_settings_are_accepted_by_the_connector(tmp_path):
    """Parse each KvtcConnector entry (extra config + DYN_KVTC_* variables) with the connector's own config code."""
    cfgmod = pytest.importorskip("dynamo_kvtc.connector.config")
    secret = tmp_path / "secret"  # what the mounted Kubernetes Secret holds in a pod (read at config time)
    secret.write_bytes(b"a cluster secret of at least 16 bytes")
    seen = 0
    for path in MANIFESTS:
        for doc in load(path):
            for name, s in workers(doc):
                for e in kvtc_entries(kv_config(s)):
                    extra = e.get("kv_connector_extra_config", {})
                    if not POOL_ROWS:  # before the pool tier's rows exist the connector refuses their keys
                        extra = {k: v for k, v in extra.items() if k not in POOL_KEYS}
                    if "transfer_secret_file" in extra:
                        extra = {**extra, "transfer_secret_file": str(secret)}
                    variables = {k: v.get("value", "10.1.2.3") for k, v in env(s).items() if k.startswith("DYN_KVTC_")}
                    c = cfgmod.ConnectorConfig.from_sources(extra, env=variables)
                    assert c.tiers.host_bytes == extra["cpu_cache_gb"] * GIB, name
                    assert c.tiers.disk_bytes == extra.get("disk_cache_gb", 0) * GIB, name
                    assert c.metrics_port == extra["metrics_port"] and c.transfer == extra.get("transfer", "")
                    if c.transfer == "prefill":
                        assert c.transfer_host == "10.1.2.3"  # from the downward API, not the 127.0.0.1 default
                    seen += 1
    # agg, agg TP=2, the two disaggregated prefill workers, the decode worker with hand-off, and the two pool workers
    assert seen == 7


# ---------------------------------------------------------------------------------------------------------- negative
def _agg():
    return load(MANIFEST_DIR / "agg-kvtc.yaml")[0]


def _prefill():
    return load(MANIFEST_DIR / "disagg-kvtc-prefill.yaml")[0]


def _worker(doc, name="VllmWorker"):
    return doc["spec"]["services"][name]


def _set_kv(doc, name, fn):
    args = container(_worker(doc, name))["args"]
    i = args.index("--kv-transfer-config") + 1
    cfg = json.loads(args[i])
    fn(cfg)
    args[i] = json.dumps(cfg)


def _extra(cfg):
    return cfg["kv_connector_extra_config"]


BROKEN = {
    "replicas-not-an-integer": (_agg, lambda d: _worker(d).__setitem__("replicas", "one")),
    "unknown-backend-framework": (_agg, lambda d: d["spec"].__setitem__("backendFramework", "vllm-kvtc")),
    "args-not-a-list": (_agg, lambda d: container(_worker(d)).__setitem__("args", "--model x")),
    "misspelled-field": (_agg, lambda d: container(_worker(d)).__setitem__("volumeMount", [])),
    "unknown-component-type": (_agg, lambda d: _worker(d).__setitem__("componentType", "wroker")),
    "kv-config-not-json": (
        _agg,
        lambda d: container(_worker(d))["args"].__setitem__(-1, "{'kv_connector': 'KvtcConnector'}"),
    ),
    "wrong-module": (
        _agg,
        lambda d: _set_kv(d, "VllmWorker", lambda c: c.__setitem__("kv_connector_module_path", "x")),
    ),
    "unknown-setting": (_agg, lambda d: _set_kv(d, "VllmWorker", lambda c: _extra(c).__setitem__("cpu_cache_gib", 4))),
    "host-tier-above-memory": (
        _agg,
        lambda d: _set_kv(d, "VllmWorker", lambda c: _extra(c).__setitem__("cpu_cache_gb", 70)),
    ),
    "disk-dir-on-overlayfs": (
        _agg,
        lambda d: _set_kv(d, "VllmWorker", lambda c: _extra(c).__setitem__("disk_cache_dir", "/tmp/kvtc")),
    ),
    "disk-dir-is-emptydir-root": (
        _agg,
        lambda d: _set_kv(d, "VllmWorker", lambda c: _extra(c).__setitem__("disk_cache_dir", "/kvtc-disk")),
    ),
    "metrics-port-not-exposed": (_agg, lambda d: container(_worker(d)).__setitem__("ports", [])),
    "no-enforce-eager": (_agg, lambda d: container(_worker(d))["args"].remove("--enforce-eager")),
    "nixl-before-kvtc": (
        _prefill,
        lambda d: _set_kv(d, "VllmPrefillWorker", lambda c: _extra(c)["connectors"].reverse()),
    ),
    "multi-without-recompute-policy": (
        _prefill,
        lambda d: _set_kv(d, "VllmPrefillWorker", lambda c: c.pop("kv_load_failure_policy")),
    ),
    "multi-with-fail-policy": (
        _prefill,
        lambda d: _set_kv(d, "VllmPrefillWorker", lambda c: c.__setitem__("kv_load_failure_policy", "fail")),
    ),
    "no-side-channel-host": (_prefill, lambda d: _worker(d, "VllmPrefillWorker").__setitem__("envs", [])),
    "transfer-host-loopback": (
        lambda: load(MANIFEST_DIR / "disagg-kvtc-transfer.yaml")[0],
        lambda d: _worker(d, "VllmPrefillWorker").__setitem__("envs", []),
    ),
    "mode-mismatch": (_prefill, lambda d: _worker(d, "VllmPrefillWorker").__setitem__("subComponentType", "decode")),
    "handoff-secret-not-mounted": (
        lambda: load(MANIFEST_DIR / "disagg-kvtc-transfer.yaml")[0],
        lambda d: container(_worker(d, "VllmDecodeWorker")).__setitem__("volumeMounts", []),
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_copy_is_caught(case):
    make, breaker = BROKEN[case]
    doc = make()
    assert problems(doc) == [], "the unbroken manifest must pass"
    broken = copy.deepcopy(doc)
    breaker(broken)
    assert problems(broken), f"{case} was not caught"


def test_schema_alone_catches_type_errors_and_strict_mode_catches_typos():
    doc = _agg()
    bad = copy.deepcopy(doc)
    _worker(bad)["replicas"] = "one"
    assert any("replicas" in p for p in schema_problems(bad))
    typo = copy.deepcopy(doc)
    container(_worker(typo))["volumeMount"] = []
    assert schema_problems(typo) == []  # plain JSON Schema allows unknown fields ...
    assert any("volumeMount" in p for p in schema_problems(typo, strict=True))  # ... kubectl's strict mode does not
    odd = copy.deepcopy(doc)
    _worker(odd)["componentType"] = "wroker"
    assert schema_problems(odd, strict=True) == []  # a free string in the CRD: only check_components catches it
    assert check_components(odd)
