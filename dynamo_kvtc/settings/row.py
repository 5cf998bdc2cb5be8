"""One row of the settings table (:class:`Setting`) and the words its fields take: types, scopes, ways in. The rows
themselves and everything that reads values are :mod:`dynamo_kvtc.settings`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

SCOPES = ("tier", "connector", "process", "option")
WAYS = ("extra", "vllm_tier", "lmcache_serde", "env")  # who reads a setting (see the package docstring)
TYPES = ("gb", "float", "int", "bool", "path", "str")


@dataclass(frozen=True)
class Setting:
    """One ``DYN_KVTC_*`` setting: how to read it, check it and document it. Holds no value; never reads anything."""

    key: str  # the kv_connector_extra_config key (tier/connector scope) and the name for env_value()
    type: str  # gb (a size in GB, the field holds bytes) | float | int | bool | path | str
    default: Any  # in the user's unit (GB for sizes); None: unset
    doc: str
    scope: str  # tier | connector | process
    field: str = ""  # the config dataclass field (default: the key)
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # value must be > lo rather than >= lo
    choices: tuple[str, ...] = ()  # allowed values of a str setting ("" = unset)
    rule: str = ""  # how to say the bounds, where the derived wording would be unclear ("a port number")
    default_doc: str = ""  # how to show the default where the value alone says too little
    env: str = ""  # the environment variable (default: DYN_KVTC_<KEY>)
    read_by: str = ""  # process scope: what parses it at start-up and carries it (the reference table says so)
    words: tuple[str, ...] = ()  # words a number setting takes besides numbers (``ratio: auto``), kept as the word
    ways: tuple[str, ...] = ()  # the ways in that read it (WAYS); default: extra + env, or env for process knobs
    way_choices: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (way, choices) where a way in implements fewer

    def __post_init__(self) -> None:
        if self.type not in TYPES or self.scope not in SCOPES:
            raise ConfigError(f"setting {self.key}: bad type {self.type!r} or scope {self.scope!r}")
        if (self.scope == "process") != bool(self.read_by):
            raise ConfigError(f"setting {self.key}: a process-wide setting, and only one, names what reads it")
        object.__setattr__(self, "field", self.field or self.key)
        object.__setattr__(self, "env", self.env or "DYN_KVTC_" + self.key.upper())
        base = {"process": ("env",), "option": ()}.get(self.scope, ("extra", "env"))
        ways = tuple(w for w in WAYS if w in base or w in self.ways)
        if set(self.ways) - set(WAYS) or (self.scope == "option") != ("env" not in ways) or not ways:
            raise ConfigError(f"setting {self.key}: bad ways {self.ways!r} for scope {self.scope!r}")
        if any(w not in ways or set(c) - set(self.choices) for w, c in self.way_choices):
            raise ConfigError(f"setting {self.key}: way_choices must narrow the choices of ways that read it")
        object.__setattr__(self, "ways", ways)

    @property
    def extra(self) -> bool:
        """Whether kv_connector_extra_config may set it (process-wide knobs are environment-only)."""
        return "extra" in self.ways

    def choices_of(self, way: str) -> tuple[str, ...]:
        """The values a way in accepts (the row's choices unless ``way_choices`` narrows them)."""
        return dict(self.way_choices).get(way, self.choices)
