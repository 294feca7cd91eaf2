"""DFlash: a block-parallel drafter on the target's fused hidden states (docs/methods/dflash.md)."""

from selfdraft.methods import Method
from selfdraft.methods.dflash.config import DFlashConfig

METHOD = Method(
    name="dflash",
    config=DFlashConfig,
    model="selfdraft.methods.dflash.model:build_dflash",
    drafter="selfdraft.methods.dflash.drafter:DFlashDrafter",
    strategy="selfdraft.methods.dflash.train:DFLASH",
    export="selfdraft.methods.dflash.export:SPECULATORS",
)
