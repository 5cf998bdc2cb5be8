"""What every method provides: a reconstruction of KV [L, T, H, D] and honest byte accounting."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reconstruction:
    keys: torch.Tensor
    values: torch.Tensor
    raw16_compressed: int  # 16-bit bytes of the tokens the method compressed (sinks included for kvtc)
    stored_compressed: int  # bytes the method stores for those tokens
    raw16_total: int  # 16-bit bytes of every token
    stored_total: int  # bytes stored for every token (the uncompressed window at 16 bits)

    @property
    def ratio(self) -> float | None:
        """The paper's accounting: compressed tokens only, window excluded."""
        return self.raw16_compressed / self.stored_compressed if self.stored_compressed else None

    @property
    def ratio_with_window(self) -> float:
        return self.raw16_total / self.stored_total


class Method:
    """Reconstruct all tokens but the last ``window`` (kept exact, as every method here does)."""

    name = "method"
    family = "baseline"
    lossless = False  # a lossless method scores exactly like vanilla: the harness reuses vanilla's scores

    def __init__(self, window: int = 128) -> None:
        self.window = window

    def reconstruct(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> Reconstruction:
        T = keys.shape[1]
        w = min(self.window, T)
        c = T - w
        per_tok16 = 2 * keys.shape[0] * keys.shape[2] * keys.shape[3] * 2
        if c == 0:
            return Reconstruction(keys, values, 0, 0, per_tok16 * T, per_tok16 * T)
        k2, v2, stored = self.compress(keys[:, :c], values[:, :c])
        k_out = torch.cat((k2.to(keys.dtype), keys[:, c:]), dim=1)
        v_out = torch.cat((v2.to(values.dtype), values[:, c:]), dim=1)
        return Reconstruction(k_out, v_out, per_tok16 * c, stored, per_tok16 * T, stored + per_tok16 * w)

    def compress(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Reconstruct the compressed part; return (keys, values, stored bytes)."""
        raise NotImplementedError
