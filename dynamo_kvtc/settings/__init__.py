"""Every ``DYN_KVTC_*`` setting in one table, one parser for all of them, and the configuration reference made from it.

``SETTINGS`` lists each setting the package reads: its key (also the ``kv_connector_extra_config`` key), its
environment variable (``DYN_KVTC_<KEY>``), its type, default, bounds or choices, what it means, and its scope, i.e.
who reads it:

- ``tier``: a :class:`~dynamo_kvtc.tiers.config.TierConfig` field (``TierConfig.from_env``; the connector too),
- ``connector``: a :class:`~dynamo_kvtc.connector.config.ConnectorConfig` field (``ConnectorConfig.from_sources``),
- ``process``: a process-wide knob, environment only. A serving process parses these at start-up into its config
  objects too (``TierConfig.codec``/``codec_sms``, the hand-off's ``ConnectorConfig`` fields) and passes them down;
  the offline tools' paths and switches are :func:`tool_settings`. Nothing else reads the environment.
- ``option``: an option of the other ways in only (the vLLM ``kvtc`` tier's ``secondary_tiers`` entry, the LMCache
  ``kvtc`` serde's ``serde`` config), neither an extra-config key nor a variable.

Each row also says which **ways in** read it (``ways``, :data:`WAYS`): ``extra`` (KvtcConnector's
``kv_connector_extra_config``), ``vllm_tier`` (the vLLM tier's entry), ``lmcache_serde`` (the LMCache serde's config)
and ``env`` (the ``DYN_KVTC_*`` variable). A setting the three read has one default for all of them. The tier's and
the serde's option parsers are front-ends over this table (:func:`read_options`): the same parser, bounds, choices
(``way_choices`` narrows them where a way in implements fewer) and error wording, naming the option where it was
written (:func:`origin`).

Tier and connector settings come from ``kv_connector_extra_config`` (wins) or the environment. Every raw value goes
through :func:`parse`, which returns the typed value or raises :class:`~dynamo_kvtc.errors.ConfigError` naming the
key, where the value came from and what is wrong; a config built directly checks its typed fields with :func:`check`
(the same bounds and choices). A ``DYN_KVTC_*`` variable that is not in the table gets one warning naming the
closest known one (:func:`warn_unknown`, run whenever settings are read from the environment).

``python -m dynamo_kvtc.settings`` prints the reference table of ``docs/configuration.md`` (:mod:`.reference` makes
it); ``--check PATH`` fails when that file's table is stale, ``--write PATH`` regenerates it.

This is a foundation package: it imports the standard library and :mod:`dynamo_kvtc.errors` only.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .pool import POOL_ROWS
from .row import SCOPES, TYPES, WAYS, Setting  # noqa: F401 - the package exports the row's words too

log = logging.getLogger(__name__)
GB = 1 << 30
PREFIX = "DYN_KVTC_"
WAY_LABELS = {"extra": "KvtcConnector", "vllm_tier": "vLLM tier", "lmcache_serde": "LMCache serde", "env": "env"}
_ORIGINS = {  # how an error names where a value was written
    "extra": "kv_connector_extra_config.{key}",
    "vllm_tier": "secondary_tiers[type=kvtc].{key}",
    "lmcache_serde": "serde[type=kvtc].{key}",
}
_ENTRIES = {"extra": "kv_connector_extra_config keys for KvtcConnector", "vllm_tier": "secondary_tiers[type=kvtc] keys",
            "lmcache_serde": "serde[type=kvtc] keys"}  # fmt: skip
PORT = "a port number (0-65535)"
RB_CONN = "`ConnectorConfig` (hand-off)"  # what parses a process-wide setting at start-up and passes it down
RB_CODEC = "`TierConfig.codec`"
RB_TIER = "`TierConfig.codec_sms`"
RB_TOOL = "`tool_settings()` (offline tools)"
RB_LOOKUP = "`tool_settings()` (offline tools; the worker's calibration lookup)"
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def _s(key: str, type: str, default: Any, doc: str, scope: str, **kw: Any) -> Setting:
    return Setting(key, type, default, doc, scope, **kw)


SETTINGS: tuple[Setting, ...] = (
    # -- tiers (TierConfig fields) ---------------------------------------------------------------------------------
    _s("cpu_cache_gb", "gb", 1, "compressed host tier size, total across the TP group (each rank allocates "
       "cpu_cache_gb / TP in one arena; the vLLM tier: its blob LRU, > 0; 0 and no disk tier stops the engine)", "tier",
       field="host_bytes", lo=0, hi=1 << 20, ways=("vllm_tier",)),
    _s("disk_cache_gb", "gb", 0, "compressed disk tier size, total across the TP group (each rank disk_cache_gb / TP "
       "in `disk_cache_dir/rank<r>`; 0 = none; needs `disk_cache_dir`)", "tier",
       field="disk_bytes", lo=0, hi=1 << 20, ways=("vllm_tier",)),
    _s("disk_cache_dir", "path", None, "disk tier directory (owned by the store, 0700; one that cannot be used stops "
       "the engine: parent missing, not writable, /proc, group- or world-writable)", "tier", field="disk_dir",
       default_doc="none", ways=("vllm_tier",)),
    _s("ratio", "float", 16, "default compression ratio (a plan of the calibration); `auto`: the largest ratio within "
       "the accuracy budget of the calibration's check verdict (`dynamo-kvtc check CAL --model M --write`; without "
       "one every way in stops the engine naming the command: a ratio policy that cannot be resolved)",
       "tier", lo=0, lo_open=True, words=("auto",), ways=("vllm_tier", "lmcache_serde")),
    _s("max_ratio", "float", None, "accuracy floor: never compress harder, even under pressure", "tier", lo=0,
       lo_open=True, default_doc="`ratio`"),
    _s("min_tokens", "int", 64, "sequences shorter than this bypass the tiers", "tier", lo=0),
    _s("offload_min_frequency", "int", 1, "offload a block once seen this often", "tier", field="min_frequency",
       lo=1),
    _s("window", "int", 128, "most recent tokens of a saved prompt kept raw", "tier", lo=0),
    _s("sinks", "int", 4, "first tokens of a sequence kept in fp8 (attention sinks)", "tier", lo=0),
    _s("disk_fsync", "bool", False, "fsync each committed disk blob (off: a cache may lose its last writes on power "
       "loss; a torn file is never served: dropped at start-up when its header or size is wrong, else at its first "
       "read by the blob's CRC)", "tier", field="fsync"),
    _s("disk_min_uses", "int", 2, "write a blob to disk on host eviction only once it was used this often (its "
       "offload counts once, every restore once; 1 = every eviction)", "tier", lo=1),
    _s("page_bytes", "int", 16384, "page size of the host-tier arena (a power of two)", "tier", lo=512),
    _s("nixl_timeout_s", "float", 30, "deadline of one disk-tier NIXL transfer", "tier", lo=0, lo_open=True),
    _s("ratio_policy", "str", "fixed", "`fixed`: every offload at `ratio` (higher under host-tier pressure, up to "
       "`max_ratio`); `raw_first`: store uncompressed while the host tier has room (below 90% full with the new "
       "blob), compress once it has not; `raw`: never compress (a raw tier: the serving benchmark's baseline; the "
       "vLLM tier and the LMCache serde: lossless). The vLLM tier and the LMCache serde take `fixed` or `raw`",
       "tier", choices=("fixed", "raw_first", "raw"), ways=("vllm_tier", "lmcache_serde"),
       way_choices=(("vllm_tier", ("fixed", "raw")), ("lmcache_serde", ("fixed", "raw")))),
    _s("offload_queue_gb", "gb", 1, "memory the offload queue of each rank may hold: the copies of saved blocks' K/V "
       "waiting for their encode (device memory on a GPU; one save larger than this still goes through alone). A save "
       "that would go over is skipped, nothing copied, and counted "
       "(`kvtc_fallbacks_total{reason=\"offload_queue_full\"}`): a later miss, never a wrong block", "tier",
       field="offload_queue_bytes", lo=0, lo_open=True, hi=1 << 20),
    *POOL_ROWS,  # the pool tier's (pool.py)
    # -- connector (ConnectorConfig fields) ------------------------------------------------------------------------
    _s("calibration", "path", None, "calibration dir (TP: a `rank<r>` folder per rank; the LMCache serde: required, "
       "it is told no model name)", "connector",
       default_doc="`<model name, lowercased>/` under `DYN_KVTC_CALIBRATIONS` (docs/byom.md), then "
                   "`<cache>/calibrations`", ways=("vllm_tier", "lmcache_serde")),
    _s("flush_tokens", "int", 256, "while decoding, offload once this many new tokens filled blocks", "connector",
       lo=1),
    _s("load_timeout_s", "float", 30, "longest wait for one layer's restore before falling back", "connector", lo=0,
       lo_open=True),
    _s("load_failure_policy", "str", "recompute", "vLLM's kv_load_failure_policy", "connector",
       choices=("recompute", "fail")),
    _s("metrics_port", "int", None, "Prometheus endpoint on the worker (rank 0), 0 = any free port", "connector",
       lo=0, hi=65535, rule=PORT, default_doc="off"),
    _s("metrics_host", "str", "127.0.0.1", "address the Prometheus endpoint binds (loopback unless set: "
       "`0.0.0.0` for a scraper outside the pod)", "connector"),
    _s("publish_events", "bool", True, "tier events into vLLM's KV event stream (router)", "connector"),
    _s("transfer", "str", "", "compressed prefill→decode transfer: this engine's side", "connector",
       choices=("", "prefill", "decode"), default_doc="off"),
    _s("nixl_backend", "str", "UCX", "NIXL backend of the transfer", "connector"),
    _s("transfer_host", "str", "127.0.0.1", "address the prefill side serves blobs on", "connector"),
    _s("transfer_port", "int", 0, "port of the prefill side's control channel (0 = any)", "connector", lo=0,
       hi=65535, rule=PORT),
    _s("transfer_timeout_s", "float", 10, "control-channel and NIXL deadline", "connector", lo=0, lo_open=True),
    _s("transfer_staging_mb", "int", 256, "prefill side: NIXL-registered staging arena for the compressed hand-off, "
       "in MiB", "connector", lo=1, hi=1 << 20),
    _s("transfer_peers", "str", None, "decode side: the prefill hosts it fetches from, comma-separated, as requests "
       "name them in `kvtc_host` (`*`: any host). Unset: any host when the hand-off has a secret, else loopback "
       "only. A request naming another host is not fetched (recompute), counted as `untrusted_peer`", "connector",
       default_doc="unset (secret: any; none: loopback)"),
    # -- the other ways in's own options (the vLLM tier's secondary_tiers entry, the LMCache serde's config) ---------
    _s("chunk_window", "int", 0, "trailing tokens of every chunk kept raw. These ways in code each chunk alone and "
       "cannot tell a sequence's last chunk, so this is not KvtcConnector's `window` (the raw tail of a saved "
       "sequence only): any value > 0 is paid on every chunk", "option", lo=0, ways=("vllm_tier", "lmcache_serde")),
    _s("device", "str", "auto", "where chunks are encoded and decoded: `cuda`, `cpu`, `auto` (the LMCache serde: the "
       "chunk's own GPU when it hands one, else CUDA when present; the vLLM tier: CUDA when the scheduler process "
       "sees one)", "option", choices=("auto", "cpu", "cuda"), ways=("vllm_tier", "lmcache_serde")),
    _s("page_layout", "str", "auto", "how a layer's block sits in a primary-tier chunk: a registered KV layout with "
       "pages, `nhd`, `hnd` or `cpu` (`auto`: from the engine's KV cache layout)", "option", ways=("vllm_tier",)),
    _s("threads", "int", 2, "encode/decode threads of the vLLM tier", "option", lo=1, hi=64, ways=("vllm_tier",)),
    _s("locality", "str", None, "`local` or `remote`: the tier's locality for vLLM's tier filters and events",
       "option", choices=("local", "remote"), default_doc="unset", ways=("vllm_tier",)),
    _s("max_workers", "int", 1, "serde threads of LMCache's `AsyncSerdeProcessor`", "option", lo=1, hi=64,
       ways=("lmcache_serde",)),
    # -- process-wide, environment only -----------------------------------------------------------------------------
    _s("transfer_secret_file", "path", None, "file holding the hand-off's shared secret (>= 16 bytes; a Kubernetes "
       "Secret): every control message and reply carries an HMAC-SHA256, replays are refused. Unset: "
       "`DYN_KVTC_TRANSFER_SECRET`, else unauthenticated", "connector", default_doc="unset"),
    _s("transfer_secret", "str", None, "the hand-off's shared secret itself (environment only, never in "
       "kv_connector_extra_config; `transfer_secret_file` wins)", "process", read_by=RB_CONN, default_doc="unset"),
    _s("nixl_progress_us", "int", 0, "hand-off: how long each NIXL agent's progress thread may wait between polls, "
       "in microseconds. 0 is NIXL's own default, a thread that never sleeps: one busy CPU core per agent (a prefill "
       "or decode worker has one) for the engine's lifetime. On CPU-limited pods set 100: idle, the thread then "
       "uses ~2% of a core; a transfer step may wait up to that long (not measured on GPUs)", "process",
       read_by=RB_CONN, lo=0, hi=1_000_000),
    _s("link_gbps", "float", 0, "hand-off: the prefill<->decode link rate in Gbit/s for the raw-vs-compressed "
       "choice (0: learned per peer from the transfers themselves)", "process", read_by=RB_CONN, lo=0,
       default_doc="0 (learn)"),
    _s("handoff_restore_gbs", "float", 0, "hand-off: GB/s of raw KV the compressed path restores, for the "
       "raw-vs-compressed choice (0: learned from restores; before that 80 on a GPU, 0.04 on a CPU)", "process",
       read_by=RB_CONN, lo=0, default_doc="0 (learn)"),
    _s("handoff_choice", "str", "compressed", "hand-off: `compressed` (every `do_remote_prefill` request fetches "
       "KVTC blobs) or `policy` (KvtcConnector beside NixlConnector in a MultiConnector: the prefill side adds only "
       "its `kvtc_*` keys, the decode side fetches compressed or declines so NixlConnector READs raw KV, by the "
       "link estimate)", "process", read_by=RB_CONN, choices=("compressed", "policy")),
    _s("handoff_memory", "str", "auto", "hand-off staging memory: `device` (prefill stages blobs in a NIXL-registered "
       "VRAM arena, decode READs into VRAM), `host` (DRAM both sides), `auto` (device where the worker has a GPU)",
       "process", read_by=RB_CONN, choices=("auto", "host", "device")),
    # choices: the codec registry's nvCOMP coders (codec/entropy/registry.py nvcomp_tags(); test_entropy.py checks)
    _s("gpu_entropy", "str", "ans", "entropy codec of blobs written on GPUs: `ans` (fastest), `gdeflate`, `deflate` "
       "(readable on CPU-only nodes too). Unset, a store with a disk tier writes `deflate` so its files are readable "
       "anywhere", "process", read_by=RB_CODEC, choices=("deflate", "gdeflate", "ans")),
    _s("fused", "str", "1", "CUDA codec path: `1` fused (Triton + batched nvCOMP), `0` the float32 reference path, "
       "`force` the fused path on every device (tests)", "process", read_by=RB_CODEC, choices=("0", "1", "force")),
    _s("projection", "str", "auto", "precision of the codec's projection GEMMs: `fp16`, `fp8` (e4m3, row-wise "
       "scales, fp32 accumulation; where FP8 tensor cores are absent it runs in fp16, on the CPU reference path it "
       "emulates the FP8 rounding), `auto` (fp8 on CUDA devices of compute capability >= 8.9, else fp16). Blobs "
       "are the same format either way", "process", read_by=RB_CODEC, choices=("auto", "fp16", "fp8")),
    _s("codec_sms", "int", 0, "SMs the codec's CUDA streams may use (a green context, rounded up to the device's "
       "granularity), so the engine's forward pass keeps the rest; 0: the whole GPU at the lowest stream priority",
       "process", read_by=RB_TIER, lo=0, hi=4096),
    _s("fused_strict", "bool", False, "a failure of the fused path raises instead of falling back (tests)",
       "process", read_by=RB_CODEC),
    _s("calibrations", "path", None, "folder searched for `<model name>/` calibrations", "process", read_by=RB_LOOKUP,
       default_doc="the repository's `calibrations/`"),
    _s("data", "path", None, "folder searched first for the offline text data sets", "process", read_by=RB_TOOL,
       default_doc="`<venv>/share/dynamo_kvtc`, then `<cache>/data`"),
    _s("cache", "path", "~/.cache/dynamo_kvtc", "cache of converted embedded models and made calibrations",
       "process", read_by=RB_LOOKUP),
    _s("bench_smoke", "bool", False, "`dynamo-kvtc bench gpu`: a CPU code check of the benchmark, numbers "
       "meaningless", "process", read_by=RB_TOOL),
)  # fmt: skip
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS if "env" in s.ways}


# ---------------------------------------------------------------------------------------------------------- parsing
def fmt_number(v: float) -> str:
    """A bound as the docs and errors say it (2^k above a million)."""
    return f"{v:g}" if v < 1 << 20 else f"2^{int(math.log2(v))}"

def say_bounds(s: Setting) -> str:
    """A setting's bounds in words (its ``rule`` where set)."""
    if s.rule:
        return s.rule
    lo = None if s.lo is None else (">" if s.lo_open else ">=") + " " + fmt_number(s.lo)
    if s.hi is None:
        return lo or ""
    if s.lo is not None and not s.lo_open:
        return f"in [{fmt_number(s.lo)}, {fmt_number(s.hi)}]"
    return f"{lo} and <= {fmt_number(s.hi)}" if lo else f"<= {fmt_number(s.hi)}"

