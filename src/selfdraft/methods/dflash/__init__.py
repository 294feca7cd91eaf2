"""DFlash: a block-parallel drafter on the target's fused hidden states (docs/methods/dflash.md)."""

from selfdraft.methods import Method
from selfdraft.methods.dflash.config import DFlashConfig

METHOD = Method(name="dflash", config=DFlashConfig, model=".model:build_dflash", drafter=".drafter:DFlashDrafter",
                strategy=".train:DFLASH", export=".export:SPECULATORS")
