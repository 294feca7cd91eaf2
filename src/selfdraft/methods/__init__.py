"""The one registry of drafting methods (docs/architecture.md#how-to-add-a-method).

`METHODS` has one line per method: its name and the package that describes it. A method package
defines `METHOD = Method(...)` in its `__init__.py`, importing nothing heavier than its config; the
rest of the method is named as "module:attribute" and imported on first use. So listing the methods
and their configs (the CLI's options) stays cheap, and inference never imports the training part
(`Method.strategy`, which only `selfdraft.training` resolves).

A fifth method is one new package (config.py, model.py, drafter.py, train.py, export.py as needed)
plus one line here; a method outside this repository registers itself with `register`.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from selfdraft.config import ConfigError, DrafterConfig, from_dict

if TYPE_CHECKING:
    import torch

    from selfdraft.drafters.base import Drafter
    from selfdraft.target import Target

METHODS: dict[str, str] = {
    "none": "selfdraft.methods.none",
    "ngram": "selfdraft.methods.ngram",
    "suffix": "selfdraft.methods.suffix",
    "mtp": "selfdraft.methods.mtp",
    "eagle3": "selfdraft.methods.eagle3",
    "dflash": "selfdraft.methods.dflash",
    "dspark": "selfdraft.methods.dspark",
}


def resolve(where: str, package: str = "") -> Any:
    """A part named as "package.module:attribute" -> the attribute (its module imported on first use);
    ".module:attribute" is relative to `package` (the method's own package)."""
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module, package or None), attr)


@dataclass(frozen=True)
class Method:
    """One drafting method. Parts other than the config are "module:attribute" strings, imported on use
    (".module:attribute": a module of the method's own package).

    Training-free methods (no `config`): `drafter` is a factory (target, **options) -> Drafter.
    Trained methods: `drafter` wraps a module, (model, cfg, target) -> Drafter; `model` builds a fresh
    module, (cfg, target) -> nn.Module; `strategy` is the training `Strategy` (only selfdraft.training
    imports it); `export` is the speculators `MethodMap` (below; "" = no speculators format).
    """

    name: str  # the registry name: --drafter / --method, config.json "method"
    drafter: str
    config: type[DrafterConfig] | None = None
    model: str = ""
    strategy: str = ""
    export: str = ""
    package: str = ""  # where METHOD was found (set by `get`): the anchor of relative parts

    def part(self, where: str) -> Any:
        return resolve(where, self.package)

    @property
    def trained(self) -> bool:
        return self.config is not None

    def new(self, target: "Target | None" = None, **options) -> "Drafter":
        """A training-free drafter."""
        if self.trained:
            raise ConfigError(f"{self.name} drafters load from a checkpoint directory (train one with `selfdraft train`)")
        return self.part(self.drafter)(target, **options)

    def build(self, cfg: DrafterConfig, target: "Target") -> "torch.nn.Module":
        """A fresh module for `target`; empty feature layers become the method's default (so checkpoints record them)."""
        if not isinstance(cfg, self.config or ()):
            raise ConfigError(f"{self.name} drafters are built from a {getattr(self.config, '__name__', None)}, "
                              f"got a {type(cfg).__name__} (selfdraft.methods.drafter_config builds one from a dict)")
        if not cfg.feature_layers:
            cfg.feature_layers = tuple(cfg.default_feature_layers(target))
        return self.part(self.model)(cfg, target)

    def wrap(self, model: "torch.nn.Module", cfg: DrafterConfig, target: "Target") -> "Drafter":
        """A trained module -> its inference drafter."""
        return self.part(self.drafter)(model, cfg, target)

    def speculators(self) -> "MethodMap | None":
        """How the method looks in the speculators format vLLM loads (export.py), or None."""
        return self.part(self.export) if self.export else None


