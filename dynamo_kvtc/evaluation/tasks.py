"""Evaluation samples built offline from held-out text (never seen by calibration).

- ``ppl``: a held-out context of N tokens, then the next 128 tokens scored with teacher forcing (NLL, KL and top-1
  agreement against the uncompressed cache).
- ``passkey``: needle-in-a-haystack, the haystack from held-out essays, needle "The secret passkey is NNNNN." at a
  depth, RULER-style answer prefix; greedy answer must contain the number.
- ``copy``: a held-out Wikipedia paragraph placed at a depth inside held-out essays; at the end the model is asked to
  repeat it and the paragraph is scored with teacher forcing: top-1 accuracy of reproducing each token (an exact
  retrieval measure with many scored tokens per sample).
- ``kv``: multi-key key-value retrieval ("lost in the middle" style): a JSON object of UUID pairs, the value of one
  key asked for; the answer must contain the value's first 8 characters.
- ``vt``: RULER variable tracking: one chain of 5 variables (``VAR A = 12345``, ``VAR B = VAR A``, ...) hidden in noise;
  score = fraction of the chain's variables named in the answer.
- ``mkey``: RULER multi-key needle-in-a-haystack: several needles "One of the special magic numbers for KEY is: N."
  with distinct keys spread through held-out essays; the value of one key is asked for (exact match; the other keys
  are distractors).
- ``mvalue``: RULER multi-value needle-in-a-haystack: one key holds several values spread through the haystack; the
  answer must contain all of them (exact match of every value; no partial credit).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..calibration.data import heldout_texts

# needle keys of the RULER-style tasks: common words, one token-ish each, so the task tests retrieval, not spelling
KEYWORDS = (
    "apple banana cherry river mountain forest window garden silver castle dragon pencil rocket violin tiger harbor "
    "lantern meadow planet saddle"
).split()
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass
class Sample:
    task: str
    prompt: torch.Tensor  # token ids of the whole prefill (the last token is fed after compression)
    target: torch.Tensor | None = None  # teacher-forced continuation (ppl, copy)
    answers: list[str] = field(default_factory=list)  # expected strings (generation tasks)
    max_new: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


class Builder:
    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        essays = "\n\n".join(heldout_texts("essays"))
        self.hay = self.ids(essays)
        try:
            self.wiki = heldout_texts("wiki")
        except Exception:  # the Wikipedia sample is optional; fall back to essays
            self.wiki = heldout_texts("essays")
        if getattr(tokenizer, "chat_template", None):
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": "@@@"}], add_generation_prompt=True, tokenize=False
            )
            self.chat_pre, self.chat_post = chat.split("@@@")
        else:  # base models: plain text with the same instructions and answer prefixes
            self.chat_pre, self.chat_post = "", "\n\n"

    def ids(self, text: str) -> torch.Tensor:
        return self.tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]

    def _chat(self, before: str, middle: torch.Tensor, after: str, answer_prefix: str) -> torch.Tensor:
        return torch.cat((self.ids(self.chat_pre + before), middle, self.ids(after + self.chat_post + answer_prefix)))

    def _hay(self, n: int, offset: int) -> torch.Tensor:
        start = offset % max(1, len(self.hay) - n - 1)
        return self.hay[start : start + n]

    # ------------------------------------------------------------------ tasks
    def ppl(self, length: int, index: int, cont: int = 128) -> Sample:
        texts = heldout_texts("essays") + self.wiki
        ids = torch.cat([self.ids(t) for t in texts[index % len(texts) :] + texts[: index % len(texts)]])
        start = (index * 7919) % max(1, len(ids) - length - cont - 1)
        return Sample(
            "ppl", ids[start : start + length], ids[start + length : start + length + cont], meta={"length": length}
        )

    def passkey(self, length: int, depth: float, index: int) -> Sample:
        key = str(self.rng.randint(10000, 99999))
        needle = self.ids(f" The secret passkey is {key}. Remember it. ")
        before = "There is a secret passkey hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
        after = "\n\nWhat is the secret passkey?"
        fixed = len(self._chat(before, needle, after, " The secret passkey is"))
        hay = self._hay(max(0, length - fixed), index * 1009)
        cut = int(depth * len(hay))
        prompt = self._chat(before, torch.cat((hay[:cut], needle, hay[cut:])), after, " The secret passkey is")
        return Sample("passkey", prompt, answers=[key], max_new=8, meta={"length": length, "depth": depth})

    def gen(self, length: int, index: int, new: int = 32) -> Sample:
        """Generation fidelity: held-out essay text of about ``length`` tokens, then a request to summarise it; the
        first ``new`` greedy tokens are compared with vanilla's (agreement length, exact match)."""
        before = "Read the following text.\n\n"
        after = "\n\nSummarize the text above in three sentences."
        fixed = len(self._chat(before, self.ids(""), after, ""))
        hay = self._hay(max(16, length - fixed), index * 3001 + 7)
        return Sample("gen", self._chat(before, hay, after, ""), max_new=new, meta={"length": length})

    def copy(self, length: int, depth: float, index: int, span: int = 96) -> Sample:
        article = self.ids(self.wiki[index % len(self.wiki)])
        start = min(len(article) - span - 1, 20 + (index * 131) % max(1, len(article) // 2))
        passage = article[max(0, start) : max(0, start) + span]
        head = self.tok.decode(passage[:8])
        ask = self.ids(f'\n\nNow repeat, word for word, the passage that begins with "{head}":\n')
        n_hay = max(0, length - len(passage) - len(ask))
        hay = self._hay(n_hay, index * 2003 + 17)
        cut = int(depth * len(hay))
        prompt = torch.cat((hay[:cut], self.ids("\n\n"), passage, self.ids("\n\n"), hay[cut:], ask))
        return Sample("copy", prompt, target=passage, meta={"length": length, "depth": depth})

    def kv(self, length: int, index: int) -> Sample:
        rng = random.Random(1000 + index)

        def u() -> str:
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))

        before = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
        pairs: list[tuple[str, str]] = []
        body = "{}"
        while True:
            cand = pairs + [(u(), u())]
            text = "{" + ", ".join(f'"{a}": "{b}"' for a, b in cand) + "}"
            if len(self.ids(text)) + 120 > length and pairs:
                break
            pairs, body = cand, text
        pos = rng.randrange(len(pairs))
        key, value = pairs[pos]
        after = f'\n\nKey: "{key}"\nThe value associated with the specified key is: '
        prompt = self._chat(before, self.ids(body), after, 'The value associated with the specified key is: "')
        return Sample(
            "kv",
            prompt,
            answers=[value[:8]],
            max_new=24,
            meta={"length": length, "keys": len(pairs), "depth": pos / len(pairs)},
        )

    def _needles(self, length: int, index: int, needles: list[str], before: str, after: str, prefix: str):
        """Prompt of about ``length`` tokens: held-out essays with ``needles`` at evenly spread depths (jittered)."""
        rng = random.Random(3000 + index)
        ids = [self.ids(n) for n in needles]
        fixed = len(self._chat(before, torch.cat(ids), after, prefix))
        hay = self._hay(max(len(needles), length - fixed), index * 4001 + 29)
        n = len(needles)
        cuts = sorted(int(len(hay) * (i + 0.2 + 0.6 * rng.random()) / n) for i in range(n))
        pieces, prev = [], 0
        for cut, nid in zip(cuts, ids):
            pieces += [hay[prev:cut], nid]
            prev = cut
        pieces.append(hay[prev:])
        return self._chat(before, torch.cat(pieces), after, prefix), [c / max(1, len(hay)) for c in cuts]

    def mkey(self, length: int, index: int, keys: int = 4) -> Sample:
        """RULER niah_multikey: ``keys`` needles with distinct keys; the value of one of them is asked for."""
        rng = random.Random(5000 + index)
        names = rng.sample(KEYWORDS, keys)
        values = [str(rng.randint(100000, 999999)) for _ in names]
        target = rng.randrange(keys)
        needles = [f" One of the special magic numbers for {k} is: {v}. " for k, v in zip(names, values)]
        before = "Some special magic numbers are hidden within the following text. Make sure to memorize them.\n\n"
        after = f"\n\nWhat is the special magic number for {names[target]} mentioned in the provided text?"
        prefix = f" The special magic number for {names[target]} mentioned in the provided text is"
        prompt, depths = self._needles(length, index, needles, before, after, prefix)
        meta = {"length": length, "needles": keys, "depth": depths[target], "values": [values[target]]}
        return Sample("mkey", prompt, answers=[values[target]], max_new=10, meta=meta)

    def mvalue(self, length: int, index: int, values: int = 3) -> Sample:
        """RULER niah_multivalue: one key with ``values`` needles; every value must be in the answer."""
        rng = random.Random(6000 + index)
        key = rng.choice(KEYWORDS)
        vals = [str(rng.randint(100000, 999999)) for _ in range(values)]
        needles = [f" One of the special magic numbers for {key} is: {v}. " for v in vals]
        before = "Some special magic numbers are hidden within the following text. Make sure to memorize them.\n\n"
        after = f"\n\nWhat are all the special magic numbers for {key} mentioned in the provided text?"
        prefix = f" The special magic numbers for {key} mentioned in the provided text are"
        prompt, _ = self._needles(length, index, needles, before, after, prefix)
        return Sample(
            "mvalue",
            prompt,
            answers=vals,
            max_new=12 * values,
            meta={"length": length, "needles": values, "values": vals},
        )

    def vt(self, length: int, index: int, hops: int = 4) -> Sample:
        rng = random.Random(2000 + index)
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)]
        value = str(rng.randint(10000, 99999))
        stmts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
        noise = self.ids(NOISE)
        fixed = 200
        reps = max(hops + 2, (length - fixed) // len(noise))
        slots = sorted(rng.sample(range(reps), hops + 1))
        pieces = []
        j = 0
        for r in range(reps):
            pieces.append(noise)
            if j < len(slots) and r == slots[j]:
                pieces.append(self.ids(stmts[j] + " "))
                j += 1
        before = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        after = f"\n\nQuestion: Find all variables that are assigned the value {value} in the text above."
        prefix = (
            f"Answer: According to the chain(s) of variables assignment in the text above, {hops + 1} variables "
            f"are assigned the value {value}, they are: "
        )
        prompt = self._chat(before, torch.cat(pieces), after, prefix)
        return Sample("vt", prompt, answers=names, max_new=30, meta={"length": length})


PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "ppl": [(1024, i) for i in range(2)],
        "passkey": [(n, d) for n in (1024, 2048) for d in (0.2, 0.8)],
        "copy": [(2048, d) for d in (0.25, 0.6)],
        "kv": [1536],
        "vt": [1024],
    },
    # contexts within a 512-token sliding window (Gemma 3's local layers keep only the last 512 positions)
    "short": {
        "ppl": [(480, i) for i in range(4)],
        "passkey": [(500, d) for d in (0.2, 0.5, 0.8)],
        "copy": [(500, d) for d in (0.2, 0.5)],
    },
    # generation fidelity: greedy continuations compared with vanilla's (its own preset: it adds no scored tokens)
    "fidelity": {
        "gen": [(1024, i) for i in range(8)] + [(2048, i) for i in range(4)],
    },
    # RULER-style multi-key / multi-value needles at 4-8K (contexts within SmolLM2's 8K and Gemma 3's 32K)
    "ruler": {
        "mkey": [4096] * 4 + [7500] * 4,
        "mvalue": [4096] * 3 + [7500] * 3,
    },
    # 2-8K contexts: the long-context share of the full preset plus the RULER tasks (SmolLM2 8K, Gemma-3-270M 32K)
    "long": {
        "ppl": [(n, 0) for n in (2048, 4096, 8000)],
        "passkey": [(n, d) for n in (2048, 4096, 7500) for d in (0.1, 0.5, 0.9)],
        "copy": [(2048, 0.3), (4096, 0.5)],
        "mkey": [4096, 4096, 7500, 7500],
        "mvalue": [4096, 7500],
    },
    # more long passkey haystacks than "full"/"long" (which vary the key with --seed but keep their texts): 16 at
    # 7.5K tokens whose windows start 3027 tokens apart in the held-out essays (the third element is the haystack
    # index, offset 1009 tokens each), the needle at five depths in turn
    "haystacks": {
        "passkey": [(7500, (0.1, 0.3, 0.5, 0.7, 0.9)[j % 5], 3 * j + 30) for j in range(16)],
    },
    "full": {
        "ppl": [(n, 0) for n in (1024, 2048, 4096, 8000)],
        "passkey": [(n, d) for n in (1024, 2048, 4096, 7500) for d in (0.1, 0.5, 0.9)],
        "copy": [(2048, 0.3), (4096, 0.5)],
        "kv": [6000, 3000],
        "vt": [2048, 4096],
    },
}


