"""The `dynamo-kvtc` command line: help and inspect import no torch, bad input is one error line (exit 2) before
anything starts, and every command of the table dispatches to its module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_kvtc.cli.main import COMMANDS, build_parser, main

CALIBRATION = Path(__file__).resolve().parents[1] / "calibrations" / "smollm2-135m-instruct"

# Runs the command in a fresh interpreter, then says on stderr whether torch (or vLLM) got imported.
WRAPPER = """
import sys
from dynamo_kvtc.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print("HEAVY:", sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


def cli(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    p = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, timeout=120)
    heavy = next(line for line in p.stderr.splitlines() if line.startswith("HEAVY:"))
    return p, json.loads(heavy.removeprefix("HEAVY:").strip().replace("'", '"'))


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"], ["bench", "chaos", "--help"]])
def test_help_exits_0_without_importing_torch(args):
    p, heavy = cli(*args)
    assert p.returncode == 0, p.stderr
    assert "usage: dynamo-kvtc" in p.stdout
    assert heavy == []


def test_installed_entry_point_help():
    p = subprocess.run([sys.executable, "-m", "dynamo_kvtc.cli.main", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and all(name in p.stdout for name in COMMANDS)


def test_inspect_calibration_reads_its_card_without_torch():
    p, heavy = cli("inspect", str(CALIBRATION))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    meta = json.loads((CALIBRATION / "calibration.json").read_text())
    assert info["id"] == meta["id"] and info["model"] == "smollm2-135m-instruct"
    assert info["ratios"] == [16.0, 32.0, 64.0] and info["plan_16x"]["k"]["rank"] > 0
    assert "stats" not in info["provenance"]
    assert heavy == []


def test_inspect_blob_reads_its_header_without_torch(tmp_path, synth_cal):
    from dynamo_kvtc.calibration.synthetic import synthetic_kv
    from dynamo_kvtc.codec.kvtc import KvtcCodec

    k, v, pos = synthetic_kv(synth_cal, 300)
    blob = tmp_path / "span.kvtc"
    blob.write_bytes(KvtcCodec(synth_cal, ratio=synth_cal.ratios[0]).encode(k, v, pos))
    p, heavy = cli("inspect", str(blob))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["header"]["tokens"] == 300 and info["sections"]
    assert heavy == []


def test_inspect_disk_tier_file_says_which_decoder_it_needs(tmp_path, synth_cal):
    """A file of the disk tier (written by a real store through NIXL) inspects without torch: its record, its blob's
    header, and that its entropy codec (deflate, what a store with a disk tier writes) is readable on a CPU."""
    from dynamo_kvtc.calibration.synthetic import synthetic_kv
    from dynamo_kvtc.tiers import KvtcStore, TierConfig

    from .conftest import offload_seq

    k, v, _ = synthetic_kv(synth_cal, 256)
    cfg = TierConfig(host_bytes=1 << 12, disk_bytes=1 << 24, disk_dir=tmp_path / "g3", min_tokens=0, disk_min_uses=1)
    store = KvtcStore(synth_cal, cfg, block_size=16, span_tokens=256)
    offload_seq(store, list(range(256)), k, v)
    store.close()
    files = sorted((tmp_path / "g3").glob("*.kvtc"))
    assert files, "the blob should be on disk (host tier too small)"
    p, heavy = cli("inspect", str(files[0]))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["disk_record"]["id"] == files[0].stem and info["header"]["tokens"] > 0
    keys = info["disk_record"]["meta"]["hashes"]  # the blob carries its blocks' keys, shown as hex
    # two files of 8 blocks: the coded span and the 128-token raw window (a blob of its own)
    assert len(files) == 2 and info["header"]["keys"] == [f"{h:032x}" for h in keys] and len(keys) == 128 // 16
    assert info["needs"]["entropy_codecs"] == ["deflate"] or "store" in info["needs"]["entropy_codecs"]
    assert info["needs"]["readable_on_cpu"] is True and heavy == []
    damaged = tmp_path / "damaged.kvtc"
    damaged.write_bytes(files[0].read_bytes()[:-10])
    p, _ = cli("inspect", str(damaged))
    assert p.returncode == 2 and "torn write" in p.stderr


def test_inspect_missing_path_is_one_error_line():
    p, heavy = cli("inspect", "/nonexistent")
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if not line.startswith("HEAVY:")]
    assert len(lines) == 1 and lines[0].startswith("dynamo-kvtc: error:") and "/nonexistent" in lines[0], p.stderr
    assert "Traceback" not in p.stderr and heavy == []


def test_demo_bad_ratio_is_refused_before_the_engine_starts():
    p, heavy = cli("demo", "--ratio", "0")
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if not line.startswith("HEAVY:")]
    assert len(lines) == 1 and lines[0].startswith("dynamo-kvtc: error:") and "--ratio" in lines[0], p.stderr
    assert heavy == []  # nothing started: no torch, no vLLM


@pytest.mark.parametrize(
    "args",
    [
        ["calibrate", "--tokens", "-5", "--out", "x"],
        ["calibrate", "--ratios", "16,abc", "--out", "x"],
        ["bench", "transfer", "--shapes", "no-such-model"],
        ["bench", "transfer", "--tokens", "2048,0"],
        ["bench", "gpu", "--configs", "8by8192"],
        ["bench", "codec", "--calibration", "/nonexistent"],
        ["bench", "chaos", "--kinds", "bitflip_disk,nonsense"],
        ["eval", "--ablation", "nodir", "--out", "x"],
    ],
)
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("dynamo-kvtc: error:") and err.count("\n") == 1


def test_every_command_dispatches_to_its_module():
    parser = build_parser()
    for argv in (
        ["demo"],
        ["codec-demo"],
        ["calibrate", "--out", "x"],
        ["eval", "--out", "x"],
        ["inspect", str(CALIBRATION)],
        ["bench", "codec"],
        ["bench", "tiers"],
        ["bench", "gpu"],
        ["bench", "transfer"],
        ["bench", "chaos"],
    ):
        args = parser.parse_args(argv)
        module = args.handler.__module__
        assert module.startswith("dynamo_kvtc.cli.") and args.handler.__name__ == "run", (argv, module)


def test_inspect_in_process_matches_the_loaded_calibration(capsys):
    from dynamo_kvtc.calibration.artifact import Calibration
    from dynamo_kvtc.calibration.verdict import summary as verdict_summary

    assert main(["inspect", str(CALIBRATION)]) == 0
    info = json.loads(capsys.readouterr().out)
    cal = Calibration.load(CALIBRATION)
    expected = {**cal.summary(), "provenance": {k: v for k, v in cal.provenance.items() if k != "stats"}}
    if (CALIBRATION / "check.json").is_file():  # the shipped accuracy verdict (`dynamo-kvtc check --write`)
        expected["check"] = verdict_summary(CALIBRATION, cal.id)
        assert "stale" not in expected["check"]
    assert info == json.loads(json.dumps(expected, default=str))