@dataclass(frozen=True)
class MethodMap:
    """How one of our methods looks in the speculators format (each method's export.py defines one;
    selfdraft.export reads it through `Method.speculators`)."""

    method: str  # ours == speculators_model_type
    architecture: str  # speculators' "architectures" entry
    rules: tuple[tuple[str, str], ...]  # (regex on our state-dict key, replacement): the first match renames it
    layer_model_type: Callable[[DrafterConfig], str]  # transformer_layer_config.model_type
    fields: Callable[[DrafterConfig, "Target"], dict]  # method-specific config.json fields
    from_fields: Callable[[dict, "Target"], dict]  # speculators config -> config overrides
    layers: Callable[[DrafterConfig, "Target"], int]  # transformer_layer_config.num_hidden_layers
    fixes: Callable[[DrafterConfig, "Target"], dict]  # what keeps a drafter from vLLM's module (`compatibility`)
    config_only: tuple[str, ...] = ()  # our state keys stored in config.json instead (not vLLM weights)
    # DFlash / DSpark: mask slots are the verifier's embedding rows, and a draft vocabulary is shipped as
    # the verifier's LM-head rows with d2t / t2d (our drafter drafts through the target's own head)
    target_rows: bool = False


_loaded: dict[str, Method] = {}


def get(name: str) -> Method:
    """The registered method `name` (its package imported on first use)."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known methods: {sorted(METHODS)}")
    where = METHODS[name]
    if where not in _loaded:
        method = importlib.import_module(where).METHOD
        if method.name != name:
            raise ValueError(f"{where} defines method {method.name!r}, registered as {name!r}")
        _loaded[where] = dataclasses.replace(method, package=where)
    return _loaded[where]


def names(trained: bool | None = None) -> list[str]:
    """Registered method names, in registry order; only the trained (or training-free) ones if asked."""
    return [n for n in METHODS if trained is None or get(n).trained == trained]


def register(name: str, package: str) -> None:
    """Add a method defined outside this package (its `package` defines METHOD)."""
    if name in METHODS:
        raise ValueError(f"method {name!r} is registered already ({METHODS[name]})")
    METHODS[name] = package


def unregister(name: str) -> None:
    """Remove a method added with `register` (tests)."""
    _loaded.pop(METHODS.pop(name), None)


# ------------------------------------------------------------------ configs
def foreign_fields(method: str) -> dict[str, tuple[str, Any]]:
    """Fields of other trained methods' configs that `method`'s config lacks -> (their method, default)."""
    own = {f.name for f in dataclasses.fields(get(method).config)}
    out: dict[str, tuple[str, Any]] = {}
    for other in names(trained=True):
        for f in dataclasses.fields(get(other).config):
            if f.name not in own and f.name not in out:
                out[f.name] = (other, f.default)
    return out


def drafter_config(data: dict[str, Any], legacy: bool = False) -> DrafterConfig:
    """The config of `data["method"]` (default: the base's) from a dict; unknown keys raise.

    A key of another method's config raises too, naming that method. `legacy`: a checkpoint written
    when all methods shared one flat config (config.json held every method's fields): another method's
    field that holds its default is dropped; one set to anything else still raises; an option the
    method added later (its config's ABSENT_MEANS) takes the value it had before it existed.
    """
    method = data.get("method", DrafterConfig.method)
    trained = names(trained=True)
    if method not in trained:
        free = " (a training-free method: no config, nothing to train)" if method in METHODS else ""
        raise ConfigError(f"unknown training method {method!r}{free}; valid methods: {sorted(trained)}")
    m = get(method)
    if legacy and method != "eagle3":  # a flat config's tree sizes are EAGLE-3's (DFlash/DSpark trees came later)
        data = {k: v for k, v in data.items() if k not in ("tree_top_k", "tree_total_tokens")}
    if legacy:  # options newer than the checkpoint: off, not today's default
        data = {**getattr(m.config, "ABSENT_MEANS", {}), **data}
    own = {f.name for f in dataclasses.fields(m.config)}
    foreign = foreign_fields(method)
    unknown = sorted(k for k in data if k not in own and k not in foreign)
    if unknown:
        raise ConfigError(f"{m.config.__name__}: unknown key(s) {unknown}; valid keys: {sorted(own)}")
    norm = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731  (JSON lists vs tuple defaults)
    bad = [k for k, v in data.items() if k in foreign and not (legacy and norm(v) == foreign[k][1])]
    if bad:
        which = ", ".join(f"{k} (a {foreign[k][0]} option)" for k in bad)
        raise ConfigError(f"{which} set for a {method} drafter, which has no such option; drop it or use that method")
    return from_dict(m.config, {k: v for k, v in data.items() if k in own})
