"""`none`: no drafts, so the speculative loop reduces to plain autoregressive decoding."""

from __future__ import annotations

from selfdraft.drafters.base import Drafter, Proposal


class NoDrafter(Drafter):
    name = "none"

    def __init__(self, target=None) -> None:
        pass

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        return Proposal.empty()
