"""Kubernetes manifests of the cluster KV pool: the Mooncake master (manifests/pool/) and the workers pointed at it.

The DynamoGraphDeployments (manifests/*-pool.yaml) go through every check of tests/test_manifests.py (schema, connector,
memory with the pool segment, metrics); this file adds what a pool needs: each worker's ``pool_master`` and
``pool_metadata_server`` name the master's Service and ports, the pool is sealed by a cluster secret mounted from a
Kubernetes Secret (``pool_insecure`` is never shipped), the protocol is one the tier knows, the workers carry the
label the master's NetworkPolicy admits; and the master's own objects (Deployment, Service, NetworkPolicy, the optional
etcd) agree with each other. Broken copies show each check catches what it is for."""

from __future__ import annotations

import copy
import json
import re
from urllib.parse import urlparse

import pytest

from .test_manifests import (
    MANIFEST_DIR,
    MANIFESTS,
    _secret_problems,
    _set_kv,
    _worker,
    container,
    kv_config,
    kvtc_entries,
    load,
    problems,
    setting,
    workers,
)

POOL_DIR = MANIFEST_DIR / "pool"
MASTER = POOL_DIR / "mooncake-master.yaml"
ETCD = POOL_DIR / "mooncake-etcd.yaml"
POOL_MANIFESTS = [p for p in MANIFESTS if p.name.endswith("-pool.yaml")]
MEMBER = ("dynamo-kvtc-pool", "member")  # the pod label the master's NetworkPolicy admits


def _by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def master_endpoints(docs: list[dict] | None = None) -> dict[str, tuple[str, int]]:
    """The master Service's ports by name: (service name, port)."""
    svc = _by_kind(docs or load(MASTER))["Service"]
    return {p["name"]: (svc["metadata"]["name"], int(p["port"])) for p in svc["spec"]["ports"]}


def check_pool(doc: dict, master: dict[str, tuple[str, int]] | None = None) -> list[str]:
    """Every KvtcConnector with a pool: it reaches the master's Service, is sealed by a mounted Secret, speaks a known
    protocol, and its pod is a pool member."""
    master = master or master_endpoints()
    out = []
    for name, s in workers(doc):
        for e in kvtc_entries(kv_config(s)):
            addr = setting(s, e, "pool_master")
            if addr is None:
                continue
            host, _, port = str(addr).rpartition(":")
            if (host, int(port or 0)) != master["rpc"]:
                out.append(f"{name}: pool_master {addr!r} is not the master Service's rpc port {master['rpc']}")
            md = urlparse(str(setting(s, e, "pool_metadata_server") or ""))
            if (md.hostname, md.port) != master["metadata"] or md.scheme != "http" or md.path != "/metadata":
                out.append(f"{name}: pool_metadata_server is not http://<master>:{master['metadata'][1]}/metadata")
            if setting(s, e, "pool_insecure") in (True, "true", "1"):
                out.append(f"{name}: pool_insecure: anyone reaching the master would read prompts (not shipped)")
            out += _secret_problems(name, s, setting(s, e, "transfer_secret_file"))
            proto = setting(s, e, "pool_protocol") or "tcp"
            if proto not in ("tcp", "rdma"):
                out.append(f"{name}: pool_protocol {proto!r} is neither tcp nor rdma")
            if proto == "rdma" and not setting(s, e, "pool_device"):
                out.append(f"{name}: pool_protocol rdma needs pool_device")
            if float(setting(s, e, "pool_segment_gb") or 0) <= 0:
                out.append(f"{name}: a pool worker that contributes no segment (pool_segment_gb)")
            if float(setting(s, e, "pool_timeout_s") or 2.0) <= 0:
                out.append(f"{name}: pool_timeout_s must be positive (a read's deadline)")
            labels = s.get("extraPodMetadata", {}).get("labels", {})
            if labels.get(MEMBER[0]) != MEMBER[1]:
                out.append(f"{name}: pod is not labelled {MEMBER[0]}={MEMBER[1]} (the master admits only members)")
            if int(s.get("replicas", 1)) < 2:
                out.append(f"{name}: a pool among fewer than two workers moves nothing")
    return out


# ---------------------------------------------------------------------------------------------------------- tests
def test_pool_manifests_exist_and_every_worker_uses_the_pool():
    assert sorted(p.name for p in POOL_MANIFESTS) == ["agg-kvtc-pool.yaml", "disagg-kvtc-pool.yaml"]
    for path in POOL_MANIFESTS:
        (doc,) = load(path)
        pooled = [n for n, s in workers(doc) for e in kvtc_entries(kv_config(s)) if setting(s, e, "pool_master")]
        assert pooled, path.name
        assert problems(doc) == []  # every check of test_manifests.py, memory with the pool segment
        assert check_pool(doc) == []


def test_pool_workers_keep_the_settings_of_their_single_worker_manifests():
    """The pool manifests are the agg / disagg-prefill ones plus the pool: the same tier settings otherwise."""
    pairs = {"agg-kvtc-pool.yaml": ("agg-kvtc.yaml", "VllmWorker"),
             "disagg-kvtc-pool.yaml": ("disagg-kvtc-prefill.yaml", "VllmPrefillWorker")}
    for pool_name, (base_name, worker) in pairs.items():
        (pool,), (base,) = load(MANIFEST_DIR / pool_name), load(MANIFEST_DIR / base_name)
        (pe,), (be,) = kvtc_entries(kv_config(_worker(pool, worker))), kvtc_entries(kv_config(_worker(base, worker)))
        extra = {k: v for k, v in pe["kv_connector_extra_config"].items()
                 if not k.startswith("pool_") and k != "transfer_secret_file"}
        assert extra == be["kv_connector_extra_config"], pool_name