def answer_score(task: str, answers: list[str], text: str) -> float:
    """Exact-match score of a generated answer (what the harness computes): ``vt`` the share of ``answers`` found in
    ``text``; every other task 1.0 only when all of them are there (``mvalue``: every value of the key)."""
    hits = [a in text for a in answers]
    return sum(hits) / len(hits) if task == "vt" else float(all(hits))


TASKS = ("ppl", "passkey", "copy", "kv", "vt", "gen", "mkey", "mvalue")


def build(
    tokenizer: Any,
    preset: str,
    tasks: tuple[str, ...] | None = None,
    seed: int = 0,
    lengths: tuple[int, ...] | None = None,
) -> Iterator[Sample]:
    """The preset's samples (only ``tasks``, and only contexts of ``lengths`` tokens if given): a filtered run gets
    the very samples of the whole preset, so its rows compare with the whole run's per sample."""
    for s in _build(tokenizer, preset, tasks, seed):
        if lengths is None or s.meta.get("length") in lengths:
            yield s


def _build(tokenizer: Any, preset: str, tasks: tuple[str, ...] | None, seed: int) -> Iterator[Sample]:
    b = Builder(tokenizer, seed)
    spec = PRESETS[preset]
    want = tasks or tuple(spec)
    for task in want:
        for i, args in enumerate(spec.get(task, [])):
            if task == "ppl":
                yield b.ppl(args[0], i)
            elif task == "passkey":
                yield b.passkey(args[0], args[1], args[2] if len(args) > 2 else i)
            elif task == "copy":
                yield b.copy(args[0], args[1], i)
            elif task == "kv":
                yield b.kv(args, i)
            elif task == "vt":
                yield b.vt(args, i)
            elif task == "gen":
                yield b.gen(args[0], i)
            elif task == "mkey":
                yield b.mkey(args, i)
            elif task == "mvalue":
                yield b.mvalue(args, i)