def say_choices(s: Setting, quote: str = "`") -> str:
    """A setting's choices in words."""
    named = [f"{quote}{c}{quote}" for c in s.choices if c] + (["unset"] if "" in s.choices else [])
    return ", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else named[0]


def origin(way: str, key: str) -> str:
    """How an error names where setting ``key`` was written for a way in (the variable for ``env``)."""
    return BY_KEY[key].env if way == "env" and key in BY_KEY else _ORIGINS.get(way, "{key}").format(key=key)


def origin_of(s: Setting, from_extra: bool) -> str:
    """How an error names where a value came from: the extra-config key, or the environment variable."""
    return origin("extra" if from_extra else "env", s.key)


def _number(s: Setting, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError("expected a number")
    try:
        v = float(raw.strip() if isinstance(raw, str) else raw)
    except OverflowError:
        raise ValueError("not a finite number") from None
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(v):
        raise ValueError("not a finite number")
    return v


def _integer(s: Setting, raw: Any) -> int:
    if isinstance(raw, bool):
        raise ValueError("expected an integer")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float):
        if not math.isfinite(raw) or not raw.is_integer():
            raise ValueError("expected an integer")
        return int(raw)
    if not isinstance(raw, str):
        raise ValueError("expected an integer")
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError("expected an integer") from None


