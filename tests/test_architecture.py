"""The house rules of docs/architecture.md, checked on the source: imports point one way, one home per concept.

Read with ``ast`` (nothing is imported), so a violation names the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "dynamo_kvtc"

EVERY_ROOM = {"codec", "calibration", "transport", "evaluation", "tiers", "connector", "bench", "reliability", "demo",
              "cli"}
# room -> rooms it must never import (anything above it in docs/architecture.md's picture)
ABOVE = {
    "codec": {"calibration", "transport", "evaluation", "tiers", "connector", "bench", "reliability", "demo", "cli"},
    "calibration": {"transport", "evaluation", "tiers", "connector", "bench", "reliability", "demo", "cli"},
    "transport": {"evaluation", "tiers", "connector", "bench", "reliability", "demo", "cli"},
    "tiers": {"evaluation", "connector", "bench", "reliability", "demo", "cli"},
    "connector": {"evaluation", "bench", "reliability", "demo", "cli"},
    "bench": {"reliability", "cli"},
    "reliability": {"cli"},
    "demo": {"cli"},
    "settings": EVERY_ROOM,
    "errors.py": EVERY_ROOM,
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        yield rel, ast.parse(path.read_text(), filename=str(path))


def _package_of(rel: Path) -> list[str]:
    return ["dynamo_kvtc", *rel.with_suffix("").parts]


def _imported(rel: Path, node: ast.AST) -> list[tuple[str, list[str]]]:
    """(absolute dynamo_kvtc module, names) of one import statement; other packages are skipped."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names if a.name.startswith("dynamo_kvtc")]
    if not isinstance(node, ast.ImportFrom):
        return []
    names = [a.name for a in node.names]
    if node.level == 0:
        return [(node.module, names)] if (node.module or "").startswith("dynamo_kvtc") else []
    here = _package_of(rel)[:-1]  # the package this module is in
    base = here[: len(here) - (node.level - 1)]
    return [(".".join(base + ([node.module] if node.module else [])), names)]


