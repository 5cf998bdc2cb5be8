"""The effective ratio of stored conversations: multi-turn workloads driven through a real ``KvtcStore`` as the
connector saves them (each turn's prompt, then the reply's full blocks), with the moving raw window and without it.

The K/V are real (the model's, captured on held-out text); a conversation longer than the capture repeats it, its keys
re-rotated to their new positions (RoPE removed at the captured positions, applied at the conversation's), so the
codec sees what a longer context of that text would give: the store is driven directly, the model's attention is not
run. Per workload: the effective ratio (raw / stored bytes the tiers hold at the end), the bound
``B = T / ((T - window) / c + window)`` with ``c`` the codec's own ratio on the same tokens (one span, no raw window),
the same store with the window kept per offload (the ratio before the moving window), and the encode time per turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..codec.base import EncodeSpan
from ..codec.rope import apply_rope, remove_rope


@dataclass(frozen=True)
class Workload:
    """A conversation: the first prompt's tokens, then per round a question and a reply of these sizes."""

    name: str
    first: int  # tokens of the first prompt (a history, a document)
    rounds: int
    question: int
    reply: int
    note: str

    @property
    def tokens(self) -> int:
        return self.first + self.rounds * (self.question + self.reply) - self.question


WORKLOADS = {
    "lmbench": Workload(
        "lmbench", 20_000, 20, 100, 100, "LMBenchmark multi-round QA: a 20K-token history, 20 rounds of ~100-token Q/A"
    ),
    "chat4k": Workload("chat4k", 924, 4, 900, 124, "4K-token chats of 4 turns (900-token messages, 124-token replies)"),
    "demo": Workload("demo", 1_450, 3, 20, 32, "the demo's shape: a 1.45K-token document, three short Q/A turns"),
}


def conversation_kv(cal: Any, k: torch.Tensor, v: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [L, tokens, H, D] from the captured ``k``/``v`` (positions 0..), repeated with the keys re-rotated."""
    n = k.shape[1]
    if tokens <= n:
        return k[:, :tokens], v[:, :tokens]
    ks, vs = [], []
    src = torch.arange(n)
    for a in range(0, tokens, n):
        b = min(tokens, a + n)
        m = b - a
        if a == 0:
            ks.append(k[:, :m])
        else:
            dst = torch.arange(a, b)
            layers = []
            for i, rot in enumerate(cal.fingerprint.rotary):
                x = k[i, :m].float()
                x = apply_rope(remove_rope(x, src[:m], rot), dst, rot) if rot is not None else x
                layers.append(x.to(k.dtype))
            ks.append(torch.stack(layers))
        vs.append(v[:, :m])
    return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


def _saves(w: Workload) -> list[tuple[int, bool]]:
    """(sequence length, ends a prompt) of each save, in order: a turn's prompt, then its reply."""
    out, t = [], w.first
    for r in range(w.rounds):
        if r:
            t += w.question
        out.append((t, True))
        t += w.reply
        out.append((t, False))
    return out


def run_conversation(store: Any, w: Workload, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """Store one conversation as the connector saves it; the held bytes and encode times."""
    bs = store.block_size
    toks = list(range(7, 7 + w.tokens))
    turn_s: list[float] = []
    t_turn = 0.0
    for t, prompt in _saves(w):
        n = t // bs * bs
        hashes = store.hashes(toks[:n])
        a = store.match(hashes)
        if a == len(hashes):
            continue
        t0 = time.perf_counter()
        res = store.submit_offload(
            hashes[a:],
            toks[a * bs : n],
            first_block=a,
            parent=hashes[a - 1] if a else None,
            keys=k[:, a * bs : n],
            values=v[:, a * bs : n],
            tail=prompt,
        ).result()
        if res.skipped is not None:
            raise RuntimeError(f"offload skipped: {res.skipped}")
        t_turn += time.perf_counter() - t0
        if not prompt:
            turn_s.append(t_turn)
            t_turn = 0.0
    st = store.stats
    return {
        "effective_ratio": st.effective_ratio,
        "held_raw_bytes": st.held_raw_bytes,
        "held_stored_bytes": st.held_stored_bytes,
        "encode_s_per_turn": turn_s,
        "windows_recoded": st.offload_window_recoded,
        "window_blocks_recoded": st.offload_window_blocks,
    }


def codec_ratio(store: Any, k: torch.Tensor, v: torch.Tensor, ratio: float) -> float:
    """The codec's own ratio on these tokens: one span from position 0, no raw window (sinks and headers counted)."""
    codec = store.codec(ratio)
    n = k.shape[1]
    spans = [EncodeSpan(0, torch.arange(n), 0)]
    blob = next(iter(codec.encode_spans(spans, lambda a, b: (k[:, a:b], v[:, a:b])).blobs))
    raw = n * store.cal.fingerprint.raw_bytes_per_token(k.dtype)
    return raw / len(bytes(blob))


def run_workloads(cal: Any, k: torch.Tensor, v: torch.Tensor, names: list[str], args: Any, make_store) -> dict:
    """Every named workload, with the moving window and without it (``make_store(cfg)`` opens a store)."""
    from ..tiers import TierConfig

    ratio = (args.ratios or (16,))[0]
    out = {}
    for name in names:
        w = WORKLOADS[name]
        bs = args.block_size
        T = w.tokens // bs * bs  # what the tiers hold: the full blocks
        kk, vv = conversation_kv(cal, k, v, w.tokens)
        row: dict[str, Any] = {"workload": name, "note": w.note, "tokens": T, "turns": w.rounds}
        for moving in (True, False):
            cfg = TierConfig(host_bytes=max(256 << 20, T * 4096), ratio=ratio, min_tokens=0, window=args.window)
            store = make_store(cfg)
            try:
                store.offloader.moving_window = moving and store.offloader.moving_window
                got = run_conversation(store, w, kk, vv)
                if moving:
                    c = codec_ratio(store, kk[:, :T], vv[:, :T], ratio)
            finally:
                store.close()
            row["moving_window" if moving else "window_per_offload"] = got
        win = args.window
        row["codec_ratio"] = c
        row["bound"] = T / ((T - win) / c + win)
        row["effective_ratio"] = row["moving_window"]["effective_ratio"]
        row["of_bound"] = row["effective_ratio"] / row["bound"]
        m, b = row["moving_window"]["encode_s_per_turn"], row["window_per_offload"]["encode_s_per_turn"]
        row["extra_encode_ms_per_turn"] = {
            "mean": 1e3 * (sum(m[1:]) - sum(b[1:])) / max(1, len(m) - 1),  # turns after the first
            "first_turn": 1e3 * (m[0] - b[0]),
        }
        out[name] = row
    return out
