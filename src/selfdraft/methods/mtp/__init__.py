"""MTP: DeepSeek-V3 multi-token prediction modules, chained (docs/methods/mtp.md)."""

from selfdraft.methods import Method
from selfdraft.methods.mtp.config import MTPConfig

METHOD = Method(name="mtp", config=MTPConfig, model=".model:build_mtp", drafter=".drafter:MTPDrafter",
                strategy=".train:MTP", export=".export:SPECULATORS")