def _room(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2:
        return ""
    return parts[1] + (".py" if parts[1] == "errors" else "")


def test_imports_point_one_way():
    bad = []
    for rel, tree in _modules():
        if rel.name == "__main__.py":
            continue  # an entry point (``python -m``) may dispatch through the CLI, like the console script
        room = rel.parts[0] if len(rel.parts) > 1 else rel.name
        for node in ast.walk(tree):
            for module, _ in _imported(rel, node):
                if _room(module) in ABOVE.get(room, set()):
                    bad.append(f"{rel}:{node.lineno} ({room}) imports {module}")
    assert not bad, "imports pointing up the layers:\n" + "\n".join(bad)


def _module_name(rel: Path) -> str:
    return ".".join(_package_of(rel)).removesuffix(".__init__")


def test_no_import_circle():
    """No two modules import each other, directly or through others (function-local and TYPE_CHECKING imports count:
    a circle is a knot in the design whatever defers it). ``from package import module`` depends on the module, not on
    the package's ``__init__`` (the packages export lazily)."""
    trees = dict(_modules())
    names = {_module_name(rel) for rel in trees}
    graph: dict[str, set[str]] = {}
    for rel, tree in trees.items():
        deps: set[str] = set()
        for node in ast.walk(tree):
            for module, imported in _imported(rel, node):
                subs = [f"{module}.{n}" for n in imported]
                deps.update(x for x in subs if x in names)
                if not imported or any(x not in names for x in subs):
                    deps.add(module)
        graph[_module_name(rel)] = {d for d in deps if d in names and d != _module_name(rel)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_module_over_500_lines():
    long = {str(rel): n for rel, _ in _modules() if (n := len((PKG / rel).read_text().splitlines())) > 500}
    assert not long, f"split by concept: {long}"


BLOB_FORMS = {"memoryview", "tuple", "HostLease", "BlobView", "ArrivingView"}  # asked of any value: a blob's forms
BYTES_FORMS = {"bytes", "bytearray"}  # asked of a value named like a blob (a message field may be checked for bytes)
BLOB_NAMES = ("blob", "view", "lease", "data")
BLOB_VIEW_API = {"host", "host_view", "wait_for", "settle", "consumed", "release", "header", "slice", "arriving",
                 "tobytes", "blob", "view"}


def _blob_form_switches(tree: ast.AST) -> list[tuple[int, str]]:
    """``isinstance(x, <a blob's form>)`` and ``hasattr(x, <a BlobView method>)`` calls in one module."""
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and len(n.args) == 2):
            continue
        if n.func.id == "isinstance":
            kinds = n.args[1].elts if isinstance(n.args[1], ast.Tuple) else [n.args[1]]
            names = {k.attr if isinstance(k, ast.Attribute) else getattr(k, "id", None) for k in kinds}
            if names & BLOB_FORMS or (names & BYTES_FORMS and any(w in ast.unparse(n.args[0]) for w in BLOB_NAMES)):
                out.append((n.lineno, f"isinstance(..., {ast.unparse(n.args[1])})"))
        if n.func.id == "hasattr" and isinstance(n.args[1], ast.Constant) and n.args[1].value in BLOB_VIEW_API:
            out.append((n.lineno, f"hasattr(..., {n.args[1].value!r})"))
    return out


def test_blob_forms_are_told_apart_in_blob_view_only():
    """A stored blob travels as a ``BlobView`` (codec/blob.py) from the tiers to the codec: no other module of the data
    path (codec, tiers, transport, connector) asks whether a value is bytes, a memoryview, a tuple, a host lease or
    a view, or whether it has a view's methods; ``BlobView.of`` is the one place that tells the forms apart."""
    rooms = ("codec", "tiers", "transport", "connector")
    bad = [
        f"{rel}:{line} {what}"
        for rel, tree in _modules()
        if rel.parts[0] in rooms and rel.as_posix() != "codec/blob.py"
        for line, what in _blob_form_switches(tree)
    ]
    assert not bad, bad


def test_the_blob_form_rule_catches_a_type_switch():
    """The rule above fails on the switches it is there to forbid (the restorer's and keys.py's of before)."""
    before = ast.parse(
        "if isinstance(got, HostLease):\n    blob = got.blob()\nelif isinstance(got, (bytes, memoryview)):\n    pass\n"
        "if not hasattr(blob, 'host'):\n    pass\nok = isinstance(r.blob, bytes) or isinstance(mac, bytes)\n"
    )
    assert [line for line, _ in _blob_form_switches(before)] == [1, 3, 5, 7]


def test_no_private_name_crosses_a_module():
    bad = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            for module, names in _imported(rel, node):
                for name in names:
                    if name.startswith("_") and module != ".".join(_package_of(rel)):
                        bad.append(f"{rel}:{node.lineno} imports {module}.{name}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_function_over_120_lines():
    long = [
        f"{rel}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for rel, tree in _modules()
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 120
    ]
    assert not long, long


def _calls(tree: ast.AST, attr: str):
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr:
            yield n


def test_one_control_channel():
    """Control messages are parsed in transport/channel.py only (the blob header in codec/container.py is the blob
    format, below the tiers); ZMQ sockets are made there only (the reliability harness's fake peers, which must send
    arbitrary bytes, excepted); one NIXL wait loop (transport/nixl_io.py; the harness's fault-injecting agent
    excepted)."""
    homes = {
        "unpackb": {"transport/channel.py", "codec/container.py"},
        "socket": {"transport/channel.py", "reliability/transfer_faults.py"},
        "check_xfer_state": {"transport/nixl_io.py", "reliability/nixl_faults.py"},
    }
    bad = []
    for rel, tree in _modules():
        for attr, allowed in homes.items():
            for call in _calls(tree, attr):
                if rel.as_posix() not in allowed and not (attr == "socket" and "zmq" not in ast.unparse(call)):
                    bad.append(f"{rel}:{call.lineno} calls .{attr}")
    assert not bad, bad


def test_settings_are_read_through_the_table():
    """No module but the settings package reads a DYN_KVTC_* variable itself."""
    bad = []
    for rel, tree in _modules():
        if rel.parts[0] == "settings":
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("DYN_KVTC_"):
                parent_calls = [c for c in _calls(tree, "get") if n in ast.walk(c)] + [
                    s for s in ast.walk(tree) if isinstance(s, ast.Subscript) and n in ast.walk(s)
                ]
                if parent_calls:
                    bad.append(f"{rel}:{n.lineno} reads {n.value}")
    assert not bad, bad


ENV_READERS = {"settings/__init__.py", "tiers/config.py", "connector/config.py"}  # where the environment is parsed


def test_settings_are_parsed_once_by_the_configs():
    """``settings.env_value``/``env_is_set`` (a process knob read from the environment where it is used) are called
    only by the settings package and the config modules: everything else gets its settings passed down from the configs
    built at start-up (or, in the offline tools, from ``settings.tool_settings()``)."""
    callers = set()
    for rel, tree in _modules():
        for attr in ("env_value", "env_is_set"):
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == attr}
            if list(_calls(tree, attr)) or names:
                callers.add(rel.as_posix())
    assert callers <= ENV_READERS, f"read the environment below the configs: {sorted(callers - ENV_READERS)}"


def test_declared_dependencies_cover_what_is_imported():
    """`pip install dynamo-kvtc` alone gives a working connector: every third-party module the package imports is
    declared in pyproject (or an extra), or is vLLM/Dynamo/NIXL/nvCOMP, which the engine's own image brings."""
    import re
    import sys

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((PKG.parent / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in meta["dependencies"]}
    extras = {re.split(r"[<>=!~ \[]", d)[0].lower() for ds in meta["optional-dependencies"].values() for d in ds}
    dist_of = {"zmq": "pyzmq", "prometheus_client": "prometheus-client", "yaml": "pyyaml"}
    # the image's (vLLM: msgspec); lmcache: the LMCache server that loads our serde brings it
    engine = {"vllm", "msgspec", "dynamo", "nixl", "nixl_cu13", "nvidia", "triton", "lmcache"}
    core, optional = set(), set()
    for rel, tree in _modules():
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("dynamo_kvtc", "__future__") or top in engine:
                    continue
                serving = rel.parts[0] in ("codec", "tiers", "transport", "connector", "settings", "errors.py")
                (core if serving else optional).add(dist_of.get(top, top).replace("_", "-").lower())
    assert core <= declared, f"imported by the connector's layers but not declared: {sorted(core - declared)}"
    assert optional <= declared | extras, f"imported but declared nowhere: {sorted(optional - declared - extras)}"
