"""The real-engine tests' one rule for comparing a greedy reply with its recompute's: token for token, up to a near
tie of the recompute itself. Engine scripts record each reply's token ids and top logprobs per step (:func:`top_of`);
the tests compare them (:func:`assert_same_up_to_a_near_tie`).

Where a reply on restored (or refused and recomputed) KV may leave its recompute's: at a step whose two best tokens
are this close (nats), in both runs. The restore computes the prompt's last chunk beside restored history, the
recompute the whole prompt at once; the two shapes round differently (which way depends on the CPU: vLLM's CPU
backend picks other kernels with AVX-512/AMX than on AVX2-only CPUs), so the two runs' logits differ a little, and
greedy decoding can take the other of two near-equal tokens and continue differently from there. The logits are
bf16: at SmolLM2's top logits (16..32) one bf16 step is 0.125, and the logprobs come in multiples of it. A rounding
difference moves a logit by a step or two; NEAR_TIE is four steps. Measured (AVX2, tests/test_tenant_keys.py): both
runs' logprobs equal at every step, and a salted reply's 5th step an exact tie (" listen" and another token at the
same logprob, 0 apart; four other steps 0.125 to 0.375 apart), likely where an AMX CPU's restored reply left the
recompute's (it ended one token short of the same words). Foreign KV fails the bit-exact check first and moves
logprobs by whole nats.
"""

from __future__ import annotations

from typing import Any

NEAR_TIE = 0.5
TOP = 5  # logprobs kept per step (SamplingParams(logprobs=TOP)): enough to find where two replies part and by how much


def top_of(completion: Any) -> list[dict[int, float]]:
    """Each generated step's top logprobs (and the chosen token's), token id -> logprob, of a vLLM
    ``CompletionOutput`` sampled with ``logprobs=TOP``."""
    return [{int(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs or []]


def greedy(max_tokens: int, *, recompute: bool = False, **kw: Any) -> Any:
    """vLLM ``SamplingParams`` of a greedy reply whose steps' top logprobs are kept (``logprobs=TOP``, read back with
    :func:`top_of`); ``recompute``: the tiers bypassed (``skip_reading_prefix_cache``: the engine computes the whole
    prompt, the reference a restored reply is compared with)."""
    from vllm import SamplingParams

    skip = recompute or None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP, skip_reading_prefix_cache=skip, **kw)


def leading_same(a: list[int], b: list[int]) -> int:
    """How many leading tokens two replies share."""
    first = first_difference(a, b)
    return len(a) if first is None else first


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first step where two replies part (the shorter one's length if one is the other's start), or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def assert_same_up_to_a_near_tie(got: list[int], ref: list[int], got_top: list, ref_top: list, why: Any = None) -> None:
    """``got`` (with its steps' top logprobs) is ``ref`` token for token, up to a near tie: where the two part, both
    runs ranked the two tokens within NEAR_TIE of each other, and until then both runs' logprobs of the chosen tokens
    agree within NEAR_TIE. Logprob maps may come back from JSON (string token ids)."""
    mine = [{int(t): lp for t, lp in step.items()} for step in got_top]
    theirs = [{int(t): lp for t, lp in step.items()} for step in ref_top]
    assert len(mine) == len(got) and len(theirs) == len(ref), ("logprobs not recorded for every step", why)
    i = first_difference(got, ref)
    for j in range(len(got) if i is None else i):
        assert abs(mine[j][got[j]] - theirs[j][ref[j]]) < NEAR_TIE, (j, mine[j], theirs[j], why)
    if i is None:
        return
    assert i < len(got) and i < len(ref), ("one reply stopped early", got, ref, why)
    a, b = got[i], ref[i]
    assert b in mine[i] and a in theirs[i], ("not a near tie", i, mine[i], theirs[i], why)
    assert mine[i][a] - mine[i][b] < NEAR_TIE and theirs[i][b] - theirs[i][a] < NEAR_TIE, (
        "not a near tie", i, mine[i], theirs[i], why
    )  # fmt: skip


def assert_reply_is_its_recompute_up_to_a_near_tie(r: dict) -> None:
    """The reply (``reply_ids``, ``reply_top``, text ``reply``) is its recompute's (``reference_*``) token for token,
    up to a near tie (:func:`assert_same_up_to_a_near_tie`); the same tokens are the same text."""
    why = (r["reply"], r["reference_reply"])
    assert_same_up_to_a_near_tie(r["reply_ids"], r["reference_ids"], r["reply_top"], r["reference_top"], why)
    if r["reply_ids"] == r["reference_ids"]:
        assert r["reply"] == r["reference_reply"]
