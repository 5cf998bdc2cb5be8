"""``dynamo-kvtc calibrate --tp-size N``: the joint calibration plus tp.json (N and every rank's KV heads), and the
start-up check that refuses an engine whose TP size or per-rank heads differ from what it records."""

from __future__ import annotations

import json

import pytest
import torch

from dynamo_kvtc.calibration.tensor_parallel import TP_MANIFEST, check_tp_manifest, write_tp_manifest
from dynamo_kvtc.cli.main import main
from dynamo_kvtc.errors import ConfigError

from .conftest import H


def test_manifest_records_vllms_split_and_refuses_other_tp(synth_cal, tmp_path):
    d = tmp_path / "cal"
    synth_cal.save(d)
    assert check_tp_manifest(d, 2, 1, H // 2).shards[1] == (H // 2, H)  # no manifest: any valid split serves
    write_tp_manifest(d, 2)
    doc = json.loads((d / TP_MANIFEST).read_text())
    assert doc["tp_size"] == 2 and doc["heads"] == [[0, H // 2], [H // 2, H]] and doc["kv_heads"] == H
    assert check_tp_manifest(d, 2, 0, H // 2).shards == ((0, H // 2), (H // 2, H))
    with pytest.raises(ConfigError, match="prepared for tensor_parallel_size 2 .* engine runs 4"):
        check_tp_manifest(d, 4, 0, H // 4)
    with pytest.raises(ConfigError, match=f"holds {H} KV heads"):
        check_tp_manifest(d, 2, 0, H)  # the engine's cache holds other heads than the split gives this rank
    with pytest.raises(ConfigError):
        write_tp_manifest(d, 3)  # heads cannot be split over 3 ranks


def test_calibrate_tp_size_writes_joint_calibration_and_manifest(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=1024)  # fmt: skip
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(cfg.to_json_string())
    out = tmp_path / "cal"
    torch.manual_seed(0)
    rc = main(["calibrate", "--model", str(tmp_path / "m" / "config.json"), "--tokens", "1024", "--seq-len", "256",
               "--dp-tokens", "256", "--ratios", "4", "--tp-size", "2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    cal = json.loads((out / "calibration.json").read_text())
    assert json.loads((out / TP_MANIFEST).read_text())["heads"] == [[0, 1], [1, 2]]
    assert "rank0" not in {p.name for p in out.iterdir()}
    assert check_tp_manifest(out, 2, 1, 1).shards == ((0, 1), (1, 2))
    assert cal  # the joint calibration of both heads
