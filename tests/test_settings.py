"""The settings table (dynamo_kvtc/settings/): one parser for every DYN_KVTC_* key, its errors, and the generated
configuration reference in docs/configuration.md. Everything here parses real values; nothing is mocked."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from dynamo_kvtc import settings
from dynamo_kvtc.codec.options import FUSED_MODES, GPU_TAGS, PROJECTIONS, CodecOptions
from dynamo_kvtc.connector.config import HANDOFF_KEYS, ConnectorConfig
from dynamo_kvtc.errors import ConfigError
from dynamo_kvtc.settings import reference
from dynamo_kvtc.tiers.config import PROCESS_KEYS as TIER_PROCESS_KEYS
from dynamo_kvtc.tiers.config import TierConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"


# ---------------------------------------------------------------------------------------------- the table
def test_every_variable_the_package_names_is_in_the_table():
    """A DYN_KVTC_* name anywhere in the package (read or mentioned) must be a row of the table."""
    named = set()
    for path in (ROOT / "dynamo_kvtc").rglob("*.py"):
        named |= set(re.findall(r"DYN_KVTC_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    assert named, "the scan found nothing: wrong root?"
    assert sorted(named - set(settings.BY_ENV)) == []


def test_table_is_consistent():
    assert len(settings.BY_KEY) == len(settings.SETTINGS)
    assert set(settings.BY_ENV) == {s.env for s in settings.SETTINGS if "env" in s.ways}
    for s in settings.SETTINGS:
        assert s.env == "DYN_KVTC_" + s.key.upper() and s.doc
        assert s.choices == () or s.type == "str"
        assert s.ways and set(s.ways) <= set(settings.WAYS)
        assert ("env" in s.ways) == (s.scope != "option") and s.extra == (s.scope in ("tier", "connector"))
        if s.default is not None:
            settings.default(s.key)  # every default passes its own checks
        for way, choices in s.way_choices:
            assert way in s.ways and set(choices) < set(s.choices)


def test_each_way_in_reads_its_rows_of_the_table_with_the_table_defaults():
    """The vLLM tier's and the LMCache serde's option classes are front-ends over the table: their fields are exactly
    the rows those ways in read, with the table's (one) defaults; KvtcConnector's are the extra-config rows."""
    from dynamo_kvtc.connector.lmcache.serde import SerdeOptions
    from dynamo_kvtc.connector.offloading.options import KvtcTierOptions

    for way, cls in (("vllm_tier", KvtcTierOptions), ("lmcache_serde", SerdeOptions)):
        rows = [s for s in settings.SETTINGS if way in s.ways]
        defaults = {f.name: f.default for f in fields(cls)}
        assert set(defaults) == {s.field for s in rows}, way
        for s in rows:
            if s.key != "calibration" or way == "vllm_tier":  # the serde's calibration is required (no default)
                assert defaults[s.field] == settings.default(s.key), (way, s.key)
    extra = {s.key for s in settings.SETTINGS if s.extra}
    tier_fields = {f.name for f in fields(TierConfig)}
    conn_fields = {f.name for f in fields(ConnectorConfig)}
    assert {settings.BY_KEY[k].field for k in extra} <= tier_fields | conn_fields
    # one default per setting across the ways in (where the tier and the serde had their own, the table's won)
    opts = KvtcTierOptions.from_config({})
    assert opts.host_bytes == TierConfig().host_bytes == 1 << 30 and opts.ratio == TierConfig().ratio == 16
    assert opts.chunk_window == 0 and TierConfig().window == 128  # two settings: a sequence's tail, every chunk's


def test_read_options_is_the_one_validator_of_the_other_ways_in():
    got = settings.read_options("vllm_tier", {"ratio": "auto", "cpu_cache_gb": "0.5", "locality": "LOCAL"})
    assert got["ratio"] == "auto" and got["cpu_cache_gb"] == 1 << 29 and got["locality"] == "local"
    assert got["chunk_window"] == 0 and got["threads"] == 2  # unset: the table's defaults
    with pytest.raises(ConfigError, match=r"unknown secondary_tiers\[type=kvtc\] keys: \['window'\] \(did you mean "
                       r"'chunk_window'\?\)"):  # fmt: skip
        settings.read_options("vllm_tier", {"window": 64})
    with pytest.raises(ConfigError, match=r"unknown serde\[type=kvtc\] keys: \['threads'\]"):
        settings.read_options("lmcache_serde", {"threads": 2})  # the serde's is max_workers
    with pytest.raises(ConfigError) as e:
        settings.read_options("vllm_tier", {"ratio_policy": "raw_first"})  # the table has it, the tier implements not
    assert str(e.value) == (
        "secondary_tiers[type=kvtc].ratio_policy='raw_first' is invalid: ratio_policy must be one of 'fixed' or 'raw' "
        "(vLLM tier)"
    )
    assert settings.parse("ratio_policy", "raw_first", from_extra=True) == "raw_first"  # KvtcConnector implements it
    with pytest.raises(ConfigError) as e:
        settings.read_options("lmcache_serde", {"ratio": "fast"})
    assert str(e.value) == "serde[type=kvtc].ratio='fast' is invalid: expected a number or 'auto'"


def test_config_dataclasses_cover_their_scopes_and_take_the_table_defaults():
    tier = {f.name: f.default for f in fields(TierConfig)}
    conn = {f.name: f.default for f in fields(ConnectorConfig) if f.name != "tiers"}
    tier_process, conn_process = ("codec_sms",), HANDOFF_KEYS  # the process-wide knobs each config carries down
    for scope, defaults in (("tier", tier), ("connector", conn), (tier_process, tier), (conn_process, conn)):
        for s in settings.select(scope):
            assert s.field in defaults, s.key
            assert defaults[s.field] == settings.default(s.key), s.key
    assert set(conn) == {s.field for s in settings.select(("connector", *conn_process))}
    assert TierConfig().host_bytes == 1 << 30 and ConnectorConfig().transfer_staging_mb == 256
    codec = {f.name: f.default for f in fields(CodecOptions)}  # the codec's options are the table's process keys
    for k, v in codec.items():
        assert settings.BY_KEY[k].scope == "process"
        assert v is None if k == "gpu_entropy" else v == settings.default(k), k  # gpu_entropy None: unset
        if settings.BY_KEY[k].choices:
            assert settings.BY_KEY[k].choices == {"fused": FUSED_MODES, "projection": PROJECTIONS}.get(k, GPU_TAGS)


def test_every_process_knob_has_one_reader():
    """Each process-wide setting is carried by a config (parsed at start-up) or is an offline tool's setting."""
    carried = set(settings.TOOL_KEYS) | set(HANDOFF_KEYS) | set(TIER_PROCESS_KEYS)
    assert {s.key for s in settings.select("process")} <= carried