def _boolean(s: Setting, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    t = str(raw).strip().lower() if isinstance(raw, (int, str)) else ""
    if t not in _TRUE + _FALSE:
        raise ValueError("expected true/false (1/0, yes/no)")
    return t in _TRUE


def _text(s: Setting, raw: Any) -> Any:
    if s.type == "path":
        if not isinstance(raw, (str, os.PathLike)) or str(raw).strip() == "":
            raise ValueError("expected a path")
        try:
            return Path(str(raw)).expanduser()
        except RuntimeError:  # "~user" of a user that does not exist, or no home directory at all
            raise ValueError("cannot expand its '~' (no such user, or no home directory)") from None
    if not isinstance(raw, str) or (not s.choices and raw.strip() == ""):
        raise ValueError("expected a string")
    if s.choices:
        t = raw.strip().lower()
        if t not in s.choices:
            raise ValueError(f"{s.key} must be one of {say_choices(s, quote=chr(39))}")
        return t
    return raw.strip()


def _check_bounds(s: Setting, v: float) -> None:
    low = s.lo is not None and (v <= s.lo if s.lo_open else v < s.lo)
    high = s.hi is not None and v > s.hi
    if (low or high) and s.rule:
        raise ValueError(f"{v:g} is not {s.rule}")
    if low:
        raise ValueError(f"must be {'>' if s.lo_open else '>='} {fmt_number(s.lo)}")
    if high:
        raise ValueError(f"must be <= {fmt_number(s.hi)}")


def parse(key: str, raw: Any, from_extra: bool = False, way: str | None = None) -> Any:
    """The typed value of setting ``key`` from a raw value (a string from the environment, or a JSON value from
    kv_connector_extra_config or another way in's entry: ``way``, default ``extra`` with ``from_extra`` else ``env``);
    sizes in GB come back in bytes. Raises ConfigError naming the key, where the value came from and what is wrong."""
    s = BY_KEY[key]
    way = way or ("extra" if from_extra else "env")
    if s.words and isinstance(raw, str) and raw.strip().lower() in s.words:
        return raw.strip().lower()
    try:
        if s.type in ("gb", "float"):
            v: Any = _number(s, raw)
        elif s.type == "int":
            v = _integer(s, raw)
        elif s.type == "bool":
            return _boolean(s, raw)
        else:
            v = _text(s, raw)
            if s.choices and v not in s.choices_of(way):
                narrowed = Setting(s.key, s.type, s.default, s.doc, s.scope, choices=s.choices_of(way), ways=s.ways)
                raise ValueError(f"{s.key} must be one of {say_choices(narrowed, quote=chr(39))} ({WAY_LABELS[way]})")
            return v
        _check_bounds(s, v)
    except ValueError as e:
        where = origin(way, s.key)
        hint = f" (setting {s.key})" if way == "env" else ""
        if s.words and str(e) == "expected a number":
            e = ValueError(f"{e} or {' or '.join(repr(w) for w in s.words)}")
        shown = repr(raw) if len(repr(raw)) <= 64 else repr(raw)[:60] + "..."
        raise ConfigError(f"{where}={shown} is invalid: {e}{hint}") from None
    return int(v * GB) if s.type == "gb" else v


def default(key: str) -> Any:
    """The typed default of a setting (bytes for sizes; None where unset means 'not configured')."""
    s = BY_KEY[key]
    return None if s.default is None else parse(key, s.default)


def check(key: str, value: Any) -> Any:
    """A typed value of setting ``key`` (a config field's: bytes for sizes, a path or str for paths) checked against
    the same rule :func:`parse` applies, for configs built directly in code; returns it normalised (a path becomes a
    ``Path``). None passes where the setting's default is None (unset). Raises ConfigError naming the field."""
    s = BY_KEY[key]
    if value is None and s.default is None:
        return None
    if s.words and isinstance(value, str) and value in s.words:
        return value
    try:
        if s.type in ("gb", "int"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError("expected an integer" + (" number of bytes" if s.type == "gb" else ""))
            _check_bounds(s, value / GB if s.type == "gb" else value)
        elif s.type == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError("expected a finite number")
            _check_bounds(s, value)
        elif s.type == "bool":
            if not isinstance(value, bool):
                raise ValueError("expected true or false")
        elif s.type == "path":
            if not isinstance(value, (str, os.PathLike)) or str(value) == "":
                raise ValueError("expected a path")
            return Path(value)
        elif not isinstance(value, str) or (not s.choices and value.strip() == ""):
            raise ValueError("expected a string")
        elif s.choices and value not in s.choices:
            raise ValueError(f"{s.field} must be one of {say_choices(s, quote=chr(39))}")
    except ValueError as e:
        shown = repr(value) if len(repr(value)) <= 64 else repr(value)[:60] + "..."
        raise ConfigError(f"{s.field}={shown} is invalid: {e}") from None
    return value


# ---------------------------------------------------------------------------------------------------------- reading
_WARNED: set[str] = set()  # unknown variables already warned about (once per process)


def warn_unknown(env: Mapping[str, str] | None = None) -> list[str]:
    """Log one warning per ``DYN_KVTC_*`` variable of ``env`` (``os.environ`` when None) that is not a setting,
    naming the closest known one, once per variable per process; the variables warned about now."""
    env = os.environ if env is None else env
    new = sorted(k for k in env if k.startswith(PREFIX) and k not in BY_ENV and k not in _WARNED)
    for name in new:
        _WARNED.add(name)
        tail = name[len(PREFIX) :]  # compared without the prefix every name shares
        close = difflib.get_close_matches(tail, [v[len(PREFIX) :] for v in BY_ENV], n=1, cutoff=0.6)
        hint = f" (did you mean {PREFIX}{close[0]}?)" if close else ""
        log.warning("%s is not a dynamo_kvtc setting%s; ignored", name, hint)
    return new


def read_options(way: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """A way in's own entry (the vLLM tier's ``secondary_tiers`` entry, the LMCache serde's config) parsed through the
    table: every setting ``way`` reads, by key, the given value (None: unset) or the typed default. An unknown key
    is refused naming the closest known one; a bad value names the option as written (:func:`origin`)."""
    known = sorted(s.key for s in SETTINGS if way in s.ways)
    unknown = sorted(set(options) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown {_ENTRIES[way]}: {unknown}{hint}; known: {known}")
    out = {k: default(k) for k in known}
    out.update({k: parse(k, v, way=way) for k, v in options.items() if v is not None})
    return out


def select(scope_or_keys: str | Iterable[str]) -> list[Setting]:
    """The settings of some scopes and/or keys, in table order."""
    names = {scope_or_keys} if isinstance(scope_or_keys, str) else set(scope_or_keys)
    bad = names - set(SCOPES) - set(BY_KEY)
    if bad:
        raise ConfigError(f"unknown settings or scopes {sorted(bad)}")
    return [s for s in SETTINGS if s.scope in names or s.key in names]


def _raw(
    scope_or_keys: str | Iterable[str], extra: Mapping[str, Any] | None, env: Mapping[str, str] | None
) -> list[tuple[Setting, Any, bool]]:
    chosen = select(scope_or_keys)
    extra = dict(extra or {})
    env = os.environ if env is None else env
    warn_unknown(env)
    known = sorted(s.key for s in chosen if s.extra)
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ConfigError(f"unknown {_ENTRIES['extra']}: {unknown}; known: {known}")
    out = []
    for s in chosen:
        if s.extra and extra.get(s.key) is not None:
            out.append((s, extra[s.key], True))
        elif "env" in s.ways and env.get(s.env, "") != "":
            out.append((s, env[s.env], False))
    return out


def resolve(
    scope_or_keys: str | Iterable[str], extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The parsed values, by dataclass field, of the chosen settings that are set: from kv_connector_extra_config
    (wins; a key that none of the chosen settings accepts is refused) or else the environment (``os.environ`` when
    ``env`` is None; an empty variable counts as unset). Settings left unset are absent: the dataclass default holds."""
    return {s.field: parse(s.key, raw, from_extra) for s, raw, from_extra in _raw(scope_or_keys, extra, env)}


def sources(
    scope_or_keys: str | Iterable[str], extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Where each value :func:`resolve` returns came from, by field (for error messages)."""
    return {s.field: origin_of(s, from_extra) for s, _, from_extra in _raw(scope_or_keys, extra, env)}


def env_value(key: str, env: Mapping[str, str] | None = None) -> Any:
    """A setting read from the environment only (``os.environ`` when ``env`` is None): the parsed value, or the
    typed default when the variable is unset or empty. For process-wide knobs read where they are used."""
    env = os.environ if env is None else env
    raw = env.get(BY_KEY[key].env, "")
    return default(key) if raw == "" else parse(key, raw)


def env_is_set(key: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment sets this process-wide knob (a default and an explicit choice can differ in effect)."""
    env = os.environ if env is None else env
    return env.get(BY_KEY[key].env, "") != ""


@dataclass(frozen=True)
class ToolSettings:
    """The offline tools' settings (calibrate, eval, demo, bench), read once by :func:`tool_settings`. ``calibrations``
    None: the repository's ``calibrations/``; ``data`` None: only the default data folders."""

    cache: Path  # converted embedded models, made calibrations, downloaded data
    calibrations: Path | None = None
    data: Path | None = None
    bench_smoke: bool = False


TOOL_KEYS = ("calibrations", "data", "cache", "bench_smoke")


def tool_settings(env: Mapping[str, str] | None = None) -> ToolSettings:
    """The offline tools' settings from ``DYN_KVTC_*`` variables (``os.environ`` when ``env`` is None)."""
    values = {k: default(k) for k in TOOL_KEYS}
    values.update(resolve(TOOL_KEYS, None, env))
    return ToolSettings(**values)


def blame(error: ConfigError, origins: Mapping[str, str]) -> ConfigError:
    """``error`` (from a config's own validation) with the sources of the fields (or their keys) it names appended."""
    text, key = str(error), {s.field: s.key for s in SETTINGS}
    src = [o for f, o in origins.items() if (f in text or key.get(f, f) in text) and o not in text]
    return ConfigError(f"{error} (from {', '.join(src)})") if src else error
