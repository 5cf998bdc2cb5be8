"""The engine loop of ``bench serve``: continuous batching over a trace, prefix reuse through the real ``KvtcStore``.

Each step takes the decodes of the running sequences (one token each) and chunks of their prefills up to a token budget
(chunked prefill), and runs them through a random-initialised decoder of a real model's shape
(:class:`~dynamo_kvtc.bench.gpu_model.RandomDecoder`'s weights; speed only — the weights are random, the replies mean
nothing). A request whose prompt starts with blocks the store holds restores them (``start_onboard`` in place into the
sequence's pages of the engine's paged KV pool — vLLM's ``flash`` layout, the path the connector takes — layer by
layer: attention on layer i waits for layer i only; a store without a registered cache gets a sink) and computes the
rest; a finished request offloads its prompt and reply (``submit_offload``, on the store's own worker/stream) and frees
its KV. There is no prefix cache on the device: what the tier does not hold is recomputed. A later turn of a session
arrives at its scheduled time, but never before the turn it follows finished *and* that turn's offload was stored (a
user reads the reply before asking again; the tier's encode time still delays the turn when the trace is that dense).

Times are measured in the run itself (the device synchronised after every step). Idle gaps between arrivals are
skipped once the offload worker is idle (the clock jumps to the next arrival), so a trace of minutes runs in the time
its work takes.

What operators watch comes from the same clock: each generated token's time (TTFT, TPOT, inter-token latency), and
each step's time. A step's time is its forward pass (GEMMs, attention, KV writes of every token of the step), waits
for restored layers, and whatever else shares the device and the host meanwhile (the tier's encode on the offload
stream, its decode on the restore stream, its worker threads). The *stretch* is how much longer steps took than the
same steps without the tier's work: after the run, with the tier idle, a sample of the run's steps (reservoir, per
class: a restore in the batch / tier work in flight / nothing) is replayed — the same sequences, positions and
token counts — and timed (:class:`~.latency.StepLog`, with the metrics and the summary in :mod:`.latency`;
re-exported here).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ...errors import TierError
from ...tiers.keys import sequence_hashes
from ...tiers.layout import PagedKV
from .latency import STEP_CLASSES, RequestMetrics, RunRecord, StepLog, summarize
from .workloads import Request, Workload, segment_ids

log = logging.getLogger(__name__)

__all__ = ["STEP_CLASSES", "EngineConfig", "RequestMetrics", "RunRecord", "ServeEngine", "StepLog", "summarize"]


@dataclass(frozen=True)
class EngineConfig:
    """The batching limits: tokens per step (prefill chunks + decodes), sequences running at once, the store's block
    and span size; the TTFT and TPOT SLOs goodput is counted against; how many steps per class are replayed to
    measure the stretch (0: none)."""

    token_budget: int = 8192
    max_seqs: int = 8
    block_size: int = 16
    span_tokens: int = 1024
    slo_s: float = 2.0  # TTFT
    slo_tpot_s: float = 0.1
    stretch_samples: int = 16


@dataclass
class _Seq:
    req: Request
    m: RequestMetrics
    tokens: list[int]  # prompt + reply
    slot: int  # its rows of the engine's KV pool
    k: torch.Tensor  # [L, max tokens, H, D]: a view of the pool
    v: torch.Tensor
    computed: int = 0  # tokens whose KV is in k/v
    generated: int = 0
    handle: Any = None
    failed: bool = False

    @property
    def prompt(self) -> int:
        return self.m.prompt_tokens

    def sink(self, layer: int, start: int, kk: torch.Tensor, vv: torch.Tensor) -> None:
        self.k[layer, start : start + kk.shape[0]] = kk
        self.v[layer, start : start + vv.shape[0]] = vv


@lru_cache(maxsize=4096)
def _segment(seed: int, seg: str, n: int) -> tuple[int, ...]:
    return tuple(segment_ids(seed, seg, n))


def request_tokens(seed: int, r: Request) -> list[int]:
    """Prompt + reply token ids of a request (the reply is the output segment: the decode is teacher-forced, so a
    later turn's history matches what this turn stored)."""
    out: list[int] = []
    for s, n in [*r.segments, r.output]:
        out.extend(_segment(seed, s, n))
    return out


def max_tokens(w: Workload, block_size: int) -> int:
    """The longest request of ``w`` (prompt + reply), rounded up to whole blocks."""
    n = max((r.prompt_tokens + r.output_tokens for r in w.requests), default=1)
    return -(-n // block_size) * block_size


def _rms(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def _rot(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d] rotated by ``cos``/``sin`` [n, 1, d] (rotate-half, as the decoder does)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class ServeEngine:
    """Runs one trace against one system: owns the running sequences, their KV (one pool of ``max_seqs`` slots; a
    slot is reused only after its sequence's offload finished), the clock and the metrics. It uses ``store`` (None:
    no offload) only through its public methods, and never changes the decoder's weights."""

    def __init__(self, decoder: Any, store: Any, cfg: EngineConfig, device: str | torch.device) -> None:
        self.dec, self.store, self.cfg = decoder, store, cfg
        self.dev = torch.device(device)
        self.L, self.H, self.D = decoder.s.layers, decoder.s.kv_heads, decoder.s.head_dim
        self.nh = decoder.d.heads
        # compute in bf16 on GPUs, in float32 on CPUs (CPU bf16 GEMMs and attention are slow); the KV is bf16 either way
        self.dt = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        conv = (lambda t: t) if self.dt == torch.bfloat16 else (lambda t: t.to(self.dt))
        self.layers = [{k: conv(t) for k, t in lw.items()} for lw in decoder.layers]
        self.embed = conv(decoder.embed) if decoder.embed is not None else None
        self.head = conv(decoder.head) if decoder.head is not None else None
        self._busy: dict[int, Any] = {}  # slot -> the offload still reading it
        self._free: list[int] = []
        self.pool: torch.Tensor | None = None  # [L, 2, slots * blocks per slot, block, H, D] bf16 (vLLM's flash pages)
        self.kview: torch.Tensor | None = None  # the same memory as [L, 2, slots, max tokens, H, D]
        self.max_len = 0
        self._saved: dict[int, float] = {}  # request id -> when its offload was stored (run clock)
        self._t0 = 0.0
        self._skipped = 0.0
        self.steps = StepLog(cfg.stretch_samples)

    # ------------------------------------------------------------------ clock
    def clock(self) -> float:
        return time.perf_counter() - self._t0 + self._skipped

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    # ------------------------------------------------------------------ the loop
    def run(self, w: Workload) -> list[RequestMetrics]:
        reqs = sorted(w.requests, key=lambda r: (r.arrival_s, r.id))
        t_first = reqs[0].arrival_s if reqs else 0.0
        future: deque[Request] = deque(reqs)
        blocked: list[Request] = []  # arrived, waiting for the turn they follow
        waiting: deque[_Seq | Request] = deque()
        running: list[_Seq] = []
        done: dict[int, RequestMetrics] = {}
        if self.pool is None or self.max_len < max_tokens(w, self.cfg.block_size):
            self.alloc(w)
        self._free, self._busy = list(range(self.cfg.max_seqs)), {}
        self._t0, self._skipped, self._saved = time.perf_counter(), 0.0, {}
        self.steps = StepLog(self.cfg.stretch_samples)
        while future or blocked or waiting or running:
            now = self.clock() + t_first
            while future and future[0].arrival_s <= now:
                blocked.append(future.popleft())
            for r in [r for r in blocked if r.after < 0 or r.after in self._saved]:
                blocked.remove(r)
                waiting.append((r, max(r.arrival_s, self._saved.get(r.after, 0.0))))
            self._reclaim()
            while waiting and self._free:
                r, arrival = waiting.popleft()
                running.append(self._admit(w.seed, r, arrival, now))
            if not running:
                if waiting:  # every slot is still being offloaded
                    self._drain()
                else:
                    self._idle(future, blocked, t_first)
                continue
            self._step(running, t_first)
            for s in [s for s in running if s.generated >= s.req.output_tokens]:
                running.remove(s)
                s.m.finish_s = self.clock() + t_first
                done[s.req.id] = s.m
                self._offload(s, t_first)
        self._drain()
        self.steps.replay(self._replay)  # the tier is idle now: the same steps without its work
        self.pool = self.kview = None
        return [done[r.id] for r in reqs]

    def _replay(self, batch: list[tuple[_Seq, int, int]]) -> float:
        """One step of the run again (its sequences' KV views, positions and token counts; no restore waits): its
        time. The KV it writes lands where that step wrote it; the run is over, nothing reads it any more."""
        self._sync()
        t0 = time.perf_counter()
        self._forward(batch)
        self._sync()
        return time.perf_counter() - t0

    def alloc(self, w: Workload, memory: torch.Tensor | None = None) -> PagedKV:
        """The KV pool for ``w`` (``max_seqs`` slots of its longest request, whole blocks), as the paged cache a store
        restores into in place (vLLM's ``flash`` layout per layer: ``[2, blocks, block, H, D]``). ``memory``: a bf16
        tensor on the device to carve it from (zeroed here) instead of a new allocation, so runs one after another
        reuse one pool (a long-context pool is a third of a GPU)."""
        bs = self.cfg.block_size
        self.max_len = max_tokens(w, bs)
        nb = self.cfg.max_seqs * self.max_len // bs
        shape = (self.L, 2, nb, bs, self.H, self.D)
        if memory is not None and memory.numel() >= math.prod(shape):
            self.pool = memory.view(-1)[: math.prod(shape)].view(shape).zero_()
        else:
            # zeros, not empty: the batched decode attention reads every slot's rows up to the longest decode,
            # masked; a NaN left in never-written memory would survive the mask (NaN * 0) and poison other decodes
            self.pool = torch.zeros(shape, dtype=torch.bfloat16, device=self.dev)
        self.kview = self.pool.view(self.L, 2, self.cfg.max_seqs, self.max_len, self.H, self.D)
        return PagedKV([self.pool[i] for i in range(self.L)], "flash", bs)

    def slot_blocks(self, slot: int, n: int) -> list[int]:
        """The pool's first ``n`` block ids of ``slot``."""
        first = slot * (self.max_len // self.cfg.block_size)
        return list(range(first, first + n))

    def _idle(self, future: deque, blocked: list, t_first: float) -> None:
        """Nothing runs: let the offload worker finish, then jump the clock to the next arrival."""
        self._drain()
        nxt = [r.arrival_s for r in list(future)[:1]]
        nxt += [max(r.arrival_s, self._saved[r.after]) for r in blocked if r.after in self._saved]
        if not nxt:
            raise ValueError(f"requests {[r.id for r in blocked]} follow turns that are not in the trace")
        gap = min(nxt) - (self.clock() + t_first)
        if gap > 0:
            self._skipped += gap

    def _admit(self, seed: int, r: Request, arrival: float, now: float) -> _Seq:
        toks = request_tokens(seed, r)
        n = len(toks)
        m = RequestMetrics(r.id, r.session, arrival, r.prompt_tokens, r.output_tokens, start_s=now)
        slot = self._free.pop()
        s = _Seq(r, m, toks, slot, self.kview[:, 0, slot, :n], self.kview[:, 1, slot, :n])
        if self.store is not None:
            bs = self.cfg.block_size
            hashes = sequence_hashes(toks[: r.prompt_tokens], bs)
            hit = min(self.store.match(hashes), (r.prompt_tokens - 1) // bs)  # the last prompt token is computed
            if hit and getattr(self.store, "kv", None) is not None:  # in place, as the connector restores into vLLM
                s.handle = self.store.start_onboard(hashes[:hit], self.slot_blocks(slot, hit))
            elif hit:
                s.handle = self.store.start_onboard(hashes[:hit], sink=s.sink)
            if hit:
                s.computed = m.hit_tokens = hit * bs
        return s

    def _offload(self, s: _Seq, t_first: float) -> None:
        rid = s.req.id
        bs = self.cfg.block_size
        n = (s.computed // bs) * bs
        if self.store is None or n == 0:
            self._saved[rid] = s.m.finish_s
            self._free.append(s.slot)
            return
        ev = None
        if self.dev.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
        hashes = sequence_hashes(s.tokens[:n], bs)
        fut = self.store.submit_offload(hashes, s.tokens[:n], keys=s.k[:, :n], values=s.v[:, :n], ready_event=ev)
        fut.add_done_callback(lambda _f: self._saved.__setitem__(rid, self.clock() + t_first))
        self._busy[s.slot] = fut

    def _reclaim(self) -> None:
        for slot in [k for k, f in self._busy.items() if f.done()]:
            del self._busy[slot]
            self._free.append(slot)

    def _drain(self) -> None:
        for f in list(self._busy.values()):
            f.result()
        self._reclaim()

    # ------------------------------------------------------------------ one step
    def _plan(self, running: list[_Seq]) -> list[tuple[_Seq, int, int]]:
        """(sequence, first position, tokens) of this step: every decode first, then prefill chunks within the
        budget."""
        budget = self.cfg.token_budget
        batch = []
        for s in running:
            if s.computed >= s.prompt:
                batch.append((s, s.computed, 1))
                budget -= 1
        for s in running:
            if s.computed < s.prompt and budget > 0:
                n = min(budget, s.prompt - s.computed)
                batch.append((s, s.computed, n))
                budget -= n
        return batch

    def _step(self, running: list[_Seq], t_first: float) -> None:
        batch = self._plan(running)
        if any(s.handle is not None for s, _, _ in batch):
            cls = "restore"
        elif any(not f.done() for f in self._busy.values()) or any(s.handle is not None for s in running):
            cls = "tier"
        else:
            cls = "idle"
        t0 = time.perf_counter()
        self._forward(batch)
        self._sync()
        self.steps.add(cls, batch, time.perf_counter() - t0)
        now = self.clock() + t_first
        for s, start, n in batch:
            if s.failed:  # the restore failed during this step: recompute the whole prompt
                s.failed, s.handle, s.computed, s.m.hit_tokens, s.m.restore_failed = False, None, 0, 0, True
                continue
            if s.handle is not None:
                s.m.restore_s = max((t for t in s.handle.ready_times if t is not None), default=0.0)
                s.handle = None
            s.computed = start + n
            if start + n >= s.prompt and s.generated == 0 or start >= s.prompt:
                s.generated += 1
                s.m.token_times.append(now)
                if s.generated == 1:
                    s.m.first_token_s = now

    def _forward(self, batch: list[tuple[_Seq, int, int]]) -> None:
        """One step: GEMMs, RoPE and the KV writes batched over every token of the step; attention batched over the
        decodes (one call over the pool), one call per prefill chunk."""
        dec, dev = self.dec, self.dev
        hd, nkv, nh = self.D, self.H, self.nh
        ids = torch.tensor([t for s, a, n in batch for t in s.tokens[a : a + n]], device=dev)
        pos_l = [p for _, a, n in batch for p in range(a, a + n)]
        pos = torch.tensor(pos_l, device=dev)
        flat = torch.tensor([s.slot * self.max_len + p for s, a, n in batch for p in range(a, a + n)], device=dev)
        ang = pos.float()[:, None] * dec.inv_freq[None, :]
        ang = torch.cat((ang, ang), -1)[:, None, :]
        cos, sin = ang.cos().to(self.dt), ang.sin().to(self.dt)
        B = sum(1 for s, a, n in batch if a >= s.prompt)  # the decodes (first in the batch)
        dmask = self._decode_mask(batch[:B]) if B else None
        x = self.embed[ids] if self.embed is not None else torch.zeros(len(ids), dec.d.hidden, device=dev)
        x = x.to(self.dt)
        for i, lw in enumerate(self.layers):
            self._wait_layer(batch, i)
            q_all, k_all, v_all = (_rms(x) @ lw["qkv"]).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q_all = _rot(q_all.reshape(-1, nh, hd), cos, sin)
            pk, pv = self.kview[i, 0].view(-1, nkv, hd), self.kview[i, 1].view(-1, nkv, hd)
            pk.index_copy_(0, flat, _rot(k_all.reshape(-1, nkv, hd), cos, sin).to(pk.dtype))
            pv.index_copy_(0, flat, v_all.reshape(-1, nkv, hd).to(pv.dtype))
            outs, o = [], B
            if B:
                outs.append(self._decode_attend(i, q_all[:B], batch[:B], dmask))
            for s, a, n in batch[B:]:
                outs.append(self._attend(q_all[o : o + n], s.k[i, : a + n], s.v[i, : a + n]))
                o += n
            x = x + torch.cat(outs) @ lw["o"]
            gt, up = (_rms(x) @ lw["gu"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gt) * up) @ lw["d"]
        if self.head is not None:  # logits of each sequence's last token of the step
            last = torch.tensor([o - 1 for o in torch.cumsum(torch.tensor([n for *_, n in batch]), 0).tolist()])
            _rms(x[last.to(dev)]) @ self.head

    def _wait_layer(self, batch: list[tuple[_Seq, int, int]], i: int) -> None:
        for s, _, _ in batch:
            if s.handle is not None and not s.failed:
                try:
                    s.handle.wait_layer(i)
                except TierError as e:
                    log.info("restore of request %d failed, recomputing: %s", s.req.id, e)
                    s.failed = True

    def _decode_mask(self, decodes: list[tuple[_Seq, int, int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(slots of the decodes, additive mask [slots, 1, 1, S] over every slot's first S positions, S): a decode
        sees its own positions; a slot without a decode sees position 0 only (its output is dropped)."""
        S = max(a + 1 for _, a, _ in decodes)
        lens = torch.ones(self.cfg.max_seqs, dtype=torch.long)
        for s, a, _ in decodes:
            lens[s.slot] = a + 1
        ar = torch.arange(S)
        mask = torch.zeros(self.cfg.max_seqs, 1, 1, S).masked_fill(ar[None, None, None, :] >= lens[:, None, None, None],
                                                                   float("-inf"))  # fmt: skip
        slots = torch.tensor([s.slot for s, _, _ in decodes], device=self.dev)
        return slots, mask.to(self.dev, self.dt), S

    def _decode_attend(self, i: int, q: torch.Tensor, decodes, dmask) -> torch.Tensor:
        """Every decode of the step in one attention call over the pool's slots, read in place (no gather): the
        rep query heads of a KV head as rep query rows (exact GQA). Returns [decodes, nh*d]."""
        slots, mask, S = dmask
        n_slots, nh, hd, nkv = self.cfg.max_seqs, self.nh, self.D, self.H
        rep = nh // nkv
        qf = torch.zeros(n_slots, nh, hd, dtype=q.dtype, device=q.device).index_copy_(0, slots, q)
        kk = self.kview[i, 0, :, :S].transpose(1, 2)  # [slots, nkv, S, d], a view
        vv = self.kview[i, 1, :, :S].transpose(1, 2)
        if kk.dtype != q.dtype:
            kk, vv = kk.to(q.dtype), vv.to(q.dtype)
        a = torch.nn.functional.scaled_dot_product_attention(
            qf.view(n_slots, nkv, rep, hd), kk, vv, attn_mask=mask.expand(n_slots, nkv, rep, S)
        )
        return a.reshape(n_slots, nh * hd).index_select(0, slots)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a prefill chunk ``q`` [n, nh, d] (the last n positions) over ``k``/``v``
        [S, nkv, d]; returns [n, nh*d]."""
        from torch.nn.attention.bias import causal_lower_right

        n, nh, hd = q.shape
        S, nkv = k.shape[0], k.shape[1]
        rep = nh // nkv
        kt, vt = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)  # [nkv, S, d]

        ke = kt[:, None].expand(nkv, rep, S, hd).reshape(nh, S, hd)
        ve = vt[:, None].expand(nkv, rep, S, hd).reshape(nh, S, hd)
        a = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], ke[None], ve[None], attn_mask=causal_lower_right(n, S)
        )
        return a[0].transpose(0, 1).reshape(n, nh * hd)