# ---------------------------------------------------------------------------------------------- the doc
def test_configuration_doc_is_the_generated_table():
    text = DOC.read_text(encoding="utf-8")
    assert reference.documented_table(text) == reference.markdown_table()
    for s in settings.SETTINGS:
        assert (f"`{s.env}`" if "env" in s.ways else f"| `{s.key}` | - |") in reference.markdown_table()
    rows = {ln.split(" | ")[0]: ln for ln in reference.markdown_table().splitlines() if ln.startswith("| `")}
    assert " | KvtcConnector, vLLM tier, LMCache serde | " in rows["| `ratio`"]  # the "read by" column
    assert " | vLLM tier | " in rows["| `page_layout`"] and " | KvtcConnector | " in rows["| `window`"]


def test_check_command_fails_on_a_stale_doc_and_write_repairs_it(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "dynamo_kvtc.settings", *args], capture_output=True, text=True, cwd=ROOT
        )

    assert run("--check", str(DOC)).returncode == 0
    printed = run()
    assert printed.returncode == 0 and printed.stdout.strip() == reference.markdown_table()
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text(encoding="utf-8").replace("| 16384 |", "| 8192 |"), encoding="utf-8")
    bad = run("--check", str(stale))
    assert bad.returncode == 1 and "stale" in bad.stderr
    assert run("--write", str(stale)).returncode == 0
    assert stale.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")
    (tmp_path / "plain.md").write_text("no markers\n", encoding="utf-8")
    assert run("--check", str(tmp_path / "plain.md")).returncode == 1


