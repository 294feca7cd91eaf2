"""MTP: DeepSeek-V3 multi-token prediction modules, chained (docs/methods/mtp.md)."""

from selfdraft.methods import Method
from selfdraft.methods.mtp.config import MTPConfig

METHOD = Method(
    name="mtp",
    config=MTPConfig,
    model="selfdraft.methods.mtp.model:build_mtp",
    drafter="selfdraft.methods.mtp.drafter:MTPDrafter",
    strategy="selfdraft.methods.mtp.train:MTP",
    export="selfdraft.methods.mtp.export:SPECULATORS",
)
