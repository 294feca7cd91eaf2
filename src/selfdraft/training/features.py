"""Target features for training: computed online (`compute_features`) or cached on disk.

Drafters read the hidden states of a few target layers plus the final hidden state, from which
the frozen LM head gives p_t when training (docs/architecture.md#feature-layers, docs/training.md#feature-cache: full-vocabulary logits are
never stored). The cache is a directory of bf16 safetensors shards, memory-mapped on read:

    FEATDIR/index.json               target identity, feature layers, per-record shard/offset/length
    FEATDIR/shard-00000.safetensors  features [N, n_feat, H] bf16, last_hidden [N, H] bf16,
                                     lse [N] float32 (log-partition of p_t over the full vocabulary),
                                     input_ids [N] int32, loss_mask [N] uint8 (N = tokens of its records)

With `lse`, p_t over any subset of the vocabulary is exp(lm_head_rows(last_hidden) - lse): training
over a draft vocabulary never runs the full LM head again.

Shards are written whole (temp file + rename), so a killed run restarted with the same command
recomputes only the records not yet in a finished shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from selfdraft.config import ConfigError
from selfdraft.durable import replace_durably, write_text_durably
from selfdraft.training.records import DataError, iter_records

BYTES_PER_VALUE = 2  # bf16
BYTES_PER_TOKEN_IDS = 9  # int32 id + uint8 mask + float32 lse


@dataclass(frozen=True)
class FeatureSpec:
    feature_layers: tuple[int, ...]  # 0-based decoder layers (docs/architecture.md#feature-layers)
    max_seq_len: int = 2048  # longer conversations are truncated (training never sees more)
    shard_tokens: int = 65536  # tokens per shard: 65536 x 6 x 576 x 2 B ~ 450 MB with 5 layers
    batch_size: int = 4  # sequences per target forward (sorted by length, right-padded)

    def __post_init__(self) -> None:
        if not self.feature_layers:
            raise ConfigError("give at least one feature layer")
        if self.max_seq_len < 2 or self.shard_tokens < 1 or self.batch_size < 1:
            raise ConfigError("max_seq_len must be >= 2, shard_tokens >= 1 and batch_size >= 1")


@torch.inference_mode()
def compute_features(target, input_ids: torch.Tensor, feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [1, T] -> (features [T, n_feat, H], last_hidden [T, H]) in the target's dtype.

    The online training mode calls this per sequence; the LM head runs at the last position
    only, since training applies it itself where it needs p_t.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got {tuple(input_ids.shape)}")
    step = target.forward(input_ids, cache=None, feature_layers=tuple(feature_layers), last_only=True)
    return step.features[0], step.last_hidden[0]


@dataclass
class CachedStates:
    """What the cache stores for one sequence of T tokens."""

    features: torch.Tensor  # [T, n_feat, H] bf16
    last_hidden: torch.Tensor  # [T, H] bf16
    lse: torch.Tensor  # [T] float32, computed from the bf16-rounded last_hidden the cache holds


@torch.inference_mode()
def compute_states(target, seqs: list[torch.Tensor], feature_layers: tuple[int, ...]) -> list[CachedStates]:
    """B sequences ([T_b] ids each) in one right-padded target forward -> their cached states."""
    from selfdraft.training.objectives import target_lse

    dev = target.model.device
    T = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)  # [B, T]
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, : len(x)], attn[b, : len(x)] = x, 1
    step = target.forward(ids.to(dev), None, tuple(feature_layers), attention_mask=attn.to(dev), last_only=True)
    last = step.last_hidden.to(torch.bfloat16)  # [B, T, H]
    lse = target_lse(target, last.to(target.model.dtype))  # [B, T]
    return [CachedStates(step.features[b, : len(x)].to(torch.bfloat16).cpu(), last[b, : len(x)].cpu(),
                         lse[b, : len(x)].float().cpu()) for b, x in enumerate(seqs)]


def bytes_per_token(target, spec: FeatureSpec) -> int:
    return (len(spec.feature_layers) + 1) * target.hidden_size * BYTES_PER_VALUE + BYTES_PER_TOKEN_IDS


def estimate_bytes(data_dir: str | Path, target, spec: FeatureSpec, split: str | None = None) -> int:
    """Disk size of the cache for a dataset, from its token counts (printed before a long run)."""
    tokens = sum(min(len(r["input_ids"]), spec.max_seq_len) for r in iter_records(data_dir, split))
    return tokens * bytes_per_token(target, spec)


def write_feature_cache(
    target, data_dir: str | Path, out_dir: str | Path, spec: FeatureSpec, split: str | None = None,
    progress: bool = True,
) -> dict:
    """Run the target over every record and store its features in shards; returns the index."""
    from selfdraft.progress import progress_bar

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {"target": target.identity(), "feature_layers": list(spec.feature_layers),
              "max_seq_len": spec.max_seq_len, "data": str(Path(data_dir).resolve()), "split": split}
    shards = _finished_shards(out_dir, header)
    done = {r["id"] for s in shards for r in s["records"]}
    records = [r for r in iter_records(data_dir, split) if r["id"] not in done]
    buffer: list[dict] = []
    buffered = 0  # tokens in buffer
    bar = progress_bar(total=sum(min(len(r["input_ids"]), spec.max_seq_len) for r in records), unit="tok",
                       disable=not progress)
    # Similar lengths together, so the padded batch wastes little; ids make the order stable.
    records.sort(key=lambda r: (min(len(r["input_ids"]), spec.max_seq_len), r["id"]))
    for i in range(0, len(records), spec.batch_size):
        group = records[i : i + spec.batch_size]
        ids = [torch.tensor(r["input_ids"][: spec.max_seq_len]) for r in group]
        for rec, x, st in zip(group, ids, compute_states(target, ids, spec.feature_layers)):
            buffer.append({"id": rec["id"], "split": rec["split"], "input_ids": x,
                           "loss_mask": torch.tensor(rec["loss_mask"][: spec.max_seq_len], dtype=torch.uint8),
                           "features": st.features, "last_hidden": st.last_hidden, "lse": st.lse})
            bar.update(len(x))
            buffered += len(x)
        if buffered >= spec.shard_tokens:
            shards.append(_write_shard(out_dir, len(shards), buffer, header))
            buffer, buffered = [], 0
    if buffer:
        shards.append(_write_shard(out_dir, len(shards), buffer, header))
    bar.close()
    index = {**header, "records": sum(len(s["records"]) for s in shards),
             "tokens": sum(r["length"] for s in shards for r in s["records"]), "shards": shards}
    write_index(out_dir, index)
    return index


def write_index(out_dir: Path, index: dict) -> None:
    """index.json replaced whole (never rewritten in place: a crash mid-write would leave a torn index)."""
    write_text_durably(out_dir / "index.json", json.dumps(index, indent=1) + "\n")


def _write_shard(out_dir: Path, number: int, buffer: list[dict], header: dict) -> dict:
    """Concatenate a buffer of sequences into one shard (atomic rename); returns its index entry."""
    name = f"shard-{number:05d}.safetensors"
    entries, offset = [], 0
    for b in buffer:
        entries.append({"id": b["id"], "split": b["split"], "offset": offset, "length": len(b["input_ids"])})
        offset += len(b["input_ids"])
    tensors = {
        "features": torch.cat([b["features"] for b in buffer]).contiguous(),  # [N, n_feat, H]
        "last_hidden": torch.cat([b["last_hidden"] for b in buffer]).contiguous(),  # [N, H]
        "lse": torch.cat([b["lse"] for b in buffer]).contiguous(),  # [N] float32
        "input_ids": torch.cat([b["input_ids"] for b in buffer]).to(torch.int32),  # [N]
        "loss_mask": torch.cat([b["loss_mask"] for b in buffer]),  # [N]
    }
    tmp = out_dir / (name + ".partial")
    save_file(tensors, str(tmp), metadata={"header": json.dumps(header), "records": json.dumps(entries)})
    replace_durably(tmp, out_dir / name)
    return {"file": name, "records": entries}


def _finished_shards(out_dir: Path, header: dict) -> list[dict]:
    """Shards of an earlier run of the same command; refuse a cache built with other settings."""
    shards = []
    for path in sorted(out_dir.glob("shard-*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if json.loads(meta.get("header", "{}")) != header:
            raise DataError(f"{out_dir} holds features from another target, data or layer set: use a new --out")
        shards.append({"file": path.name, "records": json.loads(meta["records"])})
    return shards


@dataclass
class CachedSequence:
    id: str
    split: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    features: torch.Tensor  # [T, n_feat, H] bf16
    last_hidden: torch.Tensor  # [T, H] bf16
    lse: torch.Tensor | None = None  # [T] float32 log-partition of p_t (None in caches written before it existed)


class FeatureCache:
    """Read side of a feature cache: sequences by position, memory-mapped from the shards."""

    def __init__(self, cache_dir: str | Path, split: str | None = None) -> None:
        self.dir = Path(cache_dir)
        index_path = self.dir / "index.json"
        if not index_path.exists():
            raise DataError(f"{cache_dir} is not a feature cache (no index.json): run `selfdraft data features`")
        self.index = json.loads(index_path.read_text())
        self.feature_layers = tuple(self.index["feature_layers"])
        self.entries = [(s["file"], r) for s in self.index["shards"] for r in s["records"]
                        if split is None or r["split"] == split]
        self._handles: dict[str, object] = {}

    def check_target(self, target) -> None:
        """Refuse features computed by another target (its hidden states would be meaningless)."""
        if self.index["target"]["fingerprint"] != target.fingerprint():
            raise DataError(f"{self.dir} was computed with target {self.index['target']['name']}, not {target.name}")

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> CachedSequence:
        file, rec = self.entries[i]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.dir / file), "pt")
        f = self._handles[file]
        lo, hi = rec["offset"], rec["offset"] + rec["length"]
        return CachedSequence(
            id=rec["id"], split=rec["split"],
            input_ids=f.get_slice("input_ids")[lo:hi].long(),
            loss_mask=f.get_slice("loss_mask")[lo:hi].bool(),
            features=f.get_slice("features")[lo:hi],
            last_hidden=f.get_slice("last_hidden")[lo:hi],
            lse=f.get_slice("lse")[lo:hi] if "lse" in f.keys() else None,
        )
