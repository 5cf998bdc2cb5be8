"""What the scheduler half tells the worker half each step (plain dataclasses; vLLM ships them to the workers).

- :class:`LoadOp`: restore these sequence hashes into these engine blocks, layer by layer inside this step's forward
  pass (``asynchronous=False``), or in the background before the request is scheduled (``True``, disk hits).
- :class:`SaveOp`: these engine blocks just became full and computed: copy them out and encode them. ``final`` marks a
  finished request's last save; the worker then reports it done so vLLM frees its blocks.
- :class:`StepPlan`: one step's loads and saves, plus how many prompt tokens were looked up and found (metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadOp:
    req_id: str
    hashes: list[int]
    block_ids: list[int]
    asynchronous: bool = False
    remote: tuple[str, int] | None = None  # (host, port) of a prefill worker serving these blocks


@dataclass
class SaveOp:
    req_id: str
    hashes: list[int]  # sequence hashes of the blocks saved
    parent: int | None  # sequence hash of the block before them
    first_block: int  # index of the first saved block in the sequence (positions = first_block * block_size ...)
    token_ids: list[int]
    block_ids: list[int]
    tail: bool = False  # keep the raw window (the sequence's most recent tokens)
    final: bool = False


@dataclass
class StepPlan:
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # finished requests to report done with no save left
    lookup_tokens: int = 0
    hit_tokens: int = 0
    bypassed: int = 0  # requests that could not be keyed safely (never looked up or saved)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.releases or self.lookup_tokens or self.bypassed)
