"""DSpark: DFlash + Markov head + confidence head (docs/methods/dspark.md). It extends DFlash: its
module subclasses DFlash's, DFlash's drafter serves it, and its strategy and export map extend DFlash's."""

from selfdraft.methods import Method
from selfdraft.methods.dspark.config import DSparkConfig

# DFlash's drafter serves DSpark: its model's decode_blocks adds the heads
METHOD = Method(name="dspark", config=DSparkConfig, model=".model:build_dspark",
                drafter="selfdraft.methods.dflash.drafter:DFlashDrafter", strategy=".train:DSPARK", export=".export:SPECULATORS")
