"""The --quick accuracy evaluation on the shipped SmolLM2 calibration (what the README's numbers come from); the
method table of a run (ablations at several ratios, FP8 projection rows) on synthetic KV."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dynamo_kvtc import calibrate
from dynamo_kvtc.calibration.catalog import find_calibration
from dynamo_kvtc.cli.main import build_parser, main
from dynamo_kvtc.errors import ConfigError
from dynamo_kvtc.evaluation.methods import Kvtc
from dynamo_kvtc.evaluation.sweep import ablation_ratios_of, methods_for


@pytest.fixture(scope="module")
def quick_eval(tmp_path_factory, smollm2):
    cal = find_calibration("smollm2-135m-instruct")
    assert cal is not None, "the shipped calibration calibrations/smollm2-135m-instruct is missing"
    out = tmp_path_factory.mktemp("eval")
    # the 16x plan and the quick preset's passkey, copy and perplexity samples only (the rows and columns these tests
    # read): the 32x/64x rows would double the kvtc share of the run, its kv and vt samples add a fifth of the tokens
    args = ["--preset", "quick", "--tasks", "ppl", "passkey", "copy", "--calibration", str(cal), "--ratios", "16"]
    assert main(["eval", *args, "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    return out, {r["method"]: r for r in data["summary"]}, data


@pytest.mark.model
def test_outputs_written(quick_eval):
    out, rows, data = quick_eval
    assert (out / "results.md").read_text().startswith("| method")
    assert (out / "ratio_accuracy.png").stat().st_size > 10_000
    assert {"vanilla", "kvtc-16x", "kivi-2bit", "fp8-e4m3", "int8-per-token", "deflate-raw-bf16"} <= set(rows)
    assert all(r["passkey_n"] == 4 for r in rows.values())


@pytest.mark.model
def test_kvtc16_keeps_passkey_at_vanilla_level(quick_eval):
    _, rows, _ = quick_eval
    assert rows["kvtc-16x"]["passkey"] >= rows["vanilla"]["passkey"]


@pytest.mark.model
def test_kvtc16_beats_kivi2_retrieval_at_a_higher_ratio(quick_eval):
    _, rows, _ = quick_eval
    kvtc, kivi = rows["kvtc-16x"], rows["kivi-2bit"]
    assert kvtc["ratio"] > 2.5 * kivi["ratio"]
    assert kvtc["copy"] > kivi["copy"]
    assert kvtc["ppl"] < kivi["ppl"]  # next-token KL against the uncompressed cache


@pytest.mark.model
def test_ratio_accounting_is_measured(quick_eval):
    _, rows, _ = quick_eval
    assert 16 <= rows["kvtc-16x"]["ratio"] <= 24  # plan 16x before DEFLATE, DEFLATE adds a little
    assert rows["fp8-e4m3"]["ratio"] == pytest.approx(2.0)
    assert 1.0 < rows["deflate-raw-bf16"]["ratio"] < 1.6  # lossless alone buys little
    assert rows["vanilla"]["ppl"] == pytest.approx(0.0, abs=1e-9)


def test_fp8_projection_rows_decode_the_same_blobs_with_fp8_rounding(synth, synth_cal):
    k, v, pos = synth.sample(400)
    ref, fp8 = Kvtc(synth_cal, 16), Kvtc(synth_cal, 16, projection="fp8")
    assert (ref.name, fp8.name) == ("kvtc-16x", "kvtc-16x-fp8")
    a, b = ref.reconstruct(k, v, pos), fp8.reconstruct(k, v, pos)
    coded = slice(4, 400 - 128)  # sinks and the raw window are the same bytes either way
    assert not torch.equal(a.keys[:, coded], b.keys[:, coded])  # the projections really ran in emulated e4m3
    assert torch.equal(a.keys[:, -128:], b.keys[:, -128:])

    def rel(x):
        return float((x[:, coded].float() - k[:, coded].float()).norm() / k[:, coded].float().norm())

    assert rel(b.keys) < 1.5 * rel(a.keys) + 0.02  # FP8 operands cost little next to the 16x quantization itself
    assert b.ratio == pytest.approx(a.ratio, rel=0.1)


def test_ablations_at_several_ratios_and_projections(synth, synth_cal):
    grouped = calibrate(
        [synth.sample(512, start=i * 37) for i in range(4)],
        synth.fp,
        ratios=(8, 16),
        layer_groups=2,
        dp_tokens=1024,
        progress=False,
    )
    ms = methods_for(
        synth_cal,
        [8, 16],
        False,
        {"G2": grouped},
        projections=("fp16", "fp8"),
        ablation_ratios=[8, 16],
        baselines=False,
    )
    assert [m.name for m in ms] == [
        "vanilla", "kvtc-8x", "kvtc-16x", "kvtc-8x-fp8", "kvtc-16x-fp8",
        "kvtc-8x-G2", "kvtc-8x-G2-fp8", "kvtc-16x-G2", "kvtc-16x-G2-fp8",
    ]  # fmt: skip
    assert ms[-1].codec.cal.layer_groups == 2 and ms[-1].codec.config.projection == "fp8"
    default = methods_for(synth_cal, [16], False, {"G2": grouped})
    assert [m.name for m in default][-1] == "kvtc-16x-G2" and "fp8-e4m3" in [m.name for m in default]
    assert ablation_ratios_of(grouped) == [16.0]
    with pytest.raises(ConfigError, match="no plan for 32x"):
        ablation_ratios_of(grouped, [16, 32])


@pytest.mark.parametrize("args", [["--projections", "fp4"], ["--projections", ""], ["--ablation-ratios", "0"]])
def test_bad_eval_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["eval", *args, "--out", "x"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("dynamo-kvtc: error:")


def test_generation_fidelity_agreement_and_summary():
    from dynamo_kvtc.evaluation.harness import agreement, summarise
    from dynamo_kvtc.evaluation.report import markdown

    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and agreement([1, 2], [1, 2, 3]) == 2 and agreement([], [5]) == 0
    recs = []
    for sample, (van, meth) in enumerate((([1, 2, 3], [1, 2, 3]), ([4, 5, 6], [4, 7, 6]))):
        for name, out in (("vanilla", van), ("kvtc-16x", meth)):
            recs.append(
                {"sample": sample, "task": "gen", "method": name, "family": name, "ratio": 16.0 if "kvtc" in name
                 else 1.0, "ratio_with_window": 1.0, "agree_len": float(agreement(out, van)),
                 "exact": float(out == van), "accuracy": float(out == van)}
            )  # fmt: skip
    rows = {r["method"]: r for r in summarise(recs)}
    assert rows["vanilla"]["gen"] == 3 and rows["vanilla"]["gen_exact"] == 1.0
    assert rows["kvtc-16x"]["gen"] == 2.0 and rows["kvtc-16x"]["gen_exact"] == 0.5  # (3 + 1) / 2, one of two exact
    table = markdown(list(rows.values()), {"model": "m", "preset": "fidelity", "seconds": 1, "machine": {"cpus": 2}})
    assert "greedy agree (tokens)" in table and "gen 2" in table


@pytest.mark.model
def test_generation_fidelity_on_the_real_model(smollm2):
    from dynamo_kvtc.evaluation import harness, tasks
    from dynamo_kvtc.evaluation.methods import Vanilla

    model, tok = smollm2
    from dynamo_kvtc import Calibration

    cal = Calibration.load(find_calibration("smollm2-135m-instruct"))
    sample = tasks.Builder(tok, 0).gen(320, 0, new=12)
    out = harness.run(model, tok, [Vanilla(), Kvtc(cal, 16)], [sample], progress=False)
    van, kv = out["records"]
    assert van["exact"] == 1.0 and van["agree_len"] == len(van["output_ids"]) > 0  # vanilla agrees with itself
    assert 0 <= kv["agree_len"] <= len(van["output_ids"])
    assert kv["exact"] == float(kv["output_ids"] == van["output_ids"])


# ------------------------------------------------------------------ RULER multi-key / multi-value, presets (no model)
@pytest.fixture(scope="module")
def smol_tok():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from dynamo_kvtc.calibration.models import resolve_model

    try:
        return AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    except Exception as e:  # the embedded model's package is an optional install
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")


@pytest.fixture(scope="module")
def builder(smol_tok):
    from dynamo_kvtc.evaluation.tasks import Builder

    return Builder(smol_tok, 0)


def test_multikey_needles_hide_one_asked_value_among_distractors(builder, smol_tok):
    from dynamo_kvtc.evaluation.tasks import answer_score

    for index in range(3):
        s = builder.mkey(4096, index, keys=4)
        assert s.task == "mkey" and abs(len(s.prompt) - 4096) <= 64
        text = smol_tok.decode(s.prompt)
        found = re.findall(r"One of the special magic numbers for (\w+) is: (\d{6})\.", text)
        assert len(found) == 4 and len({k for k, _ in found}) == 4  # four needles, four distinct keys
        asked = re.search(r"What is the special magic number for (\w+) mentioned", text).group(1)
        value = dict(found)[asked]
        assert s.answers == [value] and text.rstrip().endswith(f"for {asked} mentioned in the provided text is")
        starts = [text.index(f"numbers for {k} is") for k, _ in found]
        assert starts == sorted(starts) and starts[-1] - starts[0] > len(text) // 3  # spread through the haystack
        distractor = next(v for k, v in found if k != asked)
        assert answer_score("mkey", s.answers, f" {value}.") == 1.0
        assert answer_score("mkey", s.answers, f" {distractor}.") == 0.0  # a distractor's value scores nothing
    assert builder.mkey(4096, 0).answers != builder.mkey(4096, 1).answers


def test_multivalue_needles_need_every_value(builder, smol_tok):
    from dynamo_kvtc.evaluation.tasks import answer_score

    s = builder.mvalue(7500, 1, values=3)
    assert s.task == "mvalue" and abs(len(s.prompt) - 7500) <= 64 and len(set(s.answers)) == 3
    text = smol_tok.decode(s.prompt)
    found = re.findall(r"One of the special magic numbers for (\w+) is: (\d{6})\.", text)
    assert [v for _, v in found] == s.answers and len({k for k, _ in found}) == 1
    assert s.max_new >= 3 * 7  # room for three six-digit values and separators
    assert answer_score("mvalue", s.answers, ", ".join(s.answers)) == 1.0
    assert answer_score("mvalue", s.answers, ", ".join(s.answers[:2])) == 0.0  # exact match: all values or nothing
    assert answer_score("vt", ["A", "B"], "A only") == 0.5  # variable tracking keeps partial credit


def test_long_and_ruler_presets_fit_an_8k_context(smol_tok):
    from dynamo_kvtc.cli import eval as cli_eval
    from dynamo_kvtc.evaluation import tasks

    assert set(cli_eval.PRESETS) == set(tasks.PRESETS) and set(cli_eval.TASKS) == set(tasks.TASKS)
    assert {"mkey", "mvalue"} <= set(tasks.PRESETS["long"]) and set(tasks.PRESETS["ruler"]) == {"mkey", "mvalue"}
    for preset in ("long", "ruler"):
        samples = list(tasks.build(smol_tok, preset))
        lengths = [len(s.prompt) + (0 if s.target is None else len(s.target)) + s.max_new for s in samples]
        assert max(lengths) <= 8192  # SmolLM2's context (Gemma-3-270M has 32K)
        needles = [s for s in samples if s.task in ("mkey", "mvalue")]
        assert needles and min(len(s.prompt) for s in needles) >= 4000
        assert len({tuple(s.answers) for s in needles}) == len(needles)  # every sample asks for other values
    long = [s for s in tasks.build(smol_tok, "long")]
    assert min(len(s.prompt) for s in long) >= 2000


def test_a_length_filtered_run_gets_the_very_samples_of_the_whole_preset(smol_tok):
    from dynamo_kvtc.evaluation import tasks

    whole = [s for s in tasks.build(smol_tok, "full", ("ppl", "passkey")) if s.meta["length"] in (7500, 8000)]
    part = list(tasks.build(smol_tok, "full", ("ppl", "passkey"), 0, (7500, 8000)))
    assert len(part) == len(whole) == 4  # ppl at 8000, passkey at 7500 x 3 depths
    for a, b in zip(whole, part):
        assert a.task == b.task and a.answers == b.answers and torch.equal(a.prompt, b.prompt)