def test_master_objects_agree():
    docs = load(MASTER)
    kinds = _by_kind(docs)
    assert sorted(kinds) == ["Deployment", "NetworkPolicy", "Service"]
    dep, svc, pol = kinds["Deployment"], kinds["Service"], kinds["NetworkPolicy"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert dep["spec"]["replicas"] == 1  # without etcd two masters would be two pools
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["mooncake_master"]
    args = dict(a.lstrip("-").split("=", 1) for a in c["args"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(args["rpc_port"]) == ports["rpc"]
    assert args["enable_http_metadata_server"] == "true" and args["http_metadata_server_host"] == "0.0.0.0"
    assert int(args["http_metadata_server_port"]) == ports["metadata"] and int(args["metrics_port"]) == ports["metrics"]
    assert 0 < float(args["eviction_high_watermark_ratio"]) <= 1 and 0 < float(args["eviction_ratio"]) < 1
    for p in svc["spec"]["ports"]:  # each Service port reaches a named container port
        assert p["targetPort"] in ports, p
    ep = master_endpoints(docs)
    assert ep["rpc"] == ("mooncake-master", ports["rpc"]) and ep["metadata"][1] == ports["metadata"]
    # only pool members reach the rpc and metadata ports
    member_rule = next(r for r in pol["spec"]["ingress"] if "from" in r)
    assert member_rule["from"] == [{"podSelector": {"matchLabels": dict([MEMBER])}}]
    assert {p["port"] for p in member_rule["ports"]} == {ports["rpc"], ports["metadata"]}
    assert all("from" in r or {p["port"] for p in r["ports"]} == {ports["metrics"]} for r in pol["spec"]["ingress"])


def test_optional_etcd_matches_the_endpoints_the_master_is_told():
    kinds = _by_kind(load(ETCD))
    sts, svc = kinds["StatefulSet"], kinds["Service"]
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    n = sts["spec"]["replicas"]
    assert n % 2 == 1 and n >= 3  # a quorum survives one member's loss
    members = [f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}" for i in range(n)]
    text = ETCD.read_text()
    told = re.search(r"--etcd_endpoints=(\S+)", text).group(1).split(";")  # what the master's args must say
    assert told == [f"http://{m}:2379" for m in members]
    assert "--enable_ha=true" in text
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert all(f"{m.split('.')[0]}=http://{m}:2380" in c["args"][0] for m in members)


def _agg_pool():
    return load(MANIFEST_DIR / "agg-kvtc-pool.yaml")[0]


def _extra_of(doc, name="VllmWorker"):
    return json.loads(container(_worker(doc, name))["args"][-1])["kv_connector_extra_config"]


BROKEN = {
    "pool-master-elsewhere": lambda d: _set_kv(
        d, "VllmWorker", lambda c: c["kv_connector_extra_config"].__setitem__("pool_master", "mooncake:50051")
    ),
    "pool-metadata-wrong-port": lambda d: _set_kv(
        d, "VllmWorker",
        lambda c: c["kv_connector_extra_config"].__setitem__("pool_metadata_server", "http://mooncake-master:9/metadata"),
    ),
    "pool-insecure": lambda d: _set_kv(
        d, "VllmWorker", lambda c: c["kv_connector_extra_config"].__setitem__("pool_insecure", True)
    ),
    "pool-secret-not-mounted": lambda d: container(_worker(d)).__setitem__(
        "volumeMounts", [m for m in container(_worker(d))["volumeMounts"] if m["name"] != "kvtc-pool-secret"]
    ),
    "pool-without-secret": lambda d: _set_kv(
        d, "VllmWorker", lambda c: c["kv_connector_extra_config"].pop("transfer_secret_file")
    ),
    "pool-rdma-without-device": lambda d: _set_kv(
        d, "VllmWorker", lambda c: c["kv_connector_extra_config"].__setitem__("pool_protocol", "rdma")
    ),
    "pool-not-a-member": lambda d: _worker(d)["extraPodMetadata"]["labels"].pop(MEMBER[0]),
    "pool-one-worker": lambda d: _worker(d).__setitem__("replicas", 1),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_pool_copy_is_caught(case):
    doc = _agg_pool()
    assert check_pool(doc) == [], "the unbroken manifest must pass"
    broken = copy.deepcopy(doc)
    BROKEN[case](broken)
    assert check_pool(broken), f"{case} was not caught"


def test_the_pool_segment_counts_in_the_memory_check():
    doc = _agg_pool()
    extra = _extra_of(doc)
    req = int(_worker(doc)["resources"]["requests"]["memory"].removesuffix("Gi"))
    assert problems(doc) == []
    big = copy.deepcopy(doc)  # a segment that with the host tier no longer fits the request
    _set_kv(big, "VllmWorker", lambda c: c["kv_connector_extra_config"].__setitem__(
        "pool_segment_gb", req - extra["cpu_cache_gb"]))
    assert any("memory" in p for p in problems(big))
