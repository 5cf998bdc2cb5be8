"""Tensor parallelism with one joint basis sharded by rows (issue 16): several CPU processes (torch.distributed, gloo)
each code only their KV heads, and together write the single-process codec's blob.

The multi-process runs go through integration/tp/sharded_roundtrip.py (one process per rank, a file store).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dynamo_kvtc import KvtcCodec, calibrate
from dynamo_kvtc.calibration import Calibration
from dynamo_kvtc.calibration.tensor_parallel import head_layout, sharded_codec
from dynamo_kvtc.codec.container import parse_blob, section_chunks
from dynamo_kvtc.codec.entropy import EntropyCoder
from dynamo_kvtc.codec.sharded import HeadLayout, ShardedKvtcCodec, allreduce_bytes_per_token
from dynamo_kvtc.errors import ConfigError

from .conftest import SyntheticKV, make_fp, rel

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "integration" / "tp" / "sharded_roundtrip.py"
SHIPPED = REPO / "calibrations" / "smollm2-135m-instruct"


class Solo:
    """The collectives of a one-rank group."""

    def all_reduce_sum(self, t):
        return t

    def all_gather(self, t):
        return [t]


def run_ranks(
    tp: int, cal_dir: Path, k, v, pos, out: Path, window: int
) -> list[tuple[bytes, torch.Tensor, torch.Tensor]]:
    """Run ``tp`` gloo processes on the full KV; each returns (blob, its decoded heads' K, V)."""
    out.mkdir(parents=True, exist_ok=True)
    kv = out / "kv.safetensors"
    save_file({"k": k.contiguous(), "v": v.contiguous(), "pos": pos}, str(kv))
    cmd = [sys.executable, str(SCRIPT), "--tp", str(tp), "--calibration", str(cal_dir), "--kv", str(kv)]
    subprocess.run([*cmd, "--out", str(out), "--window", str(window)], check=True, timeout=900, cwd=REPO)
    res = []
    for r in range(tp):
        d = load_file(str(out / f"rank{r}.safetensors"))
        res.append((d["blob"].numpy().tobytes(), d["k"], d["v"]))
    return res


def raw_sections(blob: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """Header and every section's bytes before entropy coding."""
    h, recs = parse_blob(blob)
    return h, {r.name: EntropyCoder(r.tag).decompress(section_chunks(blob, r), r.raw_len) for r in recs}


def test_head_layout_is_vllms_split():
    assert head_layout(8, 4).shards == ((0, 2), (2, 4), (4, 6), (6, 8))
    lay = head_layout(2, 4)  # tp > heads: each head on two ranks, the first of them contributes
    assert lay.shards == ((0, 1), (0, 1), (1, 2), (1, 2))
    assert [lay.contributes(r) for r in range(4)] == [True, False, True, False]
    parts = [torch.full((1, 1), float(r)) for r in range(4)]
    assert lay.assemble(parts, 1).tolist() == [[0.0, 2.0]]
    with pytest.raises(ConfigError):
        HeadLayout(4, ((0, 2), (1, 3)))  # overlapping ranges
    with pytest.raises(ConfigError):
        HeadLayout(4, ((0, 2),))  # heads 2-3 held by no rank


def test_one_rank_writes_the_single_process_blob_bit_for_bit(synth, synth_cal):
    k, v, pos = synth.sample(300, start=5)
    for window in (0, 32):
        ref = KvtcCodec(synth_cal, 16, fused=False, projection="fp16", window=window)
        blob = ref.encode(k, v, pos)
        codec = sharded_codec(synth_cal, 0, 1, Solo(), ratio=16, window=window)
        assert codec.encode(k, v, pos) == blob
        k2, v2 = codec.decode(blob)
        k1, v1 = ref.decode(blob)
        assert torch.equal(k2, k1) and torch.equal(v2, v1)


def test_per_rank_calibrations_are_refused(synth, synth_cal):
    samples = [synth.sample(256, start=i) for i in range(4)]
    shard_cal = calibrate(samples, synth.fp, tp_rank=0, tp_size=2, ratios=(16,), dp_tokens=512, progress=False)
    with pytest.raises(ConfigError, match="joint calibration"):
        sharded_codec(shard_cal, 0, 2, Solo())
    assert allreduce_bytes_per_token(synth_cal, 16) == 4 * sum(
        g.k_plans[16.0].rank + g.v_plans[16.0].rank for g in synth_cal.groups
    )


def test_replicated_head_over_two_gloo_ranks_is_exactly_the_single_process_codec(tmp_path):
    """tp=2 over one KV head: both ranks hold it, one contributes (x + 0 = x), so every byte is the joint codec's."""
    src = SyntheticKV(make_fp(heads=1), seed=3)
    cal = calibrate([src.sample(512, start=i * 41) for i in range(6)], src.fp, ratios=(16,), dp_tokens=2048)
    cal.save(tmp_path / "cal")
    cal = Calibration.load(tmp_path / "cal")  # the saved basis (fp16) is what the ranks load
    k, v, pos = src.sample(400, start=2)
    ranks = run_ranks(2, tmp_path / "cal", k, v, pos, tmp_path / "run", window=16)
    ref = KvtcCodec(cal, 16, fused=False, projection="fp16", window=16)
    blob = ref.encode(k, v, pos)
    k1, v1 = ref.decode(blob)
    for b, kr, vr in ranks:
        assert b == blob
        assert torch.equal(kr, k1) and torch.equal(vr, v1)


@pytest.mark.model
def test_smollm2_tp3_on_gloo_matches_the_joint_codec(smol_heldout, tmp_path):
    """Three processes, one SmolLM2 KV head each, the shipped joint calibration, a raw window (gathered): the same
    blob on every rank, each rank's heads as the single-process codec decodes that blob (up to the bf16 rounding of
    the projection's float order), and that blob equal
    to the single-process codec's own up to the float order of the coefficient sum."""
    k, v, pos = smol_heldout
    ranks = run_ranks(3, SHIPPED, k, v, pos, tmp_path, window=128)
    blob = ranks[0][0]
    assert all(b == blob for b, _, _ in ranks)
    ref = KvtcCodec(Calibration.load(SHIPPED), 16, fused=False, projection="fp16", window=128)
    kd, vd = ref.decode(blob)  # the sharded blob is a plain single-process blob of all heads
    for r, (_, kr, vr) in enumerate(ranks):
        assert kr.shape == (k.shape[0], k.shape[1], 1, k.shape[3])
        for got, want in ((kr, kd[:, :, r : r + 1]), (vr, vd[:, :, r : r + 1])):
            # A rank projects back only its heads' rows of the basis (c @ V_t^T), the single process all rows: the
            # same float32 sums, but a CPU's GEMM may block them differently by shape (AVX-512's kernels do; on
            # AVX2 they come out identical). The result is then rounded to bf16, so a last-bit difference moves an
            # element by at most one bf16 step (<= 2^-7 of its value) or, near zero, by the float32 error itself.
            # Measured with every projection accumulated in float64 instead (another order, here): at most 2.6e-4
            # of a rank's elements moved; those that moved by more than one bf16 step (values near zero) moved by
            # at most 1.9e-6. Hence one bf16 step relative, 1e-5 absolute, and flips in under 1e-3 of the elements.
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
            assert (got != want).float().mean() < 1e-3  # rare last-bit flips, not a different reconstruction
    own = ref.encode(k, v, pos)
    k1, v1 = ref.decode(own)
    h1, s1 = raw_sections(own)
    h2, s2 = raw_sections(blob)
    assert {a: b for a, b in h1.items() if a != "sections"} == {a: b for a, b in h2.items() if a != "sections"}
    assert s1.keys() == s2.keys()
    for name in s1:
        assert s1[name].numel() == s2[name].numel()
        if name.endswith(("sinks", "window")):
            assert torch.equal(s1[name], s2[name])  # gathered heads, coded exactly as one process does
        else:  # a quantization bin boundary may flip a rare code under a different float order of the sum
            assert (s1[name] != s2[name]).float().mean() < 1e-3
    assert rel(kd, k1) < 2e-3 and rel(vd, v1) < 2e-3  # vs the codec's own error, ~0.1 / 0.25
    assert rel(k1, k) > 20 * rel(kd, k1)


def test_a_sharded_codec_checks_its_heads(synth_cal):
    codec = ShardedKvtcCodec(synth_cal, 1, head_layout(2, 2), Solo())
    assert codec.heads == slice(1, 2) and codec.contributes
    k = torch.zeros(4, 40, 2, 16, dtype=torch.bfloat16)  # both heads: this rank holds one
    with pytest.raises(Exception, match="heads"):
        codec.encode(k, k, torch.arange(40))