def test_doc_examples_are_the_real_errors():
    text = DOC.read_text(encoding="utf-8")
    for extra, env in (({"ratio": "fast"}, {}), ({}, {"DYN_KVTC_CPU_CACHE_GB": "inf"})):
        with pytest.raises(ConfigError) as e:
            ConnectorConfig.from_sources(extra, env)
        assert f"`{e.value}`" in text


# ---------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "key, raw, message",
    [
        ("cpu_cache_gb", "inf", "not a finite number"),
        ("cpu_cache_gb", "nan", "not a finite number"),
        ("cpu_cache_gb", float("inf"), "not a finite number"),
        ("cpu_cache_gb", 10**400, "not a finite number"),  # a JSON integer too large for a float
        ("cpu_cache_gb", "1e400", "not a finite number"),
        ("cpu_cache_gb", -1, "must be >= 0"),
        ("cpu_cache_gb", 1 << 21, r"must be <= 2\^20"),
        ("cpu_cache_gb", True, "expected a number"),
        ("cpu_cache_gb", [1], "expected a number"),
        ("ratio", "fast", "expected a number"),
        ("ratio", 0, "must be > 0"),
        ("ratio", float("nan"), "not a finite number"),
        ("nixl_timeout_s", "-inf", "not a finite number"),
        ("nixl_timeout_s", "-1", "must be > 0"),
        ("min_tokens", 1.5, "expected an integer"),
        ("min_tokens", "1.5", "expected an integer"),
        ("min_tokens", False, "expected an integer"),
        ("min_tokens", -1, "must be >= 0"),
        ("page_bytes", 256, "must be >= 512"),
        ("flush_tokens", 0, "must be >= 1"),
        ("metrics_port", 70000, "not a port number"),
        ("transfer_port", -1, "not a port number"),
        ("transfer_staging_mb", 0, "must be >= 1"),
        ("transfer_staging_mb", 1 << 21, r"must be <= 2\^20"),
        ("transfer_staging_mb", "big", "expected an integer"),
        ("publish_events", "maybe", "expected true/false"),
        ("publish_events", 2, "expected true/false"),
        ("disk_fsync", None, "expected true/false"),
        ("gpu_entropy", "zstd", "gpu_entropy must be one of 'deflate', 'gdeflate' or 'ans'"),
        ("fused", "yes", "fused must be one of '0', '1' or 'force'"),
        ("transfer", "sideways", "transfer must be one of 'prefill', 'decode' or unset"),
        ("load_failure_policy", "ignore", "load_failure_policy must be one of 'recompute' or 'fail'"),
        ("calibration", "", "expected a path"),
        ("calibration", 3, "expected a path"),
        ("nixl_backend", "", "expected a string"),
    ],
)
def test_parse_refuses_bad_values_naming_key_and_source(key, raw, message):
    s = settings.BY_KEY[key]
    with pytest.raises(ConfigError, match=message) as e:
        settings.parse(key, raw, from_extra=True)
    assert str(e.value).startswith(f"kv_connector_extra_config.{key}=")
    if isinstance(raw, str):
        with pytest.raises(ConfigError, match=message) as e:
            settings.parse(key, raw)
        assert str(e.value).startswith(f"{s.env}={raw!r} is invalid") and f"(setting {key})" in str(e.value)


