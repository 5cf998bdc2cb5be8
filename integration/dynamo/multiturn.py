#!/usr/bin/env python3
"""Three-turn OpenAI chat conversation against a Dynamo frontend, with greedy decoding.

Standard library only (urllib).  Every turn resends the whole history (a fixed document of a few hundred tokens in
the system message, then the previous questions and replies), so turn n's prompt extends turn n-1's prompt: the
shape a prefix/KV-cache tier is meant to speed up.

    python integration/dynamo/multiturn.py --url http://127.0.0.1:18080 --save /tmp/a.json
    python integration/dynamo/multiturn.py --url ... --passes 2 --save /tmp/b.json --compare /tmp/a.json

Exit status: 0 on success; 1 on an HTTP error, an empty reply, or (with --compare) any reply that differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

# Fixed text, so that every run sends the same tokens.  ~330 tokens with the SmolLM2 tokenizer.
DOCUMENT = """\
Field notes on the Harbor Street community garden, written for new volunteers.

The garden sits on a narrow lot between the old ferry office and the bakery on Harbor Street. It has twelve raised
beds, a tool shed painted green, two rain barrels under the shed gutter, and a compost corner behind the fence. Beds
one to four grow tomatoes, peppers and basil. Beds five to eight grow beans, peas and squash. Beds nine and ten are for
herbs: thyme, oregano, mint in pots so that it does not spread, and a row of chives. Beds eleven and twelve are the
children's beds, where the school on Pier Road plants sunflowers and radishes every April.

Watering happens in the early morning, before eight o'clock, because the afternoon sun dries the soil quickly and
water on the leaves at noon can scorch them. Use the rain barrels first; the street tap is only for dry weeks. The
watering log hangs inside the shed door: write the date, the beds you watered and your initials.

The compost rules are simple. Green material (vegetable peelings, coffee grounds, grass clippings) and brown material
(dry leaves, shredded cardboard, straw) go in roughly equal parts. No meat, no dairy, no oil, and no weeds that have
gone to seed. Turn the pile with the fork on Saturdays. The finished compost in the left bin is ready to use; the
right bin is still working.

Tools go back on the wall hooks, cleaned, before you leave. The shed key is in the lock box; the code is the year the
garden opened, 1987. The volunteer coordinator is Mira Okafor, who runs the Saturday work mornings from nine to noon
and keeps the seed library in a tin box on the top shelf. Harvest days are Wednesdays and Saturdays; produce that the
volunteers do not take home goes to the food pantry at St. Anne's on Thursday mornings."""

QUESTIONS = [
    "Which beds grow the herbs, and why is the mint kept in pots?",
    "When should I water, and what should I write in the watering log?",
    "Who runs the Saturday work mornings, and where does the extra produce go?",
]

SYSTEM = "You are a helpful assistant for garden volunteers. Answer briefly, using only the notes below.\n\n" + DOCUMENT


def chat(url: str, model: str, messages: list[dict], max_tokens: int, timeout: float) -> tuple[str, dict, float]:
    body = {
        "model": model,
        "messages": messages,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "max_tokens": max_tokens,
        "stream": False,
    }
    req = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out = json.load(resp)
    dt = time.perf_counter() - t0
    return out["choices"][0]["message"].get("content") or "", out.get("usage") or {}, dt


def first_model(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout) as resp:
        data = json.load(resp)["data"]
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return data[0]["id"]


def run_conversation(
    url: str, model: str, max_tokens: int = 24, timeout: float = 300.0, quiet: bool = False
) -> list[dict]:
    """One 3-turn conversation; returns one record per turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for i, question in enumerate(QUESTIONS, 1):
        messages.append({"role": "user", "content": question})
        reply, usage, dt = chat(url, model, messages, max_tokens, timeout)
        messages.append({"role": "assistant", "content": reply})
        rec = {
            "turn": i,
            "reply": reply,
            "latency_s": round(dt, 3),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        }
        turns.append(rec)
        if not quiet:
            print(
                f"turn {i}: {dt:6.2f} s  prompt={rec['prompt_tokens']} completion={rec['completion_tokens']} "
                f"cached={rec['cached_tokens']}  reply={reply!r}",
                flush=True,
            )
    return turns


def run(
    url: str,
    model: str | None = None,
    passes: int = 1,
    max_tokens: int = 24,
    timeout: float = 300.0,
    quiet: bool = False,
) -> dict:
    """`passes` repetitions of the same conversation (a repeat can hit a KV connector's store)."""
    model = model or first_model(url, timeout)
    result = {"url": url, "model": model, "max_tokens": max_tokens, "passes": []}
    for p in range(passes):
        if not quiet and passes > 1:
            print(f"-- pass {p + 1}/{passes}", flush=True)
        result["passes"].append(run_conversation(url, model, max_tokens, timeout, quiet))
    return result


def replies(result: dict) -> list[list[str]]:
    return [[t["reply"] for t in turns] for turns in result["passes"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:18080", help="frontend base URL")
    ap.add_argument("--model", default=None, help="model name (default: first one in /v1/models)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--passes", type=int, default=1, help="repeat the whole conversation this many times")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    ap.add_argument("--save", default=None, help="write the replies and timings to this JSON file")
    ap.add_argument("--compare", default=None, help="JSON file of an earlier run: every reply must match its pass 1")
    args = ap.parse_args(argv)

    try:
        result = run(args.url, args.model, args.passes, args.max_tokens, args.timeout)
    except urllib.error.HTTPError as e:
        print(f"HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}", file=sys.stderr)
        return 1
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    ok = True
    got = replies(result)
    if any(not r.strip() for rs in got for r in rs):
        print("FAIL: empty reply", file=sys.stderr)
        ok = False
    for p, rs in enumerate(got[1:], 2):
        if rs != got[0]:
            print(f"DIFF: pass {p} differs from pass 1", file=sys.stderr)
            ok = False
    if args.compare:
        with open(args.compare) as f:
            ref = replies(json.load(f))[0]
        for p, rs in enumerate(got, 1):
            for i, (a, b) in enumerate(zip(ref, rs), 1):
                if a != b:
                    print(f"DIFF: pass {p} turn {i}: {b!r} != reference {a!r}", file=sys.stderr)
                    ok = False
        if ok:
            print(f"all replies match {args.compare}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
