"""Copy a trained drafter into checkpoints/ as the repository ships it: weights cast to bf16, no
trainer state, the training log kept, provenance noting where it came from.

    python scripts/ship_drafter.py work/main/dspark checkpoints/dspark
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
        elif f.is_dir():
            shutil.copytree(f, tmp / f.name)
        else:
            shutil.copy2(f, tmp / f.name)
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.setdefault("provenance", {})["shipped"] = {"from": str(src), "weights": "cast to bfloat16 for the repository"}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)


if __name__ == "__main__":
    ship(Path(sys.argv[1]), Path(sys.argv[2]))
