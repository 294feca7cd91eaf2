"""`none`: no drafts, so the speculative loop reduces to plain autoregressive decoding (the fair baseline)."""

from selfdraft.methods import Method

METHOD = Method(name="none", drafter=".drafter:NoDrafter")
