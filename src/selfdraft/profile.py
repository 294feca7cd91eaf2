"""The hardware cost table SPS(B) (docs/scheduler.md#cost-table): target forwards per second when one forward
carries B tokens, measured once per (target, dtype, machine) and stored beside the target cache as
cache_root()/profiles/<fingerprint>-<key>.json (Target.profile_key: backend, weights, dtype and, off
the CPU, the device); the hardware scheduler interpolates it.

A forward of B tokens as one row over a KV of `kv_len` costs what the engine's padded forward of
R rows × W tokens (R·W = B) over per-row KV `kv_len` costs: the same tokens through the linear
layers and the same B·kv_len query-key pairs.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfdraft.config import ConfigError
from selfdraft.scheduler import SCHEDULERS, CostTable, Scheduler
from selfdraft.target import Target
from selfdraft.target_loading import cache_root


@dataclass
class Profile:
    target: str
    fingerprint: str
    dtype: str
    kv_len: int  # cached tokens each measured forward attends to
    threads: int
    machine: str
    time: str
    batch_tokens: list[int]  # B
    seconds: list[float]  # fastest of the timed forwards at each B
    # Cores other processes kept busy while the forwards were timed (Linux /proc/stat; None elsewhere and in
    # tables stored before it was recorded). Above OTHER_WORK_LIMIT the table is re-measured when next needed.
    other_cores: float | None = None

    @property
    def sps(self) -> list[float]:
        return [1.0 / s for s in self.seconds]

    def cost_table(self) -> CostTable:
        """SPS(B) with each forward's time capped by the fastest larger B measured: B tokens can always
        be run padded to B' > B, so a slower reading is noise (a busy machine: measured once, B = 2 at
        63.7 ms beside B = 5 at 32.0 ms, made the hardware scheduler refuse every draft)."""
        seconds = list(self.seconds)
        for i in range(len(seconds) - 2, -1, -1):
            seconds[i] = min(seconds[i], seconds[i + 1])
        return CostTable(tuple(self.batch_tokens), tuple(1.0 / t for t in seconds))

    def table(self) -> str:
        """Plain-text table: B, ms per forward, SPS(B), tokens/s = B·SPS(B), cost relative to B = 1."""
        rows = [f"{'B':>5} {'ms/forward':>11} {'SPS(B)':>8} {'tokens/s':>9} {'x B=1':>6}"]
        for b, s in zip(self.batch_tokens, self.seconds):
            rows.append(f"{b:>5} {s * 1e3:>11.1f} {1 / s:>8.2f} {b / s:>9.1f} {s / self.seconds[0]:>6.2f}")
        return "\n".join(rows)


def geometric_batch_tokens(max_tokens: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to max_tokens (always included)."""
    powers = [2**i for i in range(max_tokens.bit_length())]
    return sorted({b for p in powers for b in (p, p + p // 2) if b < max_tokens} | {max_tokens})


def cpu_fields() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo ("model name", "cpu family", "model", "flags", ...; it
    describes them all); empty where there is none (not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def this_machine(dev: torch.device) -> str:
    """The CPU (model name, family and model: one "Intel(R) Xeon(R) Processor" name covers several), its
    CPU count and, on a GPU, the device. A stored table is reused only on the machine that measured it,
    since a home directory may follow a user to another CPU."""
    cpu, ids = platform.processor(), cpu_fields()
    if "model name" in ids:
        cpu = f"{ids['model name']} (family {ids.get('cpu family', '?')} model {ids.get('model', '?')})"
    machine = f"{platform.machine()} {cpu} {os.cpu_count()} cpus"
    return machine + (f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else "")


def busy_cpu_seconds() -> float | None:
    """CPU-seconds every process on the machine has worked since boot (Linux /proc/stat: user .. steal,
    without idle and iowait); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


# A table timed while other processes kept more than half a core busy prices widths wrongly against each
# other (measured: decode-1 at 109 ms beside training, 30.9 ms idle, on the same Intel Xeon).
OTHER_WORK_LIMIT = 0.5


def profile_path(target: Target, dtype: str) -> Path:
    return cache_root() / "profiles" / f"{target.fingerprint()}-{dtype}.json"


@torch.inference_mode()
def measure_sps(target: Target, dtype: str, batch_tokens: list[int], kv_len: int = 256, repeats: int = 3) -> Profile:
    """Forwards of B random tokens after a real prefill of kv_len tokens (rolled back after each):
    one warm-up round, then `repeats` rounds over all B. The fastest is kept: on a shared machine
    other jobs only ever add time (measured here: 1-thread decode 64-205 ms)."""
    g = torch.Generator().manual_seed(0)
    dev = target.device
    cache = target.new_cache()
    target.forward(torch.randint(0, target.vocab_size, (1, kv_len), generator=g), cache, last_only=True)
    # the inputs wait on the device, so a timed forward is the forward, not a host-to-device copy
    inputs = [torch.randint(0, target.vocab_size, (1, B), generator=g).to(dev) for B in batch_tokens]
    times: list[list[float]] = [[] for _ in batch_tokens]
    busy0, own0, wall0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    for rep in range(repeats + 1):  # round-robin over B: a busy spell slows every B alike
        for i, ids in enumerate(inputs):
            synchronize(dev)  # a GPU runs kernels asynchronously: the clock must wait for them
            t0 = time.perf_counter()
            target.forward(ids, cache)
            synchronize(dev)
            if rep:
                times[i].append(time.perf_counter() - t0)
            target.rollback(cache, kv_len)
    seconds = [min(t) for t in times]
    busy1, own1, wall1 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    # every process's work minus this one's, per second of the measurement: the cores others held
    other = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0 - (own1 - own0)) / (wall1 - wall0))
    return Profile(
        target=target.name, fingerprint=target.fingerprint(), dtype=dtype, kv_len=kv_len,
        threads=torch.get_num_threads(), machine=this_machine(dev),
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        batch_tokens=list(batch_tokens), seconds=seconds,
        other_cores=None if other is None else round(other, 2),
    )  # fmt: skip


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); a no-op on the CPU, whose ops finish when they return."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save_profile(profile: Profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=2) + "\n")
    os.replace(tmp, path)


def load_profile(target: Target, dtype: str) -> Profile:
    path = profile_path(target, dtype)
    if not path.exists():
        raise ConfigError(f"no cost profile for this target in {dtype} ({path}): run `selfdraft profile --dtype {dtype}`")
    return Profile(**json.loads(path.read_text()))


def load_cost_table(target: Target, dtype: str) -> CostTable:
    """SPS(B) for the hardware scheduler."""
    return load_profile(target, dtype).cost_table()


# Timed rounds of the quick profile: on a 2-core AMD EPYC (Zen 4, 2026-12-03) the fastest of 2 rounds
# put verify-5 at 1.23 decodes where the fastest of 12 says 1.37 (B = 1..8: 18.5 21.7 22.3 22.8 25.4
# 28.2 28.9 30.6 ms), so the scheduler drafted 4 where 1-3 paid; 10 rounds cost ~2 s of a 135M target.
QUICK_REPEATS = 10


_MEASURED_HERE: dict[Path, Profile] = {}  # tables this process measured (`fresh`: once per process)
BUSY = "the stored one was measured beside other work"


def cost_table_for(target: Target, max_tokens: int, log=None, fresh: bool = False) -> CostTable:
    """The stored SPS(B) of this target, backend, dtype and thread count when it covers B up to
    max_tokens, was measured on this machine and not beside other work (`stale`); otherwise a quick one
    is measured (B = 1..max_tokens, geometric above 16; KV 256; seconds). The quieter of the two is kept
    on disk and priced with. fresh (bench): measure once in this process whatever is stored and price
    with that, since a table taken under another load prices forwards of different widths wrongly
    against each other."""
    path = profile_path(target, target.profile_key)
    if fresh and path in _MEASURED_HERE:
        return _MEASURED_HERE[path].cost_table()
    stored, why = None, "none stored"
    if path.exists():
        try:
            stored = load_profile(target, target.profile_key)
            why = stale(stored, max_tokens, target.device)
        except (TypeError, ValueError):  # an older or damaged file: measure again
            why = "the stored one is unreadable"
        if why is None and not fresh:
            return stored.cost_table()
    t0 = time.perf_counter()
    bs = list(range(1, max_tokens + 1)) if max_tokens <= 16 else geometric_batch_tokens(max_tokens)
    kv = max(1, min(256, target.max_context - bs[-1] - 1))  # a small model's context may be shorter
    prof = measure_sps(target, target.profile_key, bs, kv_len=kv, repeats=QUICK_REPEATS)
    quieter_stored = why in (None, BUSY) and (stored.other_cores or 0) <= (prof.other_cores or 0)
    if not quieter_stored:
        save_profile(prof, path)
    if quieter_stored and not fresh:
        prof = stored  # the machine is as busy as it was then: the stored table is no worse
    _MEASURED_HERE[path] = prof
    if log is not None:
        busy = f"; {prof.other_cores:.1f} cores busy with other work" if (prof.other_cores or 0) > OTHER_WORK_LIMIT else ""
        log(f"measured SPS(B) for the hardware scheduler in {time.perf_counter() - t0:.1f}s ({why or 'fresh'}{busy}) -> {path}")
    return prof.cost_table()


def stale(prof: Profile, max_tokens: int, device: torch.device) -> str | None:
    """Why a stored table cannot price this run (None: it can)."""
    if prof.threads != torch.get_num_threads() or prof.batch_tokens[-1] < max_tokens:
        return "the stored one has other threads or narrower forwards"
    if prof.machine != this_machine(device):
        return f"the stored one was measured on {prof.machine}"
    if (prof.other_cores or 0) > OTHER_WORK_LIMIT:
        return BUSY
    return None


def measured_here(target: Target) -> Profile | None:
    """The table this process measured for `target` (what a bench run priced), or None."""
    return _MEASURED_HERE.get(profile_path(target, target.profile_key))


def scheduler_for(kind: str, target: Target, drafter, gamma: int, threshold: float | None = None, log=None,
                  batch_tokens: int | None = None, fresh: bool = False) -> Scheduler | None:
    """The Scheduler a command runs (None: verify every draft). batch_tokens: None for one request
    (generate, bench, demo: Algorithm 1 online, unpadded); the largest forward for the batched
    engine (serve: its padded pricing).

    auto = hardware: on a machine where verifying k tokens costs much more than decoding one (CPU),
    a request verifies only the drafts worth their cost (docs/scheduler.md) instead of γ every
    round, judged by DSpark's confidences c_k or, for the other drafters, by the request's own past
    acceptance per position (`AcceptanceHistory`; single requests only, the engine verifies their
    drafts in full)."""
    if kind not in SCHEDULERS + ("auto",):
        raise ConfigError(f"scheduler must be auto or one of {SCHEDULERS}, got {kind!r}")
    if kind == "auto":
        adaptive = getattr(drafter, "gives_confidences", False) or drafter.drafts_trees or batch_tokens is None
        kind = "hardware" if adaptive and gamma > 0 and drafter.name != "none" else "fixed"
    if kind == "fixed":
        return None
    cost = cost_table_for(target, batch_tokens or drafter.block_rows(gamma), log, fresh) if kind == "hardware" else None
    kw = {} if threshold is None else {"threshold": threshold}  # None: the Scheduler's own default
    return Scheduler(kind, cost=cost, padded=batch_tokens is not None, **kw)


def plot_profile(profile: Profile, png: Path) -> None:
    """SPS(B) and tokens/s = B·SPS(B) against B (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(profile.batch_tokens, profile.sps, "o-", label="SPS(B) forwards/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("B = tokens in one target forward")
    ax.set_ylabel("forwards / s")
    ax2 = ax.twinx()
    ax2.plot(profile.batch_tokens, [b * s for b, s in zip(profile.batch_tokens, profile.sps)], "s--", color="C1",
             label="tokens/s")
    ax2.set_ylabel("tokens / s")
    ax.set_title(f"{Path(profile.target).name} {profile.dtype}, KV {profile.kv_len}, {profile.threads} threads")
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.88))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
