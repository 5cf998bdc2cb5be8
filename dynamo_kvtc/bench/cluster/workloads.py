"""The workloads of ``bench cluster``, scaled with the number of workers, as streams of prefix blocks.

Both come from ``bench serve``'s seeded generators (:mod:`dynamo_kvtc.bench.serve.workloads`; no network):

- ``qa``: LMBenchmark synthetic multi-round QA (``multi-round-qa``): ``users_per_worker`` x N users, 20 rounds,
  a 1,000-token system prompt shared by every user, a 20,000-token history per user, 100-token questions and
  answers; Poisson arrivals at ``qps_per_worker`` x N; round r of a user carries rounds 0..r-1. The generator asks
  users in the same order every round; here each round's order is a seeded shuffle (users of LMBenchmark run on
  their own timers), else a round-robin router would send every user to the same worker by arithmetic.
- ``mooncake``: sessions shaped after the Mooncake FAST'25 conversation trace (``conversation``): timestamps from
  Poisson session starts and exponential think times, a long first input (lognormal, median 8,500 tokens), each
  later turn appending the reply (median 220) and a new input (median 1,500) to the whole earlier conversation, so
  its leading block hashes repeat the previous turn's (mean input ~12K tokens, mean output ~330, ~40% of input
  tokens reusable, as the published trace); ``sessions_per_worker`` x N sessions at ``qps_per_worker`` x N.

A request becomes a list of *streams* (a cacheable prefix and its length): the leading segments that several
sessions share (the system prompt) are one stream, the rest of the prompt is the session's stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ..serve import workloads as serve_workloads

__all__ = ["MOONCAKE", "QA", "WORKLOADS", "SimRequest", "build"]

QA = {"users_per_worker": 15, "rounds": 20, "system": 1000, "history": 20000, "question": 100, "answer": 100,
      "qps_per_worker": 0.5}  # fmt: skip
MOONCAKE = {"sessions_per_worker": 40, "qps_per_worker": 0.5}
WORKLOADS = {"qa": QA, "mooncake": MOONCAKE}


@dataclass(slots=True)
class SimRequest:
    """One request: when, whose, its prompt as (stream key, tokens) in prefix order, its reply's length, and the
    index of the request whose reply its prompt carries (-1: none)."""

    arrival_s: float
    session: str
    streams: list[tuple[object, int]]
    prompt_tokens: int
    output_tokens: int
    after: int


def _generate(name: str, workers: int, seed: int, params: dict[str, Any]) -> serve_workloads.Workload:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    p = {**WORKLOADS[name], **params}
    unknown = sorted(set(p) - set(WORKLOADS[name]))
    if unknown:
        raise ConfigError(f"workload {name} has no parameter {', '.join(unknown)}")
    qps = float(p["qps_per_worker"]) * workers
    if name == "qa":
        users = max(1, round(float(p["users_per_worker"]) * workers))
        kw = {k: int(p[k]) for k in ("rounds", "system", "history", "question", "answer")}
        return serve_workloads.generate("multi-round-qa", seed, users=users, qps=qps, **kw)
    sessions = max(1, round(float(p["sessions_per_worker"]) * workers))
    return serve_workloads.generate("conversation", seed, sessions=sessions, qps=qps)


def _stats(reqs: list[SimRequest]) -> dict[str, Any]:
    """Counts and means (cheap at 150,000 requests, unlike the serve workload's reuse statistics)."""
    if not reqs:
        return {"requests": 0}
    n = len(reqs)
    return {
        "requests": n,
        "sessions": len({r.session for r in reqs}),
        "mean_input_tokens": round(sum(r.prompt_tokens for r in reqs) / n, 1),
        "max_input_tokens": max(r.prompt_tokens for r in reqs),
        "mean_output_tokens": round(sum(r.output_tokens for r in reqs) / n, 1),
        "duration_s": round(reqs[-1].arrival_s - reqs[0].arrival_s, 3),
    }


def _shuffle_rounds(reqs: list[serve_workloads.Request], seed: int) -> None:
    """Relabel the users of each round by a seeded permutation (every user's round-r prompt has the same shape, so
    only the session names move), then re-link each turn to its session's previous one."""
    users = len({r.session for r in reqs})
    rng = random.Random(f"bench-cluster/qa/{seed}")
    names: dict[str, str] = {}
    for i, r in enumerate(reqs):
        if i % users == 0:
            order = [f"u{k}" for k in range(users)]
            rng.shuffle(order)
            names = {f"u{k}": order[k] for k in range(users)}
        new = names[r.session]
        old = r.session + "/"
        r.segments = [(new + s[len(old) - 1 :] if s.startswith(old) else s, n) for s, n in r.segments]
        r.output = (new + r.output[0][len(old) - 1 :], r.output[1])
        r.session = new
    last: dict[str, int] = {}
    for r in reqs:
        r.after = last.get(r.session, -1)
        last[r.session] = r.id


def build(name: str, workers: int, seed: int = 0, **params: Any) -> tuple[list[SimRequest], dict[str, Any]]:
    """The requests of workload ``name`` for ``workers`` workers (arrival order) and its description."""
    w = _generate(name, workers, seed, params)
    owners: dict[str, set[str]] = {}
    for r in w.requests:
        for s, _ in r.segments:
            owners.setdefault(s, set()).add(r.session)
    if name == "qa":
        _shuffle_rounds(w.requests, seed)
    index = {r.id: i for i, r in enumerate(w.requests)}
    out: list[SimRequest] = []
    for r in w.requests:
        shared: list[str] = []
        for s, _ in r.segments:
            if len(owners[s]) < 2:
                break
            shared.append(s)
        k = len(shared)
        streams: list[tuple[object, int]] = []
        if k:
            streams.append((("shared", *shared), sum(n for _, n in r.segments[:k])))
        streams.append((r.session, sum(n for _, n in r.segments[k:])))
        out.append(SimRequest(r.arrival_s, r.session, streams, r.prompt_tokens, r.output_tokens,
                              index.get(r.after, -1)))  # fmt: skip
    desc = {"name": name, "generator": w.name, "seed": seed, "params": {**WORKLOADS[name], **params},
            "generator_params": w.params, "stats": _stats(out)}  # fmt: skip
    return out, desc
