"""The native target backend: a lean decoder stack with a static KV cache and weight-only int8/int4."""

from selfdraft.native.cache import NativeCache
from selfdraft.native.model import ARCHITECTURES, WEIGHT_FORMATS, NativeModel, NativeStep, unsupported_reason

__all__ = ["ARCHITECTURES", "WEIGHT_FORMATS", "NativeCache", "NativeModel", "NativeStep", "unsupported_reason"]
