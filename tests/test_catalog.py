"""The calibration lookup rule (docs/byom.md "Where the connector finds a calibration"), on the shipped SmolLM2
calibration: normalised model names, the search order, and the fingerprint check that refuses another model's."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from dynamo_kvtc.calibration.artifact import Calibration
from dynamo_kvtc.calibration.catalog import REPO_CALIBRATIONS, find_calibration, normalise_model_name
from dynamo_kvtc.errors import CalibrationMismatchError
from dynamo_kvtc.settings import ToolSettings

SHIPPED = REPO_CALIBRATIONS / "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct"),
        ("/models/Llama-3.1-8B-Instruct/", "llama-3.1-8b-instruct"),
        ("smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b-instruct"),
    ],
)
def test_normalised_name_is_the_last_path_component_lowercased(model, name):
    assert normalise_model_name(model) == name


def test_lookup_order_env_folder_then_cache(tmp_path):
    cals, cache = tmp_path / "cals", tmp_path / "cache"
    tools = ToolSettings(cache=cache, calibrations=cals)
    assert find_calibration("HuggingFaceTB/SmolLM2-135M-Instruct", tools) is None  # nothing anywhere
    shutil.copytree(SHIPPED, cache / "calibrations" / "smollm2-135m-instruct")
    assert find_calibration("/models/SmolLM2-135M-Instruct", tools) == cache / "calibrations" / "smollm2-135m-instruct"
    shutil.copytree(SHIPPED, cals / "smollm2-135m-instruct")  # $DYN_KVTC_CALIBRATIONS wins over the cache
    assert find_calibration("HuggingFaceTB/SmolLM2-135M-Instruct", tools) == cals / "smollm2-135m-instruct"
    # unset, the repository's calibrations/ is the first folder
    assert find_calibration("HuggingFaceTB/SmolLM2-135M-Instruct", ToolSettings(cache=cache)) == SHIPPED
    # a folder without calibration.json is not a calibration
    (cals / "other-model").mkdir()
    assert find_calibration("org/Other-Model", ToolSettings(cache=tmp_path / "c2", calibrations=cals)) is None


def test_a_calibration_of_another_model_is_refused_in_one_line_naming_both():
    cal = Calibration.load(SHIPPED)
    served = replace(cal.fingerprint, num_layers=32, rotary=cal.fingerprint.rotary[:1] * 32, model_name="llama-3.1-8b")
    with pytest.raises(CalibrationMismatchError) as e:
        cal.check_model(served)
    msg = str(e.value)
    assert "\n" not in msg and "num_layers" in msg
    assert msg.index("smollm2") < msg.index("does not fit") < msg.index("llama-3.1-8b")
    cal.check_model(cal.fingerprint)  # its own model passes


def _cal_json_only(dst):
    """A calibration folder holding only the shipped calibration.json (what the fingerprint scan reads)."""
    dst.mkdir(parents=True)
    shutil.copy(SHIPPED / "calibration.json", dst / "calibration.json")
    return dst


def test_a_calibration_is_found_by_fingerprint_whatever_its_folder_is_called(tmp_path):
    from dynamo_kvtc.calibration.catalog import default_calibration_dir, fitting, not_found

    cals, cache = tmp_path / "cals", tmp_path / "cache"
    tools = ToolSettings(cache=cache, calibrations=cals)
    served = Calibration.load(SHIPPED).fingerprint
    assert find_calibration("mymodel", tools) is None  # nothing by name
    assert find_calibration("mymodel", tools, served) is None  # nor by fingerprint: no calibration anywhere yet
    mine = _cal_json_only(cals / "my-smol-cal")
    assert find_calibration("mymodel", tools) is None  # the name alone still finds nothing
    assert find_calibration("mymodel", tools, served) == mine  # the fingerprint does
    # a folder named after the model whose calibration is of another RoPE theta is passed over for one that fits
    other = replace(served, rotary=tuple(replace(r, theta=1e6) for r in served.rotary))
    theirs = _cal_json_only(cals / "mymodel")
    (theirs / "calibration.json").write_text(
        (theirs / "calibration.json").read_text().replace('"theta": 100000.0', '"theta": 1000000.0')
    )
    assert find_calibration("mymodel", tools) == theirs  # by name, as before, without a fingerprint
    assert find_calibration("mymodel", tools, served) == mine
    assert find_calibration("mymodel", tools, other) == theirs
    # the tensor-parallel view of the served model (a shard's heads) finds the whole model's calibration
    shard = replace(served, num_kv_heads=1, tp_rank=1, tp_size=3, total_kv_heads=3)
    assert fitting(shard, tools)[0] == mine
    # none fits: one line naming where it looked, the nearest calibrations with what differs, and the command
    (mine / "calibration.json").unlink()
    wider = replace(served, num_layers=4, rotary=served.rotary[:4])
    assert find_calibration("mymodel", tools, wider) is None
    line = not_found("org/MyModel", wider, tools)
    assert "\n" not in line and "mymodel (" in line and "num_layers" in line
    assert f"dynamo-kvtc calibrate --model org/MyModel` (it writes {cals / 'mymodel'})" in line
    assert default_calibration_dir("org/MyModel", ToolSettings(cache=cache)) == cache / "calibrations" / "mymodel"
