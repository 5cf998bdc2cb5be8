"""The --quick accuracy evaluation on the shipped SmolLM2 calibration (what the README's numbers come from)."""

from __future__ import annotations

import json

import pytest

from dynamo_kvtc.calibration.catalog import find_calibration
from dynamo_kvtc.cli.main import main

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def quick_eval(tmp_path_factory, smollm2):
    cal = find_calibration("smollm2-135m-instruct")
    assert cal is not None, "the shipped calibration calibrations/smollm2-135m-instruct is missing"
    out = tmp_path_factory.mktemp("eval")
    assert main(["eval", "--preset", "quick", "--calibration", str(cal), "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    return out, {r["method"]: r for r in data["summary"]}, data


def test_outputs_written(quick_eval):
    out, rows, data = quick_eval
    assert (out / "results.md").read_text().startswith("| method")
    assert (out / "ratio_accuracy.png").stat().st_size > 10_000
    assert {"vanilla", "kvtc-16x", "kivi-2bit", "fp8-e4m3", "int8-per-token", "deflate-raw-bf16"} <= set(rows)
    assert all(r["passkey_n"] == 4 for r in rows.values())


def test_kvtc16_keeps_passkey_at_vanilla_level(quick_eval):
    _, rows, _ = quick_eval
    assert rows["kvtc-16x"]["passkey"] >= rows["vanilla"]["passkey"]


def test_kvtc16_beats_kivi2_retrieval_at_a_higher_ratio(quick_eval):
    _, rows, _ = quick_eval
    kvtc, kivi = rows["kvtc-16x"], rows["kivi-2bit"]
    assert kvtc["ratio"] > 2.5 * kivi["ratio"]
    assert kvtc["copy"] > kivi["copy"]
    assert kvtc["ppl"] < kivi["ppl"]  # next-token KL against the uncompressed cache


def test_ratio_accounting_is_measured(quick_eval):
    _, rows, _ = quick_eval
    assert 16 <= rows["kvtc-16x"]["ratio"] <= 24  # plan 16x before DEFLATE, DEFLATE adds a little
    assert rows["fp8-e4m3"]["ratio"] == pytest.approx(2.0)
    assert 1.0 < rows["deflate-raw-bf16"]["ratio"] < 1.6  # lossless alone buys little
    assert rows["vanilla"]["ppl"] == pytest.approx(0.0, abs=1e-9)
