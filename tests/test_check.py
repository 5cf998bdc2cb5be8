"""``dynamo-kvtc check`` and ``ratio: auto``: a short held-out pass of the shipped SmolLM2 calibration with the real
model (table structure, a tighter budget never yields a larger safe ratio), the verdict written beside the calibration
without changing its id, the connector's worker serving at the recorded ratio, and ``auto`` without a verdict refused
at start-up with one line naming the command (the engine keeps serving)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dynamo_kvtc import settings
from dynamo_kvtc.calibration.card import card
from dynamo_kvtc.calibration.verdict import CHECK_FILE, read_verdict, safe_ratio, write_verdict
from dynamo_kvtc.cli.main import build_parser
from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.offloading.options import KvtcTierOptions
from dynamo_kvtc.connector.vllm.worker import KvtcWorker
from dynamo_kvtc.errors import CalibrationError, ConfigError

SHIPPED = Path(__file__).resolve().parents[1] / "calibrations" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def cal_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("check") / "smollm2-135m-instruct"
    shutil.copytree(SHIPPED, d, ignore=shutil.ignore_patterns(CHECK_FILE))
    return d


@pytest.fixture(scope="module")
def command_run(smollm2, cal_dir, tmp_path_factory):
    """``dynamo-kvtc check`` end to end, one tiny pass (a 256-token perplexity window, 32 tokens scored; one 256-token
    passkey haystack) at 16x and 64x on the session's SmolLM2 (loaded once, not again by the command), with --write
    and --json: (stdout, the JSON)."""
    import contextlib
    import io

    from dynamo_kvtc.cli.main import main
    from dynamo_kvtc.evaluation import check

    out = tmp_path_factory.mktemp("check-out") / "check.json"
    args = ["check", str(cal_dir), "--model", "smollm2-135m-instruct", "--ratios", "16,64", "--ppl-length", "256"]
    args += ["--ppl-windows", "1", "--ppl-scored", "32", "--passkey-lengths", "256", "--depths", "0.5"]
    args += ["--write", "--json", str(out), "--no-progress"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(check, "load_model", lambda name, device=None: smollm2)  # the fixture's model, not a reload
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            assert main(args) == 0
    return text.getvalue(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def checked(command_run):
    from dynamo_kvtc.evaluation.check import CheckResult

    return CheckResult.from_dict(command_run[1])


def test_check_command_prints_the_table_writes_json_and_the_verdict(command_run, cal_dir):
    out, data = command_run
    assert "| 16× |" in out and "| 64× |" in out
    assert "largest ratio within budget (budget ΔNLL ≤ 1%, KL ≤ 0.025, top-1 ≥ 0.9, passkeys ≥ vanilla's)" in out
    assert data["samples"]["ppl_scored"] == 32 and data["budget"]["dnll_pct"] == 1.0 and data["records"]
    assert data["machine"]["cpus"] >= 1 and data["command"].startswith("dynamo-kvtc ")
    verdict = read_verdict(cal_dir, data["calibration_id"])
    assert verdict["safe_ratio"] == data["safe_ratio"] and verdict["rows"] == data["rows"]
    assert f"wrote {cal_dir / CHECK_FILE}" in out


def test_check_table_and_budgets(checked):
    from dynamo_kvtc.evaluation.check import Budget, rejudge, table

    assert [r["ratio"] for r in checked.rows] == [16.0, 64.0]
    assert checked.vanilla["passkey_n"] == 1 and checked.vanilla["nll"] > 0
    for r in checked.rows:
        assert 1 < r["achieved"] <= r["ratio"] and r["kl"] > 0 and 0 < r["top1"] <= 1
        assert r["passkey_n"] == 1 and r["pass"] == (r["why"] == "")
    kls = [r["kl"] for r in checked.rows]
    assert kls == sorted(kls)  # harder compression, further from vanilla
    text = table(checked)
    assert text.splitlines()[0] == "| ratio | achieved | KL | ΔNLL % | top-1 | passkey | verdict |"
    assert "largest ratio within budget (budget ΔNLL ≤ 1%, KL ≤ 0.025, top-1 ≥ 0.9, passkeys ≥ vanilla's)" in text
    assert "uninformative" not in checked.vanilla and "uninformative" not in text  # SmolLM2 does its tasks
    loose = rejudge(checked, Budget(dnll_pct=100.0, kl=None, passkey_slack=1, top1=None))
    assert loose.safe_ratio == 64.0 and all(r["pass"] for r in loose.rows)
    tight = rejudge(checked, Budget(dnll_pct=0.0, kl=min(kls) / 2))
    assert tight.safe_ratio is None and "fail: " in table(tight) and "none (no ratio within budget)" in table(tight)
    budgets = [  # tighter and tighter
        Budget(100.0, kl=None, top1=None),
        Budget(),
        Budget(dnll_pct=1.0, kl=kls[0]),
        Budget(0.0, kl=kls[0], top1=1.0),
    ]
    safes = [rejudge(checked, b).safe_ratio or 0.0 for b in budgets]
    assert safes == sorted(safes, reverse=True)
    with pytest.raises(ConfigError, match="ΔNLL"):
        Budget(dnll_pct=-1)


def test_verdict_written_beside_the_calibration_keeps_its_id(checked, cal_dir):
    from dynamo_kvtc.calibration.artifact import Calibration
    from dynamo_kvtc.evaluation.check import Budget, rejudge

    verdict = rejudge(checked, Budget(dnll_pct=3.0)).verdict()
    before = (cal_dir / "calibration.json").read_bytes()
    write_verdict(cal_dir, verdict)
    assert (cal_dir / "calibration.json").read_bytes() == before
    cal = Calibration.load(cal_dir)  # the id still matches its content
    assert cal.id == json.loads(before)["id"] == verdict["calibration_id"]
    assert "date" not in json.dumps(verdict) and "machine" not in verdict
    info = card(cal_dir)
    assert info["check"]["safe_ratio"] == verdict["safe_ratio"] and "stale" not in info["check"]
    assert safe_ratio(cal_dir, cal.id, cal.ratios) == verdict["safe_ratio"]
    with pytest.raises(CalibrationError, match="measured with calibration a5e2511dd202"):
        read_verdict(cal_dir, "0" * 32)  # a verdict of other tensors is refused
    write_verdict(cal_dir, {**verdict, "calibration_id": "0" * 32})  # the directory's tensors replaced since
    assert "stale" in card(cal_dir)["check"]
    with pytest.raises(CalibrationError, match="measured with calibration 000000000000"):
        safe_ratio(cal_dir, cal.id, cal.ratios)
    (cal_dir / CHECK_FILE).write_text("{}")
    with pytest.raises(CalibrationError, match="is not a dynamo-kvtc-check version 1 file"):
        card(cal_dir)
    write_verdict(cal_dir, verdict)


def _smol_worker(smollm2, cal_dir, ratio) -> KvtcWorker:
    model, _ = smollm2
    cfg = ConnectorConfig.from_sources({"calibration": str(cal_dir), "ratio": ratio}, env={})
    return KvtcWorker(
        cfg,
        engine_id=f"t-{uuid.uuid4().hex[:8]}",
        model="smollm2-135m-instruct",
        hf_config=model.config,
        block_size=16,
        num_blocks=4,
    )


def _caches(hf):
    shape = (2, 4, 16, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads)
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16)
        for i in range(hf.num_hidden_layers)
    }


def test_ratio_auto_serves_at_the_recorded_ratio_and_refuses_without_one(smollm2, checked, cal_dir, tmp_path, caplog):
    write_verdict(cal_dir, checked.verdict() | {"safe_ratio": 32.0})
    w = _smol_worker(smollm2, cal_dir, "auto")
    try:
        w.register_kv_caches(_caches(smollm2[0].config))
        assert w.disabled is None, w.disabled
        assert w.store.policy.default == 32.0 and w.cfg.tiers.ratio == 32.0
    finally:
        w.shutdown()
    bare = tmp_path / "smollm2-135m-instruct"
    shutil.copytree(cal_dir, bare, ignore=shutil.ignore_patterns(CHECK_FILE))
    w = _smol_worker(smollm2, bare, "auto")
    try:  # `auto` with no verdict is a ratio policy that cannot be resolved: invalid configuration, the engine stops
        with pytest.raises(ConfigError) as e:
            w.register_kv_caches(_caches(smollm2[0].config))
        line = str(e.value)
        assert line.startswith("kv_connector_extra_config.ratio: ") and "\n" not in line  # one line, the key named
        assert f"dynamo-kvtc check {bare} --model smollm2-135m-instruct --write" in line
        assert w.store is None and w.disabled is None  # nothing was started to serve without
    finally:
        w.shutdown()


def test_ratio_setting_takes_auto():
    assert settings.parse("ratio", " Auto ", from_extra=True) == "auto"
    assert ConnectorConfig.from_sources({}, env={"DYN_KVTC_RATIO": "auto"}).tiers.ratio == "auto"
    with pytest.raises(ConfigError, match="expected a number or 'auto'"):
        settings.parse("ratio", "fast", from_extra=True)
    with pytest.raises(ConfigError, match="must be > 0"):
        settings.parse("ratio", "0")
    from dynamo_kvtc.tiers.admission import RatioPolicy

    with pytest.raises(ConfigError, match="not resolved"):
        RatioPolicy([16.0], "auto")


def test_offload_tier_ratio_auto(checked, cal_dir, tmp_path):
    pytest.importorskip("vllm")
    from dynamo_kvtc.connector.offloading.tier import open_calibration

    assert KvtcTierOptions.from_config({"ratio": "AUTO"}).ratio == "auto"
    with pytest.raises(ConfigError, match=r"ratio='fast' is invalid: expected a number or 'auto'"):
        KvtcTierOptions.from_config({"ratio": "fast"})
    write_verdict(cal_dir, checked.verdict() | {"safe_ratio": 64.0})
    cfg = SimpleNamespace(model=SimpleNamespace(name="smollm2-135m-instruct"))  # what the tier reads of vLLM's config
    opts = KvtcTierOptions.from_config({"ratio": "auto", "calibration": str(cal_dir)})
    opened = open_calibration(opts, cfg, torch.device("cpu"))
    assert opened.ratio == 64.0 and opened.codec.ratio == 64.0
    assert opened.fingerprint is not None  # the served model's config was read: the calibration was checked
    bare = tmp_path / "bare"
    shutil.copytree(cal_dir, bare, ignore=shutil.ignore_patterns(CHECK_FILE))
    opts = KvtcTierOptions.from_config({"ratio": "auto", "calibration": str(bare)})
    with pytest.raises(ConfigError, match=r"secondary_tiers\[type=kvtc\]\.ratio: .*dynamo-kvtc check .* --write"):
        open_calibration(opts, cfg, torch.device("cpu"))


def test_check_arguments():
    a = build_parser().parse_args(["check", str(SHIPPED), "--model", "m"])
    assert (a.budget_dnll, a.budget_kl, a.budget_top1, a.passkey_slack, a.write) == (1.0, 0.025, 0.9, 0, False)
    assert a.passkey_lengths == [1024, 2048] and a.depths == (0.2, 0.5, 0.8)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", str(SHIPPED), "--model", "m", "--depths", "1.5"])


def test_decode_side_link_estimate_takes_ratio_auto():
    """The decode side's raw-or-compressed estimate runs in the scheduler, which holds no calibration: with ``auto``
    it estimates at the default ratio instead of failing."""
    from types import SimpleNamespace

    from dynamo_kvtc.connector.handoff.link_choice import COMPRESSED, LinkPolicy
    from dynamo_kvtc.connector.vllm.remote_prefill import RemotePrefill
    from dynamo_kvtc.tiers.config import TierConfig

    cfg = ConnectorConfig(
        tiers=TierConfig(ratio="auto"),
        transfer="decode",
        transfer_port=5555,
        handoff_choice="policy",
        transfer_peers="10.0.0.2",  # the prefill host named below is trusted (decode workers fetch only from those)
    )
    rp = RemotePrefill(cfg, "engine-a", 16, lambda: 5555, link=LinkPolicy(100, 50), kv_bytes_per_token=160 * 1024)
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "p", "remote_host": "h",
              "remote_port": 7000, "kvtc_host": "10.0.0.2", "kvtc_port": 5555, "kvtc_blocks": 512}  # fmt: skip
    req = SimpleNamespace(request_id="r", kv_transfer_params=params, prompt_token_ids=list(range(8193)))
    assert rp.applies(req) is True and params["kvtc_choice"] == COMPRESSED  # a slow link: compressed at 16x


def test_a_random_weight_model_makes_every_task_uninformative_and_ratio_auto_refuses(smollm2, cal_dir, tmp_path):
    """A model that cannot do the check's tasks cannot pass a ratio on them: SmolLM2's own shape and tokenizer with
    random weights (the shipped calibration's fingerprint still fits) finds no passkey and predicts the text at about
    ln(vocab), so both tasks are reported as uninformative, no ratio passes and ``ratio: auto`` refuses naming why."""
    from transformers import AutoModelForCausalLM

    from dynamo_kvtc.calibration.artifact import Calibration
    from dynamo_kvtc.evaluation.check import CheckSamples, run_check, table

    model, tok = smollm2
    torch.manual_seed(0)
    rand = AutoModelForCausalLM.from_config(model.config).eval()
    samples = CheckSamples(ppl_length=256, ppl_windows=1, ppl_scored=32, passkey_lengths=(256,), depths=(0.5,))
    result = run_check(
        rand, tok, Calibration.load(cal_dir), model_name="random", ratios=[16.0], samples=samples, progress=False
    )
    blind = result.vanilla["uninformative"]
    assert set(blind) == {"dnll", "passkey"}, result.vanilla
    assert "vanilla finds 0/1 passkeys" in blind["passkey"] and "near ln(vocab)" in blind["dnll"]
    assert result.safe_ratio is None and not any(r["pass"] for r in result.rows)
    assert all("no task informs" in r["why"] for r in result.rows)
    text = table(result)
    assert "uninformative: dnll" in text and "uninformative: passkey" in text
    d = tmp_path / "random-cal"
    shutil.copytree(cal_dir, d, ignore=shutil.ignore_patterns(CHECK_FILE))
    write_verdict(d, result.verdict())
    with pytest.raises(CalibrationError, match="could not judge any ratio") as e:
        safe_ratio(d, result.calibration_id, [16.0], "random")
    assert "\n" not in str(e.value) and "set a ratio explicitly" in str(e.value)
