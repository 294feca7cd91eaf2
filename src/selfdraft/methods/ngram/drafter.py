"""`ngram`: prompt lookup decoding (training-free). Match the last n tokens earlier in
prompt + output (longest n first, most recent occurrence) and propose what followed."""

from __future__ import annotations

import torch

from selfdraft.config import ConfigError
from selfdraft.drafters.base import Drafter, Proposal


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, target=None, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        if gamma == 0:
            return Proposal.empty()
        seq = torch.tensor(tokens, dtype=torch.long)  # [L]
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # [L-n, n]; excludes the suffix matching itself
            hits = (windows == seq[-n:]).all(-1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # continuation after the most recent match
                cont = seq[start : start + gamma]
                if cont.numel():
                    return Proposal(tokens=cont)
        return Proposal.empty()