@pytest.mark.parametrize(
    "key, raw, value",
    [
        ("cpu_cache_gb", "0.5", 1 << 29),
        ("cpu_cache_gb", 2, 2 << 30),
        ("cpu_cache_gb", " 1 ", 1 << 30),
        ("cpu_cache_gb", 1 << 20, 1 << 50),
        ("ratio", "32", 32.0),
        ("min_tokens", 2.0, 2),  # an integral JSON float
        ("min_tokens", "7", 7),
        ("disk_fsync", "No", False),
        ("disk_fsync", 1, True),
        ("publish_events", False, False),
        ("gpu_entropy", " GDeflate ", "gdeflate"),
        ("fused", "force", "force"),
        ("transfer", "", ""),
        ("transfer", "decode", "decode"),
        ("disk_cache_dir", "~/kv", Path("~/kv").expanduser()),
        ("metrics_port", "0", 0),
        ("transfer_staging_mb", "64", 64),
    ],
)
def test_parse_returns_typed_values(key, raw, value):
    v = settings.parse(key, raw)
    assert v == value and type(v) is type(value)


def test_gb_sizes_are_exact_bytes():
    assert settings.parse("cpu_cache_gb", "1.5") == 3 << 29
    assert isinstance(settings.parse("disk_cache_gb", 0.25), int)


# ---------------------------------------------------------------------------------------------- resolve / env_value
def test_resolve_extra_wins_over_env_and_empty_env_is_unset():
    env = {"DYN_KVTC_RATIO": "32", "DYN_KVTC_WINDOW": "64", "DYN_KVTC_SINKS": ""}
    got = settings.resolve("tier", {"ratio": 8, "window": None}, env)
    assert got == {"ratio": 8.0, "window": 64}  # None in the extra config counts as unset, as does ""


def test_resolve_refuses_unknown_and_env_only_extra_keys_listing_known_ones():
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config keys .*\['cpu_cache_gigs'\]") as e:
        settings.resolve(("tier", "connector"), {"cpu_cache_gigs": 1}, {})
    assert "known: [" in str(e.value) and "'cpu_cache_gb'" in str(e.value)
    with pytest.raises(ConfigError, match="gpu_entropy"):  # process-wide knobs are environment-only
        settings.resolve(("tier", "connector"), {"gpu_entropy": "ans"}, {})
    with pytest.raises(ConfigError, match="flush_tokens"):  # a connector key is not a tier setting
        settings.resolve("tier", {"flush_tokens": 3}, {})
    with pytest.raises(ConfigError, match="unknown settings or scopes"):
        settings.resolve("tiers", None, {})


def test_resolve_by_keys_and_sources():
    env = {"DYN_KVTC_RATIO": "32", "DYN_KVTC_FUSED": "0"}
    assert settings.resolve(["ratio", "fused"], None, env) == {"ratio": 32.0, "fused": "0"}
    assert settings.sources("tier", {"window": 4}, env) == {
        "ratio": "DYN_KVTC_RATIO",
        "window": "kv_connector_extra_config.window",
    }


def test_resolve_reads_os_environ_when_env_is_none(monkeypatch):
    monkeypatch.setenv("DYN_KVTC_PAGE_BYTES", "4096")
    assert settings.resolve("tier")["page_bytes"] == 4096
    assert TierConfig.from_env().page_bytes == 4096


