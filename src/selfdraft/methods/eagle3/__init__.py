"""EAGLE-3: a one-layer autoregressive head on fused target features, chain or dynamic tree (docs/methods/eagle3.md)."""

from selfdraft.methods import Method
from selfdraft.methods.eagle3.config import Eagle3Config

METHOD = Method(name="eagle3", config=Eagle3Config, model=".model:build_eagle3", drafter=".drafter:Eagle3Drafter",
                strategy=".train:EAGLE3", export=".export:SPECULATORS")
