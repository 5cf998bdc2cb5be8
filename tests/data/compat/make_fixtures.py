"""Rebuild the blob-format compatibility fixtures in this folder (run from the repository root).

    .venv/bin/python tests/data/compat/make_fixtures.py

Writes ``cal/`` (a small calibration artifact: 4 layers in 2 layer groups, 2 KV heads, head_dim 16), and per case
``<case>.inputs.safetensors`` (keys, values, positions), ``<case>.kvtc`` (the blob: the reference and the fused-on-CPU
writers produce the same bytes for these inputs) and ``<case>.expect.safetensors`` (the blob decoded by the reference
path, ``ref_*``, and by the fused path on the CPU, ``fused_*``: the fused decode keeps coefficients in fp16).

The calibration is chosen so that every float operation of encode and decode is exact or a single correctly rounded
element-wise operation, so the stored decodes are bit-identical on any CPU: the bases are signed permutations (one
+-1 per column), means and KV values are multiples of 1/16 small enough for bf16, and RoPE is not removed (no
trigonometry). The DP plans are real DP allocations on a power-law spectrum (int2/int4/fp8/none groups).

The blobs were written by the writers of commit e7a433a (before issue 12's container refactor); tests/test_compat.py
checks that they still decode bit-identically and that today's writers produce the same bytes. Never regenerate the
``*.kvtc`` files to make a test pass: they are the proof that old blobs still decode.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
L, H, D = 4, 2, 16
GROUPS = ((0, 2), (2, 4))
RATIOS = (2.0, 4.0, 8.0)

# case name -> (tokens, first position, gap after token index (None: contiguous), ratio, window, tag)
CASES = {
    "sinks_window": (160, 0, None, 4.0, 32, "deflate"),  # sinks (fp8) + coded + raw window, two layer groups
    "short_raw": (12, 0, None, 4.0, 32, "deflate"),  # too few coded tokens: stored raw
    "offset_gap": (96, 1000, 40, 8.0, 0, "deflate"),  # no sinks, no window, two position runs
    "store_tag": (64, 2, None, 2.0, 8, "store"),  # two sink tokens, coded sections not entropy coded
}


def build_calibration():
    from dynamo_kvtc.calibration.artifact import Calibration
    from dynamo_kvtc.calibration.dp import allocate, block_errors
    from dynamo_kvtc.calibration.synthetic import spectrum
    from dynamo_kvtc.codec.model import BasisGroup, ModelFingerprint
    from dynamo_kvtc.codec.plan import Plan
    from dynamo_kvtc.codec.rope import RotaryConfig

    g = torch.Generator().manual_seed(12)
    fp = ModelFingerprint(
        "SyntheticForCausalLM",
        L,
        H,
        D,
        "bfloat16",
        tuple(RotaryConfig(D, theta=10000.0) for _ in range(L)),
        model_name="compat-fixture",
        total_kv_heads=H,
    )
    groups = []
    for l0, l1 in GROUPS:
        p = (l1 - l0) * H * D
        parts = {}
        for _ in "kv":
            perm = torch.randperm(p, generator=g)
            sign = torch.where(torch.rand(p, generator=g) < 0.5, -1.0, 1.0)
            basis = torch.zeros(p, p)
            basis[perm, torch.arange(p)] = sign
            mean = torch.randint(-8, 9, (p,), generator=g).float() / 16
            coeffs = torch.randn(1024, p, generator=g) * spectrum(p).sqrt()
            zero, errs = block_errors(coeffs)
            budgets = [int(16 * p / r) for r in RATIOS]
            plans = {r: Plan(p, r, b, a.groups) for r, b, a in zip(RATIOS, budgets, allocate(zero, errs, budgets))}
            parts[_] = (mean, basis.to(torch.float16), plans)
        k, v = parts["k"], parts["v"]
        groups.append(BasisGroup((l0, l1), k[0], k[1], v[0], v[1], k[2], v[2]))
    return Calibration(fp, groups, rope_removed=False, provenance={"fixture": "tests/data/compat", "seed": 12})


def make_inputs(cal, tokens: int, start: int, gap: int | None, seed: int):
    """KV whose coefficients follow a power-law spectrum, rounded to multiples of 1/16 (exact in bf16)."""
    from dynamo_kvtc.calibration.synthetic import spectrum

    g = torch.Generator().manual_seed(seed)
    out = []
    for kind in "kv":
        per_group = []
        for grp in cal.groups:
            mean = getattr(grp, f"{kind}_mean")
            basis = getattr(grp, f"{kind}_basis").float()
            r = basis.shape[1]  # the artifact keeps the components its widest plan uses
            z = torch.randn(tokens, r, generator=g) * (8 * spectrum(r).sqrt())
            x = z @ basis.t() + mean
            per_group.append(x.view(tokens, grp.num_layers, H, D))
        x = torch.cat(per_group, dim=1).permute(1, 0, 2, 3)
        x = (x * 16).round().clamp(-255, 255) / 16
        out.append(x.to(torch.bfloat16).contiguous())
    pos = torch.arange(start, start + tokens, dtype=torch.int64)
    if gap is not None:
        pos[gap:] += 17
    return out[0], out[1], pos


def load_calibration():
    from dynamo_kvtc.calibration.artifact import Calibration

    return Calibration.load(HERE / "cal")


def load_case(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(HERE / f"{name}.inputs.safetensors"))


def codecs(cal, ratio: float, window: int, tag: str):
    """The reference codec and the fused codec (torch stages on the CPU) for one case."""
    from dynamo_kvtc.codec import CodecOptions, KvtcCodec

    strict = CodecOptions(fused_strict=True)  # a failing fused path must fail, not fall back
    ref = KvtcCodec(cal, ratio=ratio, window=window, tag=tag, fused=False)
    fus = KvtcCodec(cal, ratio=ratio, window=window, tag=tag, fused=True, options=strict)
    return ref, fus


def main() -> None:
    build_calibration().save(HERE / "cal")
    cal = load_calibration()
    for i, (name, (tokens, start, gap, ratio, window, tag)) in enumerate(CASES.items()):
        k, v, pos = make_inputs(cal, tokens, start, gap, seed=100 + i)
        save_file({"keys": k, "values": v, "positions": pos}, str(HERE / f"{name}.inputs.safetensors"))
        ref, fus = codecs(cal, ratio, window, tag)
        b_ref = ref.encode(k, v, pos)
        b_fus = fus.encode(k, v, pos)
        if b_ref != b_fus:
            raise SystemExit(f"{name}: the reference and fused writers disagree; fix the writers, not the fixture")
        (HERE / f"{name}.kvtc").write_bytes(b_ref)
        kr, vr = ref.decode(b_ref)
        kf, vf = fus.decode(b_ref)
        save_file(
            {"ref_keys": kr, "ref_values": vr, "fused_keys": kf, "fused_values": vf},
            str(HERE / f"{name}.expect.safetensors"),
        )
        print(f"{name}: {len(b_ref)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