def test_env_value_validates_and_defaults(monkeypatch):
    assert settings.env_value("gpu_entropy", {}) == "ans"
    assert settings.env_value("gpu_entropy", {"DYN_KVTC_GPU_ENTROPY": ""}) == "ans"
    assert settings.env_value("gpu_entropy", {"DYN_KVTC_GPU_ENTROPY": "deflate"}) == "deflate"
    with pytest.raises(ConfigError, match="DYN_KVTC_GPU_ENTROPY='lz4' is invalid"):
        settings.env_value("gpu_entropy", {"DYN_KVTC_GPU_ENTROPY": "lz4"})
    assert settings.env_value("fused", {}) == "1" and settings.env_value("fused_strict", {}) is False
    assert settings.env_value("fused_strict", {"DYN_KVTC_FUSED_STRICT": "1"}) is True
    assert settings.env_value("transfer_staging_mb", {}) == 256
    with pytest.raises(ConfigError, match="DYN_KVTC_TRANSFER_STAGING_MB='1.5'"):
        settings.env_value("transfer_staging_mb", {"DYN_KVTC_TRANSFER_STAGING_MB": "1.5"})
    assert settings.env_value("calibrations", {}) is None and settings.env_value("data", {}) is None
    assert settings.env_value("cache", {}) == Path.home() / ".cache" / "dynamo_kvtc"
    assert settings.env_value("cache", {"DYN_KVTC_CACHE": "/x/y"}) == Path("/x/y")
    assert settings.env_value("metrics_port", {}) is None
    monkeypatch.setenv("DYN_KVTC_NIXL_TIMEOUT_S", "2.5")
    assert settings.env_value("nixl_timeout_s") == 2.5


# ---------------------------------------------------------------------------------------------- the two configs
def test_connector_config_parses_through_the_table(tmp_path):
    env = {"DYN_KVTC_CPU_CACHE_GB": "2", "DYN_KVTC_TRANSFER_STAGING_MB": "64", "DYN_KVTC_PAGE_BYTES": "4096"}
    cfg = ConnectorConfig.from_sources({"window": 16, "nixl_timeout_s": 5, "transfer": "prefill"}, env)
    assert cfg.tiers.host_bytes == 2 << 30 and cfg.tiers.page_bytes == 4096 and cfg.tiers.window == 16
    assert cfg.tiers.nixl_timeout_s == 5.0 and cfg.transfer == "prefill" and cfg.transfer_staging_mb == 64
    assert ConnectorConfig.from_sources({"transfer_staging_mb": 32}, env).transfer_staging_mb == 32


