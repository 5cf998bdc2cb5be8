"""A calibration's accuracy verdict: ``check.json`` beside ``calibration.json``, written by ``dynamo-kvtc check
--write`` and read by the connector's ``ratio: auto`` (no torch).

The verdict is the largest ratio of the calibration that stayed within an accuracy budget on a held-out pass with the
served model, the budget, and each checked ratio's metrics. It lives in its own file because the calibration id is a
hash of ``calibration.json``'s content: a verdict written into it would change the id. The verdict names the id it
was measured with; a verdict of another calibration (a directory whose tensors were replaced) is refused.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import CalibrationError

CHECK_FILE = "check.json"
CHECK_FORMAT = "dynamo-kvtc-check"
CHECK_VERSION = 1


def check_command(path: str | os.PathLike, model: str | None = None) -> str:
    """The command that records a verdict for the calibration at ``path``."""
    return f"dynamo-kvtc check {path} --model {model or 'MODEL'} --write"


def read_verdict(path: str | os.PathLike, calibration_id: str | None = None) -> dict[str, Any] | None:
    """The verdict recorded in calibration directory ``path`` (None when there is none). Raises CalibrationError
    naming the problem when the file is unreadable, malformed, or was measured with another calibration id than
    ``calibration_id`` (when given)."""
    f = Path(path) / CHECK_FILE
    if not f.is_file():
        return None
    try:
        v = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"{f}: unreadable check verdict: {e}") from e
    if not isinstance(v, dict) or v.get("format") != CHECK_FORMAT or v.get("version") != CHECK_VERSION:
        raise CalibrationError(f"{f} is not a {CHECK_FORMAT} version {CHECK_VERSION} file")
    safe = v.get("safe_ratio")
    if (
        "calibration_id" not in v
        or not isinstance(v.get("rows"), list)
        or not (safe is None or (isinstance(safe, (int, float)) and not isinstance(safe, bool) and safe > 1))
    ):
        raise CalibrationError(f"{f}: malformed check verdict (needs calibration_id, rows and safe_ratio)")
    if calibration_id is not None and v["calibration_id"] != calibration_id:
        raise CalibrationError(
            f"{f} was measured with calibration {v['calibration_id'][:12]}, this directory holds "
            f"{calibration_id[:12]}: run `{check_command(path, v.get('model'))}` again"
        )
    return v


def write_verdict(path: str | os.PathLike, verdict: dict[str, Any]) -> Path:
    """Write ``verdict`` (a :func:`dynamo_kvtc.evaluation.check.run_check` result's ``verdict``) atomically as the
    calibration directory's check.json; ``calibration.json`` and the id are untouched."""
    path = Path(path)
    if not (path / "calibration.json").is_file():
        raise CalibrationError(f"{path} is not a calibration directory (no calibration.json)")
    out = {"format": CHECK_FORMAT, "version": CHECK_VERSION, **verdict}
    fd, tmp = tempfile.mkstemp(prefix=f".{CHECK_FILE}.", dir=path)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / CHECK_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path / CHECK_FILE


def safe_ratio(
    path: str | os.PathLike, calibration_id: str, ratios: list[float] | None = None, model: str | None = None
) -> float:
    """The ratio ``ratio: auto`` serves at: the verdict's safe ratio. Raises CalibrationError with one line naming
    the command to run when the calibration has no verdict, and naming the fix when no ratio passed its budget or the
    safe ratio has no plan in ``ratios``."""
    v = read_verdict(path, calibration_id)
    if v is None:  # one line, naming the command that makes the verdict (``model``: the served model's name)
        raise CalibrationError(
            f"ratio auto needs an accuracy verdict and calibration {path} has none: run "
            f"`{check_command(path, model)}` (or set a ratio)"
        )
    r = v["safe_ratio"]
    blind = (v.get("vanilla") or {}).get("uninformative") or {}
    if r is None and {"dnll", "passkey"} <= set(blind):
        raise CalibrationError(
            f"ratio auto: the check of calibration {path} could not judge any ratio, as the model itself fails its "
            f"tasks ({'; '.join(blind.values())}): check on text or a task the model can do (a larger or in-domain "
            "calibration and check text), or set a ratio explicitly"
        )
    if r is None:
        raise CalibrationError(
            f"ratio auto: no ratio of calibration {path} stayed within its check budget {v.get('budget')}; set a "
            "ratio explicitly, or ratio_policy raw"
        )
    if ratios is not None and float(r) not in [float(x) for x in ratios]:
        raise CalibrationError(f"ratio auto: the verdict's ratio {r:g} has no plan in calibration {path} ({ratios})")
    return float(r)


def summary(path: str | os.PathLike, calibration_id: str) -> dict[str, Any] | None:
    """What ``dynamo-kvtc inspect`` shows of the verdict: safe ratio, budget, samples and one row per ratio; a
    verdict measured with another calibration id is shown as ``stale`` (``ratio: auto`` refuses it)."""
    v = read_verdict(path)
    if v is None:
        return None
    out = {k: v.get(k) for k in ("safe_ratio", "budget", "model", "samples", "rows")}
    if v["calibration_id"] != calibration_id:
        out["stale"] = f"measured with calibration {v['calibration_id'][:12]}; run `{check_command(path)}` again"
    return out
