"""Calibration runs: resumable and deterministic under a seed; subsets for shipping; the CLI on the real model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dynamo_kvtc import Calibration, KvtcCodec, calibrate
from dynamo_kvtc.calibration.calibrate import CalibrationConfig, Calibrator, KvSample
from dynamo_kvtc.errors import CalibrationError


def test_resume_from_checkpoint_gives_the_same_calibration(synth):
    samples = [KvSample(*synth.sample(300, start=i * 300)) for i in range(8)]
    cfg = CalibrationConfig(ratios=(8, 16), dp_tokens=600, progress=False, seed=3)
    whole = Calibrator(synth.fp, cfg)
    for s in samples:
        whole.add(s)
    first = Calibrator(synth.fp, cfg)
    for s in samples[:5]:
        first.add(s)
    state = {k: v.clone() for k, v in first.state_dict().items()}
    resumed = Calibrator(synth.fp, cfg)
    resumed.load_state_dict(state)
    for s in samples[5:]:
        resumed.add(s)
    a, b = whole.finish(), resumed.finish()
    assert (
        a.id == b.id and a.provenance["tokens"] == b.provenance["tokens"] == 8 * 300 - 4
    )  # sinks of the first sample excluded
    assert torch.equal(whole.res_rows["k"][0], resumed.res_rows["k"][0])  # the same seeded DP sample


def test_subset_keeps_plans_and_trims(tmp_path, synth, synth_cal):
    sub = synth_cal.subset([8, 16])
    assert sub.ratios == [8.0, 16.0]
    assert sub.groups[0].k_basis.shape[1] == max(sub.plan(r).rank for r in (8, 16))
    k, v, pos = synth.sample(300)
    a = KvtcCodec(synth_cal, ratio=16).encode(k, v, pos)
    b = KvtcCodec(Calibration.load(sub.save(tmp_path / "s")), ratio=16)
    assert torch.equal(b.decode(b.encode(k, v, pos))[0], KvtcCodec(synth_cal, ratio=16).decode(a)[0])
    with pytest.raises(CalibrationError, match="available"):
        synth_cal.subset([12])


def test_layer_groups_bounds(synth):
    with pytest.raises(Exception, match="layer_groups"):
        calibrate([synth.sample(200)], synth.fp, ratios=(8,), layer_groups=99, progress=False)


@pytest.mark.model
def test_cli_calibrate_resumes_after_interruption(tmp_path, smollm2):
    args = [
        "--tokens",
        "768",
        "--seq-len",
        "256",
        "--ratios",
        "16,32",
        "--rank",
        "256",
        "--dp-tokens",
        "512",
        "--checkpoint-every",
        "256",
    ]
    cli = [sys.executable, "-m", "dynamo_kvtc.cli.main", "calibrate"]
    stop = subprocess.run(
        cli + args + ["--stop-after-tokens", "300", "--out", str(tmp_path / "a")], capture_output=True, text=True
    )
    assert stop.returncode == 3, stop.stderr[-2000:]
    assert (tmp_path / "a.partial" / "state.json").is_file() and not (tmp_path / "a").exists()
    with pytest.raises(CalibrationError, match="not exist"):
        Calibration.load(tmp_path / "a")  # an interrupted run is never mistaken for a finished one
    resumed = subprocess.run(cli + args + ["--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert resumed.returncode == 0 and "resuming" in resumed.stdout, resumed.stderr[-2000:]
    assert not (tmp_path / "a.partial").exists()
    # without --out: written where the connector looks ($DYN_KVTC_CALIBRATIONS/<normalised model name>)
    env = {**os.environ, "DYN_KVTC_CALIBRATIONS": str(tmp_path / "cals")}
    straight = subprocess.run(cli + args, capture_output=True, text=True, env=env)
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert f"writing the calibration to {tmp_path / 'cals' / 'smollm2-135m-instruct'}" in straight.stdout
    a, b = Calibration.load(tmp_path / "a"), Calibration.load(tmp_path / "cals" / "smollm2-135m-instruct")
    assert a.id == b.id and a.ratios == [16.0, 32.0]
    assert a.provenance["data"].startswith("Paul Graham essays")
    bad = subprocess.run(
        cli + ["--model", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "c")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown model" in bad.stderr


def test_regroup_equals_a_separate_run_on_the_same_samples(synth):
    """One capture, several layer-group counts: the derived calibration is the one a separate run would make."""
    samples = [KvSample(*synth.sample(300, start=i * 300)) for i in range(6)]
    cfg = CalibrationConfig(ratios=(8, 16), dp_tokens=600, progress=False, seed=1, pca_method="exact")
    joint = Calibrator(synth.fp, cfg)
    for s in samples:
        joint.add(s)
    for g in (2, synth.fp.num_layers):
        direct = Calibrator(synth.fp, CalibrationConfig(**{**vars(cfg), "layer_groups": g}))
        for s in samples:
            direct.add(s)
        a, b = joint.regroup(g).finish(), direct.finish()
        assert a.layer_groups == b.layer_groups == g
        for ga, gb in zip(a.groups, b.groups):
            assert ga.layers == gb.layers
            torch.testing.assert_close(ga.k_mean, gb.k_mean, rtol=1e-5, atol=1e-5)
            # PCA bases are defined up to the sign of each component
            cos = (ga.v_basis.float().T @ gb.v_basis.float()).diagonal().abs()
            assert torch.allclose(cos, torch.ones(1), atol=1e-2)
            assert {r: p.groups for r, p in ga.k_plans.items()} == {r: p.groups for r, p in gb.k_plans.items()}
        assert a.provenance["tokens"] == b.provenance["tokens"] and a.provenance["dp_tokens"] == 600
    whole = joint.finish()  # the joint calibrator itself is untouched by regrouping
    assert whole.layer_groups == 1 and whole.provenance["tokens"] == 6 * 300 - 4
    with pytest.raises(Exception, match="spans several"):
        joint.regroup(2).regroup(3)  # a group of 3 would straddle the two groups of 2


# ------------------------------------------------------------------ long-context calibration: length mixes
def test_length_mix_schedule_keeps_each_lengths_token_share():
    from dynamo_kvtc.calibration.data import LengthMix

    mix = LengthMix.parse("1024:1,2048:1,4096:2,8192:4")
    assert mix.lengths == (1024, 2048, 4096, 8192) and mix.weights == (0.125, 0.125, 0.25, 0.5)
    assert LengthMix.parse(mix.spec()) == mix and LengthMix.parse("512,256").weights == (0.5, 0.5)
    sched = mix.schedule()
    first = [next(sched) for _ in range(200)]
    assert first[0] == 8192  # the longest window first: a small budget still sees long contexts
    tokens = {n: sum(x for x in first if x == n) for n in mix.lengths}
    total = sum(tokens.values())
    for n, w in zip(mix.lengths, mix.weights):
        assert abs(tokens[n] / total - w) < 0.01
    for bad in ("32", "1024:0", "1024,1024", "x:1", ""):
        with pytest.raises(Exception, match="length|weight|repeat"):
            LengthMix.parse(bad)


def test_mixed_windows_cut_the_concatenated_documents_in_order():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from dynamo_kvtc.calibration.data import LengthMix, calibration_texts, mixed_windows
    from dynamo_kvtc.calibration.models import resolve_model

    try:
        tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    except Exception as e:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
    texts = calibration_texts()[:12]
    mix = LengthMix.parse("256:1,1024:3")
    wins = list(mixed_windows(tok, texts, mix))
    sched = mix.schedule()
    assert [len(w) for w in wins[:-1]] == [next(sched) for _ in wins[:-1]] and 64 <= len(wins[-1])
    sep = tok("\n\n", return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    stream = torch.cat([torch.cat((tok(t, return_tensors="pt", add_special_tokens=False)["input_ids"][0], sep))
                        for t in texts])  # fmt: skip
    assert torch.equal(torch.cat(wins), stream[: sum(len(w) for w in wins)])  # consecutive slices, nothing skipped
    edge = len(tok(texts[0], add_special_tokens=False)["input_ids"]) + len(sep)  # where the second document starts
    starts = torch.tensor([0] + [len(w) for w in wins]).cumsum(0)
    assert any(a < edge < b for a, b in zip(starts[:-1], starts[1:]))  # a window spans the documents' boundary
    assert [len(w) for w in mixed_windows(tok, texts, mix)] == [len(w) for w in wins]  # deterministic (resume)


@pytest.mark.parametrize("spec", ["1024:-1", "32,1024", "1024,1024", "a:b", ","])
def test_bad_length_mix_exits_2(spec, capsys):
    from dynamo_kvtc.cli.main import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["calibrate", "--length-mix", spec, "--out", "x"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("dynamo-kvtc: error:")


@pytest.mark.model
def test_cli_length_mix_is_recorded_and_part_of_the_resume_key(tmp_path, smollm2):
    cli = [sys.executable, "-m", "dynamo_kvtc.cli.main", "calibrate", "--tokens", "700", "--ratios", "16",
           "--rank", "64", "--dp-tokens", "256", "--checkpoint-every", "200", "--out", str(tmp_path / "a")]  # fmt: skip
    stop = subprocess.run(
        cli + ["--length-mix", "128:1,256:1", "--stop-after-tokens", "200"], capture_output=True, text=True
    )
    assert stop.returncode == 3, stop.stderr[-2000:]
    other = subprocess.run(cli + ["--length-mix", "128:1,512:1"], capture_output=True, text=True)
    assert other.returncode != 0 and "different arguments" in other.stderr  # another mix never resumes this one
    # the shared-budget DP's options act only at the end: a run may resume under other values of them
    done = subprocess.run(
        cli + ["--length-mix", "128:1,256:1", "--budget-tokens", "4096", "--budget-error", "absolute"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and "resuming" in done.stdout, done.stderr[-2000:]
    prov = Calibration.load(tmp_path / "a").provenance
    assert prov["length_mix"] == {"lengths": [128, 256], "token_shares": [0.5, 0.5]} and prov["seq_len"] == 256
    assert "concatenated" in prov["windowing"] and prov["tokens"] == 700
    # 256, 128, 128, then a 256 slot cut to the budget (4 sinks + 200 tokens); the resumed run counts the skipped one
    assert prov["window_lengths"] == {"128": 2, "204": 1, "256": 1}