@pytest.mark.parametrize(
    "extra, env, message",
    [
        ({"cpu_cache_gb": "inf"}, {}, r"kv_connector_extra_config\.cpu_cache_gb='inf' is invalid: not a finite"),
        ({"cpu_cache_gb": float("inf")}, {}, "cpu_cache_gb=inf is invalid: not a finite number"),
        ({}, {"DYN_KVTC_CPU_CACHE_GB": "inf"}, "DYN_KVTC_CPU_CACHE_GB='inf' is invalid"),
        ({"ratio": True}, {}, "ratio=True is invalid: expected a number"),
        ({"load_timeout_s": "nan"}, {}, "load_timeout_s='nan' is invalid: not a finite number"),
        ({"transfer_timeout_s": -1}, {}, "transfer_timeout_s=-1 is invalid: must be > 0"),
        ({"transfer_staging_mb": 0.5}, {}, "transfer_staging_mb=0.5 is invalid: expected an integer"),
        ({}, {"DYN_KVTC_TRANSFER": "both"}, "DYN_KVTC_TRANSFER='both' is invalid: transfer must be one of"),
        ({"page_bytes": 1000}, {}, r"power of two .*\(from kv_connector_extra_config\.page_bytes\)"),
        ({}, {"DYN_KVTC_PAGE_BYTES": "1000"}, r"power of two .*\(from DYN_KVTC_PAGE_BYTES\)"),
    ],
)
def test_connector_config_errors(extra, env, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig.from_sources(extra, env)


def test_extra_config_value_wins_even_when_the_variable_is_bad():
    cfg = ConnectorConfig.from_sources({"ratio": 8}, {"DYN_KVTC_RATIO": "fast"})
    assert cfg.tiers.ratio == 8.0


def test_tier_config_from_env_reads_the_tier_rows_and_overrides_win():
    env = {s.env: "" for s in settings.select(("connector", "process"))}  # other scopes' variables are ignored
    env |= {"DYN_KVTC_WINDOW": "32", "DYN_KVTC_SINKS": "2", "DYN_KVTC_RATIO": "8", "DYN_KVTC_FLUSH_TOKENS": "x"}
    cfg = TierConfig.from_env(env, ratio=32.0)
    assert (cfg.window, cfg.sinks, cfg.ratio) == (32, 2, 32.0)
    with pytest.raises(ConfigError, match=r"DYN_KVTC_MIN_TOKENS='-3' is invalid: must be >= 0"):
        TierConfig.from_env({"DYN_KVTC_MIN_TOKENS": "-3"})
    with pytest.raises(ConfigError, match="unknown tier settings"):
        TierConfig.from_env({}, host_gb=1)
    with pytest.raises(ConfigError, match="transfer_staging_mb=0 is invalid: must be >= 1"):
        ConnectorConfig(transfer_staging_mb=0)


def test_a_path_whose_tilde_cannot_be_expanded_is_a_config_error():
    """Found by the hypothesis suite on a clean machine: '~0' (no user '0') made pathlib raise RuntimeError."""
    with pytest.raises(ConfigError, match=r"DYN_KVTC_DISK_CACHE_DIR='~no-such-user-kvtc' is invalid: cannot expand"):
        TierConfig.from_env({"DYN_KVTC_DISK_CACHE_DIR": "~no-such-user-kvtc"})


# ---------------------------------------------------------------------------------------------- read once, at start-up
def test_unknown_variables_get_one_warning_naming_the_closest_setting(caplog):
    env = {"DYN_KVTC_RATO": "8", "DYN_KVTC_ZZZQQQ_UNHEARD": "1", "DYN_KVTC_RATIO": "8", "OTHER_RATO": "1"}
    with caplog.at_level("WARNING", logger="dynamo_kvtc.settings"):
        cfg = TierConfig.from_env(env)
        ConnectorConfig.from_sources(None, env)  # the same variables again: no second warning
    assert cfg.ratio == 8.0
    lines = [r.getMessage() for r in caplog.records]
    assert "DYN_KVTC_RATO is not a dynamo_kvtc setting (did you mean DYN_KVTC_RATIO?); ignored" in lines
    assert "DYN_KVTC_ZZZQQQ_UNHEARD is not a dynamo_kvtc setting; ignored" in lines
    assert len(lines) == 2 and not any("OTHER_" in x for x in lines)
    assert settings.warn_unknown(env) == []  # once per variable per process


def test_process_knobs_are_parsed_into_the_configs_at_start_up():
    env = {"DYN_KVTC_FUSED": "0", "DYN_KVTC_PROJECTION": "FP8", "DYN_KVTC_CODEC_SMS": "16",
           "DYN_KVTC_HANDOFF_CHOICE": "policy", "DYN_KVTC_HANDOFF_MEMORY": "host", "DYN_KVTC_LINK_GBPS": "400",
           "DYN_KVTC_HANDOFF_RESTORE_GBS": "50", "DYN_KVTC_TRANSFER_SECRET": "s3cret-0123456789abcdef"}  # fmt: skip
    cfg = ConnectorConfig.from_sources({"ratio": 8}, env)
    assert cfg.tiers.codec == CodecOptions(fused="0", projection="fp8") and cfg.tiers.codec.gpu_entropy is None
    assert cfg.tiers.codec_sms == 16 and TierConfig.from_env(env).codec == cfg.tiers.codec
    assert (cfg.handoff_choice, cfg.handoff_memory) == ("policy", "host")
    assert (cfg.link_gbps, cfg.handoff_restore_gbs) == (400.0, 50.0)
    assert cfg.transfer_secret == env["DYN_KVTC_TRANSFER_SECRET"] and "s3cret" not in repr(cfg)
    assert TierConfig.from_env({"DYN_KVTC_GPU_ENTROPY": "deflate"}).codec.gpu_entropy == "deflate"
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config keys .*\['transfer_secret'\]"):
        ConnectorConfig.from_sources({"transfer_secret": "never-from-extra-config"}, {})
    with pytest.raises(ConfigError, match="DYN_KVTC_CODEC_SMS='-1' is invalid"):
        TierConfig.from_env({"DYN_KVTC_CODEC_SMS": "-1"})
    with pytest.raises(ConfigError, match="DYN_KVTC_HANDOFF_CHOICE='raw' is invalid"):
        ConnectorConfig.from_sources(None, {"DYN_KVTC_HANDOFF_CHOICE": "raw"})


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"handoff_choice": "raw"}, "handoff_choice='raw' is invalid: handoff_choice must be one of"),
        ({"handoff_memory": "VRAM"}, "handoff_memory must be one of 'auto', 'host' or 'device'"),
        ({"link_gbps": -1.0}, "link_gbps=-1.0 is invalid: must be >= 0"),
        ({"transfer": "both"}, "transfer must be one of 'prefill', 'decode' or unset"),
        ({"metrics_port": 70000}, "not a port number"),
        ({"flush_tokens": 0}, "flush_tokens=0 is invalid: must be >= 1"),
        ({"load_timeout_s": float("inf")}, "load_timeout_s=inf is invalid: expected a finite number"),
        ({"transfer_secret": b"bytes"}, "transfer_secret must be a string"),
        ({"tiers": {}}, "tiers must be a TierConfig"),
    ],
)
def test_connector_config_built_directly_is_checked_by_the_table(kw, message):
    with pytest.raises(ConfigError, match=message):
        ConnectorConfig(**kw)


