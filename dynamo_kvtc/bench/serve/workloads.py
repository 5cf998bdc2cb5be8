"""Workloads of ``bench serve``: request traces generated offline from a seed and saved as JSONL.

A request's prompt is a list of *segments* (``[id, tokens]``); two prompts that start with the same segments share
that prefix token for token (a segment's token ids are a function of the seed and its id only, :func:`segment_ids`).
A request's reply is a segment too, so a later turn of the same session can carry it in its history; ``after`` names
the request whose reply the prompt contains (the engine does not start a turn before that one finished).

Four generators (statistics and where they come from: docs/serving.md):

- ``multi-round-qa``: LMCache LMBenchmark ``synthetic-multi-round-qa`` (U users x R rounds, a shared system prompt,
  a per-user history, short answers, Poisson arrivals at a QPS; round r of a user follows its round r-1).
- ``lmbench``: the same benchmark's own schedule at its published parameters (``long_input_short_output_run.sh``:
  15 users x 20 rounds, 1,000-token shared system prompt, 20,000-token histories, 100-token answers, 100 s per QPS
  point): each user asks every ``users / qps`` seconds, users join staggered so that ``users`` are active, and the
  run starts in steady state (users already mid-conversation, each starting with a cold prompt), as
  ``multi-round-qa.py``'s ``UserSessionManager`` does.
- ``conversation``: sessions shaped after the Mooncake (FAST'25) conversation trace (long inputs, a reply and the
  whole earlier conversation reused by the next turn, Poisson session starts, think time between turns).
- ``long-doc-qa``: LMCache ``long-doc-qa`` (D documents, a warm-up pass, then query rounds over the documents in
  random or interleaved order).

Every generator takes ``duration_s``: only the requests that arrive before it are kept (a shorter trace for a
device-time budget; ``lmbench`` defaults to its published 100 s).

Same parameters and seed -> the same file, byte for byte (sorted keys, fixed float rounding).
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LMBENCH",
    "PRESET_QPS",
    "WORKLOADS",
    "Request",
    "Workload",
    "describe",
    "generate",
    "load",
    "save",
    "segment_ids",
    "truncate",
    "working_set_blocks",
]

VOCAB = (1000, 30000)  # token ids are drawn from this range (above special tokens of real tokenizers)


@dataclass
class Request:
    """One request of a trace: when it arrives, whose it is, its prompt as segments, its reply."""

    id: int
    arrival_s: float
    session: str
    segments: list[tuple[str, int]]  # the prompt, in order; equal leading segments = a shared prefix
    output: tuple[str, int]  # the reply (a segment later turns may carry in their history)
    after: int = -1  # the request whose reply this prompt contains (-1: none)

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def output_tokens(self) -> int:
        return self.output[1]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "arrival_s": round(self.arrival_s, 6),
            "session": self.session,
            "segments": [[s, n] for s, n in self.segments],
            "prompt_tokens": self.prompt_tokens,
            "output": [self.output[0], self.output[1]],
            "after": self.after,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Request:
        return cls(
            int(d["id"]),
            float(d["arrival_s"]),
            str(d["session"]),
            [(str(s), int(n)) for s, n in d["segments"]],
            (str(d["output"][0]), int(d["output"][1])),
            int(d.get("after", -1)),
        )


@dataclass
class Workload:
    """A named trace: its generator's parameters, the seed, and the requests in arrival order."""

    name: str
    seed: int
    params: dict[str, Any]
    requests: list[Request] = field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        """Mean input/output tokens, the fraction of prompt tokens that repeat an earlier request's tokens (what a
        cache of unlimited size could serve), the duration of the arrivals."""
        reqs = self.requests
        if not reqs:
            return {"requests": 0}
        seen: set[tuple] = set()
        reused = 0
        for r in reqs:
            path: tuple = ()
            for seg in r.segments:
                path = (*path, seg[0])
                if path in seen:
                    reused += seg[1]
            for k in range(1, len(r.segments) + 1):
                seen.add(tuple(s for s, _ in r.segments[:k]))
            seen.add((*(s for s, _ in r.segments), r.output[0]))
        total = sum(r.prompt_tokens for r in reqs)
        return {
            "requests": len(reqs),
            "sessions": len({r.session for r in reqs}),
            "mean_input_tokens": round(total / len(reqs), 1),
            "max_input_tokens": max(r.prompt_tokens for r in reqs),
            "mean_output_tokens": round(sum(r.output_tokens for r in reqs) / len(reqs), 1),
            "reusable_fraction": round(reused / max(1, total), 4),
            "duration_s": round(reqs[-1].arrival_s - reqs[0].arrival_s, 3),
        }


