"""How much host memory this machine or pod has, and the start-up warning when the host tier asks for more: the
pod's cgroup limit first (v2, then v1), else the machine's ``MemTotal``."""

from __future__ import annotations

from pathlib import Path

_UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def host_memory_limit(root: Path = Path("/")) -> tuple[int, str] | None:
    """(bytes, where it came from): the pod's cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``),
    else the machine's ``MemTotal``; None when none can be read."""
    for rel in ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = (root / rel).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _UNLIMITED:
            return int(text), "/" + rel
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024, "/proc/meminfo MemTotal"
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_warning(asked: int, limit: tuple[int, str] | None) -> str | None:
    """The start-up warning when the host memory asked for on this machine (``cpu_cache_gb``, the total of its TP
    ranks) exceeds what the pod/machine has; None when it fits or nothing is known."""
    if limit is None or asked <= limit[0]:
        return None
    return (
        f"kvtc host tier asks for {asked / (1 << 30):.2f} GiB on this machine (cpu_cache_gb, the total across the TP "
        f"group) but {limit[1]} allows {limit[0] / (1 << 30):.2f} GiB (engine and model memory not counted): "
        "the pod may be OOM-killed; lower cpu_cache_gb or raise the memory limit"
    )