def test_check_is_parse_for_typed_values():
    assert settings.check("cpu_cache_gb", 3 << 30) == 3 << 30 and settings.check("disk_cache_dir", "/a") == Path("/a")
    assert settings.check("max_ratio", None) is None and settings.check("transfer_secret_file", None) is None
    with pytest.raises(ConfigError, match="cpu_cache_gb|host_bytes"):
        settings.check("cpu_cache_gb", 1.5)
    with pytest.raises(ConfigError, match=r"must be <= 2\^20"):
        settings.check("cpu_cache_gb", (1 << 20) * settings.GB + settings.GB)
    with pytest.raises(ConfigError, match="ratio=None is invalid"):
        settings.check("ratio", None)


def test_tool_settings_are_read_once_into_one_value():
    got = settings.tool_settings({"DYN_KVTC_DATA": "/d", "DYN_KVTC_CACHE": "/c", "DYN_KVTC_BENCH_SMOKE": "1"})
    assert got == settings.ToolSettings(cache=Path("/c"), data=Path("/d"), bench_smoke=True)
    plain = settings.tool_settings({})
    assert plain.calibrations is None and plain.cache == Path.home() / ".cache" / "dynamo_kvtc"


def test_the_offline_tools_take_their_folders_as_arguments(tmp_path):
    from dynamo_kvtc.calibration.catalog import REPO_CALIBRATIONS, find_calibration, shipped_calibrations
    from dynamo_kvtc.calibration.models import cache_dir

    (tmp_path / "cache" / "calibrations" / "m").mkdir(parents=True)
    (tmp_path / "cache" / "calibrations" / "m" / "calibration.json").write_text("{}")
    tools = settings.ToolSettings(cache=tmp_path / "cache", calibrations=tmp_path / "none")
    assert find_calibration("m", tools) == tmp_path / "cache" / "calibrations" / "m"
    assert cache_dir(tools) == tmp_path / "cache" and shipped_calibrations(tools) == tmp_path / "none"
    assert shipped_calibrations(settings.ToolSettings(cache=tmp_path)) == REPO_CALIBRATIONS
    assert find_calibration("m", settings.ToolSettings(cache=tmp_path)) is None