def segment_ids(seed: int, segment: str, n: int) -> list[int]:
    """The token ids of a segment: a function of (seed, segment id, length) only."""
    r = random.Random(f"{seed}/{segment}")
    lo, hi = VOCAB
    return [r.randrange(lo, hi) for _ in range(n)]


def working_set_blocks(requests: Iterable[Request], block_size: int) -> int:
    """Distinct full KV blocks over every request's prompt + reply: what a tier must hold to serve every reuse."""
    seen: set[tuple[int, int]] = set()
    for r in requests:
        path_hash, pos = 0, 0
        segs = [*r.segments, r.output]
        ends = []  # (end position, path hash including the segment that ends there)
        for s, n in segs:
            path_hash = hash((path_hash, s))
            pos += n
            ends.append((pos, path_hash))
        j = 0
        for end in range(block_size, pos + 1, block_size):
            while ends[j][0] < end:
                j += 1
            seen.add((ends[j][1], end))
    return len(seen)


# ============================================================================================ generators
def _poisson(rng: random.Random, n: int, qps: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(qps)
    return out


def multi_round_qa(
    rng: random.Random,
    *,
    users: int = 15,
    rounds: int = 20,
    system: int = 1000,
    history: int = 20000,
    question: int = 50,
    answer: int = 100,
    qps: float = 0.5,
) -> list[Request]:
    """LMBenchmark synthetic-multi-round-qa: round r of user u is [system, history_u, q0, a0, ..., q_r]."""
    arrivals = _poisson(rng, users * rounds, qps)
    reqs: list[Request] = []
    last: dict[int, int] = {}
    for i, t in enumerate(arrivals):
        r, u = divmod(i, users)
        segs = [("sys", system), (f"u{u}/h", history)] if system else [(f"u{u}/h", history)]
        for k in range(r):
            segs += [(f"u{u}/q{k}", question), (f"u{u}/a{k}", answer)]
        segs.append((f"u{u}/q{r}", question))
        reqs.append(Request(i, t, f"u{u}", segs, (f"u{u}/a{r}", answer), last.get(u, -1)))
        last[u] = i
    return reqs


LMBENCH = {"users": 15, "rounds": 20, "system": 1000, "history": 20000, "question": 20, "answer": 100, "qps": 0.5,
           "duration_s": 100.0}  # fmt: skip
"""LMBenchmark ``long_input_short_output_run.sh``'s parameters (the question is ``multi-round-qa.py``'s ~20-token
"Here's question #k: can you tell me a new long story with a happy ending?")."""


def lmbench(
    rng: random.Random,
    *,
    users: int = LMBENCH["users"],
    rounds: int = LMBENCH["rounds"],
    system: int = LMBENCH["system"],
    history: int = LMBENCH["history"],
    question: int = LMBENCH["question"],
    answer: int = LMBENCH["answer"],
    qps: float = LMBENCH["qps"],
    duration_s: float = LMBENCH["duration_s"],
) -> list[Request]:
    """LMBenchmark ``synthetic-multi-round-qa``'s schedule (``UserSessionManager``; deterministic, the seed only
    changes token ids). A user asks every ``gap = users / qps`` s; a session lives ``gap * (rounds - 1)`` s, and a
    new user joins every ``gap * (rounds - 1) / users`` s from t = 0 (so ``users`` are active and the overall rate is
    ``qps``). At t = 0 the benchmark ramps up: ``users`` sessions that started ``i`` join-gaps ago (i = users..1) are
    mid-conversation, their next question due within one gap; a ramped-up session's first request carries no earlier
    rounds (the benchmark starts its chat history then), so every session's first request is a cold prompt
    [system, history_u, q_k] and each later one adds the reply and the next question. Requests arriving at or after
    ``duration_s`` are dropped (the benchmark's ``--time``)."""
    if users < 1 or rounds < 1 or qps <= 0:
        raise ValueError("lmbench needs users >= 1, rounds >= 1, qps > 0")
    gap = users / qps
    alive = gap * (rounds - 1)
    join = alive / users
    sessions: list[tuple[float, int]] = []  # (first request's time, first question index)
    for i in range(users):  # _ramp_up + set_internal_state: the session that joined `offset` seconds ago
        offset = alive - i * join
        passed = int(offset / gap) + 1
        if passed < rounds:
            sessions.append((passed * gap - offset, passed))
    if join > 0:
        sessions += [(k * join, 0) for k in range(int(duration_s / join) + 1)]
    else:  # one round: every user asks once, at once
        sessions += [(0.0, 0)] * users
    pending: list[tuple[float, int, int, Request]] = []
    for u, (t0, q0) in enumerate(sessions):
        segs: list[tuple[str, int]] = [("sys", system), (f"u{u}/h", history)] if system else [(f"u{u}/h", history)]
        for k in range(q0, rounds):
            t = t0 + (k - q0) * gap
            if t >= duration_s:
                break
            segs.append((f"u{u}/q{k}", question))
            pending.append((t, u, k, Request(0, t, f"u{u}", list(segs), (f"u{u}/a{k}", answer))))
            segs.append((f"u{u}/a{k}", answer))
    pending.sort(key=lambda x: (x[0], x[1], x[2]))
    reqs: list[Request] = []
    last: dict[str, int] = {}
    for i, (*_, r) in enumerate(pending):
        r.id, r.after = i, last.get(r.session, -1)
        last[r.session] = i
        reqs.append(r)
    return reqs


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def conversation(
    rng: random.Random,
    *,
    sessions: int = 40,
    qps: float = 0.5,
    first_median: int = 8500,
    turn_median: int = 1500,
    output_median: int = 220,
    more_turns: float = 0.47,
    max_turns: int = 8,
    think_s: float = 10.0,
    max_input: int = 32000,
) -> list[Request]:
    """Mooncake-conversation-shaped sessions: a long first input, then turns that append the reply and a new input
    to the whole earlier conversation (each later turn reuses everything before it). Session starts are Poisson at
    ``qps / mean turns``; a turn arrives a think time (exponential, mean ``think_s``) after the previous one."""
    mean_turns = min(max_turns, 1 / (1 - more_turns))
    starts = _poisson(rng, sessions, qps / mean_turns)
    pending: list[tuple[float, int, Request]] = []
    for s, t0 in enumerate(starts):
        segs: list[tuple[str, int]] = [(f"c{s}/in0", _lognormal(rng, first_median, 0.8, 64, max_input))]
        t, turn = t0, 0
        while True:
            out = (f"c{s}/out{turn}", _lognormal(rng, output_median, 0.9, 8, 4096))
            pending.append((t, s * 100 + turn, Request(0, t, f"c{s}", list(segs), out)))
            turn += 1
            if turn >= max_turns or rng.random() > more_turns:
                break
            new = (f"c{s}/in{turn}", _lognormal(rng, turn_median, 1.0, 16, 8192))
            if sum(n for _, n in segs) + out[1] + new[1] > max_input:
                break
            segs += [out, new]
            t += rng.expovariate(1 / think_s)
    pending.sort(key=lambda x: (x[0], x[1]))
    reqs: list[Request] = []
    last: dict[str, int] = {}
    for i, (_, _, r) in enumerate(pending):
        r.id, r.after = i, last.get(r.session, -1)
        last[r.session] = i
        reqs.append(r)
    return reqs


def long_doc_qa(
    rng: random.Random,
    *,
    documents: int = 8,
    doc_tokens: int = 20000,
    question: int = 32,
    answer: int = 100,
    repeats: int = 2,
    order: str = "random",
    qps: float = 1.0,
) -> list[Request]:
    """LMCache long-doc-qa: a warm-up pass over the documents, then ``repeats`` query rounds, each over every
    document in ``order`` (``random``: shuffled per round; ``interleave``: documents in turn, 0..D-1)."""
    if order not in ("random", "interleave"):
        raise ValueError(f"order must be random or interleave, got {order!r}")
    seq = list(range(documents))
    for _ in range(repeats):
        rnd = list(range(documents))
        if order == "random":
            rng.shuffle(rnd)
        seq += rnd
    arrivals = _poisson(rng, len(seq), qps)
    return [
        Request(i, t, f"d{d}", [(f"doc{d}", doc_tokens), (f"q{i}", question)], (f"a{i}", answer))
        for i, (t, d) in enumerate(zip(arrivals, seq))
    ]


WORKLOADS = {
    "multi-round-qa": multi_round_qa,
    "lmbench": lmbench,
    "conversation": conversation,
    "long-doc-qa": long_doc_qa,
}
PRESET_QPS = {"lmbench": (0.5, 1.0, 2.0)}
"""The QPS sweep a preset runs when no ``--qps`` (nor a ``qps`` parameter) is given."""


def truncate(requests: list[Request], duration_s: float) -> list[Request]:
    """The requests arriving before ``duration_s`` after the first (ids and ``after`` kept: a turn always arrives
    after the turn it follows, so the kept requests never follow a dropped one)."""
    t0 = min((r.arrival_s for r in requests), default=0.0)
    return [r for r in requests if r.arrival_s - t0 < duration_s]


def generate(name: str, seed: int = 0, **params: Any) -> Workload:
    """The workload ``name`` with ``params`` (the generator's keyword arguments; the rest keep their defaults;
    ``duration_s`` for any of them: only arrivals before it)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(f"{name}/{seed}")
    kw = dict(params)
    duration = kw.pop("duration_s", None) if name != "lmbench" else None
    reqs = WORKLOADS[name](rng, **kw)
    if duration is not None:
        if not duration > 0:
            raise ValueError(f"duration_s must be > 0, got {duration}")
        reqs = truncate(reqs, float(duration))
    return Workload(name, seed, dict(sorted(params.items())), reqs)


def _line(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def save(w: Workload, path: str | os.PathLike) -> None:
    """JSONL: a header line (``{"workload": {...}}``: name, seed, params, stats), then one request per line."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    head = {"workload": {"name": w.name, "seed": w.seed, "params": w.params, "stats": w.stats()}}
    lines = [_line(head), *(_line(r.to_json()) for r in w.requests)]
    p.write_text("\n".join(lines) + "\n")


def load(path: str | os.PathLike) -> Workload:
    lines = Path(path).read_text().splitlines()
    if not lines:
        raise ValueError(f"{path} is empty")
    head = json.loads(lines[0]).get("workload")
    if not isinstance(head, dict):
        raise ValueError(f"{path}: the first line is not a workload header")
    reqs = [Request.from_json(json.loads(x)) for x in lines[1:] if x.strip()]
    return Workload(str(head["name"]), int(head["seed"]), dict(head.get("params", {})), reqs)


def describe(w: Workload) -> dict[str, Any]:
    """Name, seed, parameters and statistics (what a result file records about its workload)."""
    return {"name": w.name, "seed": w.seed, "params": w.params, "stats": w.stats()}
