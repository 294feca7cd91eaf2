"""Copy a trained drafter into checkpoints/ as the repository ships it: weights cast to bf16, no
trainer state, the training log thinned (all val lines, every 10th train line), provenance noting
where it came from.

    python scripts/campaign/ship_drafter.py work/campaign/dspark-seg-x checkpoints/dspark
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SKIP = {"trainer_state.pt"}


def ship(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".shipping")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name in SKIP:
            continue
        if f.name == "model.safetensors":
            state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
            save_file(state, str(tmp / f.name))
        elif f.name == "train_log.jsonl":
            (tmp / f.name).write_text(thin_log(f.read_text()))
        elif f.is_dir():
            shutil.copytree(f, tmp / f.name)
        else:
            shutil.copy2(f, tmp / f.name)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["provenance"] = portable(cfg.get("provenance", {}))
    cfg["provenance"]["shipped"] = {"from": portable(str(src)), "weights": "cast to bfloat16 for the repository"}
    carry_lineage(cfg["provenance"], dst)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)


def carry_lineage(prov: dict, dst: Path) -> None:
    """A campaign segment warm-started from the weights it replaces keeps their lineage (`campaign`, one
    entry per segment, and `campaign_ledger`) and adds itself to it, so the shipped weights always say
    every segment they came from. Weights without a lineage (a family's first segment) become segment 0."""
    old = dst / "config.json"
    train = prov.get("train", {})
    if not old.exists() or Path(str(train.get("init_from", ""))).resolve() != dst.resolve():
        return
    before = json.loads(old.read_text()).get("provenance", {})
    lineage = before.get("campaign") or [segment_zero(before)]
    prev = lineage[-1]
    lineage.append({"segment": prev["segment"] + 1, "started_from": f"segment {prev['segment']} (step {prev['steps']})",
                    "data": train.get("data"), "steps": prov.get("steps"), "tokens": prov.get("tokens"),
                    "recipe": f"lr {train.get('lr')}, {train.get('warmup_steps')} warmup steps, cosine over the "
                              f"segment, max_seq_len {train.get('max_seq_len')}"})
    prov["campaign"] = lineage
    prov["campaign_ledger"] = before.get("campaign_ledger") or "ledger.json: every training record the campaign drew (scripts/campaign/campaign_data.py)"


def segment_zero(before: dict) -> dict:
    """The run that made the weights a campaign starts from, as the lineage's first entry."""
    t = before.get("train", {})
    return {"segment": 0, "started_from": t.get("init_from") or "random init", "data": t.get("data"),
            "steps": before.get("steps"), "tokens": before.get("tokens"),
            "recipe": f"lr {t.get('lr')}, {t.get('warmup_steps')} warmup steps, cosine to {t.get('token_budget')} tokens"}


def thin_log(text: str, every: int = 10) -> str:
    """Every val line and every `every`-th train line (checkpoints/ has a size budget; the full log stays in work/)."""
    out, n = [], 0
    for line in text.splitlines():
        if '"kind": "train"' in line:
            n += 1
            if n % every:
                continue
        out.append(line)
    return "\n".join(out) + "\n"


def portable(x):
    """Provenance without this machine's absolute paths: paths inside the repository become relative,
    the interpreter's entry point becomes `selfdraft`, other absolute paths keep only their last parts."""
    if isinstance(x, dict):
        return {k: portable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [portable(v) for v in x]
    if isinstance(x, str) and x.startswith("/"):
        p, root = Path(x), Path.cwd().resolve()
        if p.name == "__main__.py" or p.name == "selfdraft":
            return "selfdraft"
        try:
            return str(p.relative_to(root))
        except ValueError:
            return "/".join(p.parts[-2:])
    return x


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fix-config"]:  # rewrite an already shipped checkpoint's provenance in place
        for d in sys.argv[2:]:
            f = Path(d) / "config.json"
            cfg = json.loads(f.read_text())
            cfg["provenance"] = portable(cfg.get("provenance", {}))
            f.write_text(json.dumps(cfg, indent=2) + "\n")
        sys.exit(0)
    ship(Path(sys.argv[1]), Path(sys.argv[2]))
