"""What every drafting method shares: the `Drafter` protocol and `Proposal` (base.py), the draft
layers (layers.py) and the block layout of the parallel drafters (blocks.py). The methods themselves
live in selfdraft/methods/, one package each, registered in selfdraft.methods."""

from selfdraft.drafters.base import Drafter, Proposal

__all__ = ["Drafter", "Proposal"]
