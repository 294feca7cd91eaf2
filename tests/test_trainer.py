"""The generic training loop on a tiny random target with a toy strategy (tests/toy_training.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from selfdraft.config import ConfigError, DrafterConfig, TrainConfig
from selfdraft.target import Target
from selfdraft.training.checkpointing import STATE_FILE
from selfdraft.training.optim import ScheduleOrigin, lr_at
from selfdraft.training.trainer import train
from tests.helpers import tiny_llama
from tests.toy_training import TOY, ToyConfig, single_thread, toy_method, write_dataset  # noqa: F401  (fixtures)


@pytest.fixture
def tiny_target() -> Target:
    """A peaked output layer, so a tiny drafter can reach confident predictions in a few steps."""
    return Target(tiny_llama(peaked=4.0))


@pytest.fixture
def data(tmp_path):
    return write_dataset(tmp_path / "data")


def cfgs(data, **train_overrides) -> tuple[DrafterConfig, TrainConfig]:
    train = dict(data=str(data), steps=10, batch_size=4, max_seq_len=32, lr=1e-2, warmup_steps=3,
                 val_every=5, val_batches=1, save_every=5, seed=0, bf16=False)  # fmt: skip
    return ToyConfig(feature_layers=(1, 2)), TrainConfig(**{**train, **train_overrides})


class Kill(Exception):
    """Stands in for a kill -9 in the middle of a run."""


def test_loss_goes_down(toy_method, tiny_target, data, tmp_path):
    dcfg, tcfg = cfgs(data, steps=30, save_every=0, val_every=10, lr=5e-2)
    res = train(tiny_target, dcfg, tcfg, tmp_path / "out")
    losses = [h.loss for h in res.history]
    assert res.steps == 30 and res.stopped_by == "steps" and len(losses) == 30
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    assert [v.step for v in res.val] == [10, 20, 30] and res.val[-1].loss < res.val[0].loss
    assert "acc@1" in res.history[-1].metrics and res.history[-1].tokens_per_s > 0
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["method"] == TOY and saved["provenance"]["steps"] == 30 and saved["feature_layers"] == [1, 2]


def test_resume_after_kill_matches_uninterrupted_run(toy_method, tiny_target, data, tmp_path):
    dcfg, tcfg = cfgs(data, grad_accum=2)
    full = train(tiny_target, dcfg, tcfg, tmp_path / "full")

    def kill_at_7(log):
        if log.step == 7:
            raise Kill

    with pytest.raises(Kill):
        train(tiny_target, dcfg, tcfg, tmp_path / "killed", on_step=kill_at_7)
    assert torch.load(tmp_path / "killed" / STATE_FILE, weights_only=True)["step"] == 5
    resumed = train(tiny_target, dcfg, tcfg, tmp_path / "killed")

    assert resumed.resumed_from == 5 and resumed.steps == 10 and resumed.tokens == full.tokens
    assert [h.lr for h in resumed.history] == [h.lr for h in full.history]  # the schedule continued
    assert [h.loss for h in resumed.history] == [h.loss for h in full.history]  # same data, same RNG
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "killed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(tmp_path / "full" / STATE_FILE, weights_only=True)
    sb = torch.load(tmp_path / "killed" / STATE_FILE, weights_only=True)
    assert (sa["epoch"], sa["index"]) == (sb["epoch"], sb["index"])
    assert torch.equal(sa["generator"], sb["generator"])


def test_resume_refuses_a_different_trajectory(toy_method, tiny_target, data, tmp_path):
    dcfg, tcfg = cfgs(data, steps=5)
    train(tiny_target, dcfg, tcfg, tmp_path / "out")
    with pytest.raises(ConfigError, match="lr"):
        train(tiny_target, dcfg, cfgs(data, steps=8, lr=3e-3)[1], tmp_path / "out")
    longer = train(tiny_target, dcfg, cfgs(data, steps=8)[1], tmp_path / "out")  # training longer is fine
    assert longer.resumed_from == 5 and longer.steps == 8
    fresh = train(tiny_target, dcfg, cfgs(data, steps=2)[1], tmp_path / "out", resume=False)
    assert fresh.resumed_from == 0 and fresh.steps == 2


def test_token_budget_stops_training(toy_method, tiny_target, data, tmp_path):
    dcfg, tcfg = cfgs(data, steps=100, token_budget=300, save_every=0, val_every=0)
    res = train(tiny_target, dcfg, tcfg, tmp_path / "out")
    assert res.stopped_by == "token_budget" and res.tokens >= 300 and res.steps < 100
    assert res.history[-2].tokens < 300


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 0, cfg) == pytest.approx(0.1) and lr_at(9, 0, cfg) == pytest.approx(1.0)
    assert lr_at(10, 0, cfg) == pytest.approx(1.0) and lr_at(100, 0, cfg) == pytest.approx(0.1)
    assert lr_at(55, 0, cfg) == pytest.approx(0.55)  # cosine midpoint
    budget = TrainConfig(steps=100, lr=1.0, warmup_steps=0, min_lr_ratio=0.0, token_budget=1000)
    assert lr_at(1, 500, budget) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))  # tokens lead


@pytest.mark.parametrize("change", [dict(token_budget=4000), dict(token_budget=1500), dict(steps=40)])
def test_resuming_with_another_budget_continues_the_schedule(toy_method, tiny_target, data, tmp_path, change):
    """A resume with a larger (or smaller) token budget or step count used to jump the cosine
    (DSpark 5.66e-4 -> 2.49e-4 at step 3201); the lr must go on from where it was, then decay over what is left."""
    dcfg, tcfg = cfgs(data, steps=20, token_budget=2000, save_every=5, val_every=0, warmup_steps=2)
    seen = []

    def kill_at_7(log):
        seen.append(log.lr)
        if log.step == 7:
            raise Kill

    with pytest.raises(Kill):
        train(tiny_target, dcfg, tcfg, tmp_path / "out", on_step=kill_at_7)  # saved at step 5
    more = train(tiny_target, dcfg, replace(tcfg, **change), tmp_path / "out")
    lrs = [h.lr for h in more.history[5:]]
    assert more.resumed_from == 5 and lrs
    # the step after the resume is within one step's change of the one before (no jump) ...
    assert abs(lrs[0] - seen[4]) <= 2 * abs(seen[4] - seen[3]) + 1e-12, (seen[:5], lrs[:3])
    assert all(b <= a + 1e-12 for a, b in zip(lrs, lrs[1:]))  # ... and the cosine keeps decaying
    saved = torch.load(tmp_path / "out" / STATE_FILE, weights_only=True)["schedule_origin"]
    assert saved[0] == 5 and 0 < saved[2] < 1  # the new segment starts at the resume point


def test_schedule_origin_maps_the_rest_of_the_cosine():
    cfg = TrainConfig(steps=10**6, lr=1.0, warmup_steps=0, min_lr_ratio=0.0, token_budget=1000)
    longer = replace(cfg, token_budget=3000)
    origin = ScheduleOrigin(step=10, tokens=500, progress=0.5)
    assert lr_at(10, 500, longer, origin) == pytest.approx(lr_at(10, 500, cfg))  # continuous at the origin
    assert lr_at(11, 1750, longer, origin) == pytest.approx(lr_at(11, 750, cfg))  # halfway through what is left
    assert lr_at(12, 3000, longer, origin) == pytest.approx(0.0)  # and ends with the new budget
    with_jump = lr_at(10, 500, longer)  # the old behaviour: progress recomputed from 0 under the new budget
    assert with_jump != pytest.approx(lr_at(10, 500, cfg))


def test_init_from_warm_starts_a_fresh_run(toy_method, tiny_target, data, tmp_path):
    dcfg, tcfg = cfgs(data, steps=4, save_every=0, val_every=0)
    train(tiny_target, dcfg, tcfg, tmp_path / "a")
    warm = train(tiny_target, dcfg, replace(tcfg, steps=1, lr=1e-9, warmup_steps=1, init_from=str(tmp_path / "a")),
                 tmp_path / "b")
    train(tiny_target, dcfg, replace(tcfg, steps=1, lr=1e-9, warmup_steps=1), tmp_path / "c")
    a, b, c = (load_file(tmp_path / d / "model.safetensors") for d in "abc")
    assert warm.steps == 1 and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)  # started from a's weights
    assert not all(torch.allclose(a[k], c[k], atol=1e-6) for k in a)  # a fresh start would not be
    meta = json.loads((tmp_path / "b" / "config.json").read_text())
    assert meta["provenance"]["train"]["init_from"] == str(tmp_path / "a")  # the provenance says so
    with pytest.raises(ConfigError, match="init-from"):
        train(tiny_target, replace(dcfg, feature_layers=(1,)), replace(tcfg, init_from=str(tmp_path / "a")), tmp_path / "d")


def test_trains_with_a_bfloat16_target(toy_method, data, tmp_path):
    target = Target(tiny_llama(peaked=4.0).to(torch.bfloat16))
    dcfg, tcfg = cfgs(data, steps=3, save_every=0, val_every=0)
    with pytest.raises(ConfigError, match="autocast"):
        train(target, dcfg, tcfg, tmp_path / "out")
    res = train(target, dcfg, cfgs(data, steps=3, save_every=0, val_every=0, bf16=True)[1], tmp_path / "out")
    assert all(math.isfinite(h.loss) for h in res.history)
    assert load_file(tmp_path / "out" / "model.safetensors")["fc.weight"].dtype == torch.float32


def test_unknown_method_lists_valid_ones(tiny_target, data, tmp_path):
    dcfg, tcfg = cfgs(data)
    with pytest.raises(ConfigError, match="valid methods"):
        train(tiny_target, DrafterConfig(method="nope"), tcfg, tmp_path / "out")


# ------------------------------------------------------------------ the `selfdraft train` command
@pytest.fixture
def target_dir(tmp_path):
    path = tmp_path / "tiny-target"
    tiny_llama(peaked=4.0).save_pretrained(path)
    return path


def run_cli(*args: str):
    from typer.testing import CliRunner

    from selfdraft.cli import app

    return CliRunner().invoke(app, ["train", *args])


def test_cli_config_file_and_overrides(toy_method, target_dir, data, tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"drafter": {"method": TOY, "gamma": 3, "feature_layers": [0, 2]},
                                  "train": {"steps": 2, "lr": 1e-2, "batch_size": 2, "max_seq_len": 24}}))
    out = tmp_path / "out"
    res = run_cli("--config", str(config), "--target", str(target_dir), "--data", str(data), "--out", str(out),
                  "--steps", "3", "--feature-layers", "1,2", "--no-bf16", "--dtype", "float32")
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["drafter"]["gamma"] == 3 and meta["feature_layers"] == [1, 2]  # file value, CLI override
    assert meta["provenance"]["steps"] == 3 and meta["provenance"]["train"]["lr"] == 1e-2


def test_cli_rejects_unknown_keys_and_methods(toy_method, target_dir, data, tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"train": {"stepz": 2}}))
    res = run_cli("--config", str(config), "--method", TOY, "--data", str(data), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "unknown key(s) ['stepz']" in res.output
    config.write_text(json.dumps({"optim": {}}))
    res = run_cli("--config", str(config), "--method", TOY, "--data", str(data), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "'drafter' and/or 'train'" in res.output
    res = run_cli("--method", "nope", "--data", str(data), "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "valid methods" in res.output and TOY in res.output
    res = run_cli("--method", TOY, "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "--data" in res.output


def test_cli_trains_dspark_and_its_drafts_are_lossless(target_dir, data, tmp_path):
    """End to end: `selfdraft train --method dspark` -> load_drafter(dir) -> greedy output == plain greedy."""
    from selfdraft.config import GenerationConfig
    from selfdraft.decode import generate
    from selfdraft.loader import load_drafter

    out = tmp_path / "dspark"
    res = run_cli("--method", "dspark", "--target", str(target_dir), "--data", str(data), "--out", str(out),
                  "--steps", "4", "--gamma", "4", "--feature-layers", "0,1,2", "--markov-rank", "8",
                  "--anchors-per-seq", "4", "--batch-size", "2", "--max-seq-len", "32", "--val-every", "2",
                  "--no-bf16", "--dtype", "float32")  # fmt: skip
    assert res.exit_code == 0, res.output
    target = Target.load(str(target_dir), dtype="float32")
    drafter = load_drafter(str(out), target)
    prompt = [5, 8, 11, 14, 17]
    cfg = GenerationConfig(max_new_tokens=24, gamma=4)
    spec = generate(target, drafter, prompt, config=cfg)
    plain = generate(target, load_drafter("none", target), prompt, config=cfg)
    assert spec.token_ids == plain.token_ids and max(r.proposed for r in spec.rounds) == 4


def test_feature_cache_matches_online_training(toy_method, tiny_target, data, tmp_path):
    """Training from `selfdraft data features` output follows the online run (up to the cache's bf16)."""
    from selfdraft.training.features import FeatureSpec, write_feature_cache

    write_feature_cache(tiny_target, data, tmp_path / "feats", FeatureSpec(feature_layers=(1, 2)), progress=False)
    dcfg, tcfg = cfgs(data, steps=6, save_every=0, val_every=0)
    online = train(tiny_target, dcfg, tcfg, tmp_path / "online")
    cached = train(tiny_target, dcfg, replace(tcfg, features=str(tmp_path / "feats")), tmp_path / "cached")
    for a, b in zip(online.history, cached.history):
        assert abs(a.loss - b.loss) < 0.02 * a.loss
    with pytest.raises(ConfigError, match="holds layers"):
        train(tiny_target, replace(dcfg, feature_layers=(0, 1)), replace(tcfg, features=str(tmp_path / "feats")), tmp_path / "x")


def test_train_options_are_the_config_fields(monkeypatch, tmp_path):
    """`train` has one option per field of every method's config and of TrainConfig (generated, not
    copied), a method's own option says whose it is, and every option given reaches its field; options
    not given stay None (the config's default applies). An option of another method is refused (exit 2)."""
    import dataclasses

    from typer.main import get_command

    import selfdraft.cli.train as train_cli
    from selfdraft import methods
    from selfdraft.cli import app
    from selfdraft.config import ConfigError, DrafterConfig, TrainConfig

    command = get_command(app).commands["train"]
    params = {p.name for p in command.params}
    drafter = {f.name for f in dataclasses.fields(DrafterConfig)}
    drafter |= {f.name for m in methods.names(trained=True) for f in dataclasses.fields(methods.get(m).config)}
    assert {"mtp_recursive", "tree_depth", "markov_rank", "mask_token_id", "num_layers"} <= drafter
    fields = drafter | {f.name for f in dataclasses.fields(TrainConfig)}
    assert fields <= params and params - fields == {"out", "target", "config", "resume", "final_only", "threads", "dtype", "device"}
    helps = {p.name: p.help for p in command.params}
    assert helps["tree_depth"].startswith("eagle3: ") and helps["markov_rank"].startswith("dspark: ")
    assert helps["mask_token_id"].startswith("dflash/dspark: ") and helps["mtp_decay"].startswith("mtp: ")
    assert not helps["gamma"].startswith(tuple(methods.names())), helps["gamma"]  # shared: no owner
    seen = {}

    def capture(config, drafter_opts, train_opts):
        seen.update(drafter=drafter_opts, train=train_opts)
        raise ConfigError("captured")

    with monkeypatch.context() as m:
        m.setattr(train_cli, "train_configs", capture)
        res = run_cli("--out", str(tmp_path / "o"), "-m", "eagle3", "--layers", "2", "--tree-depth", "3", "--mtp-stacked",
                      "--feature-layers", "1,2", "-b", "5", "--fsdp", "--data", "d", "--lr", "0.5")
    assert res.exit_code == 2 and "captured" in res.output, res.output
    assert set(seen["drafter"]) == drafter
    assert set(seen["train"]) == {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for part in seen.values() for k, v in part.items() if v is not None}
    assert given == {"method": "eagle3", "num_layers": 2, "tree_depth": 3, "mtp_recursive": False,
                     "feature_layers": (1, 2), "batch_size": 5, "fsdp": True, "data": "d", "lr": 0.5}
    # the real train_configs: EAGLE-3 has no MTP option (and no --layers: it has exactly one layer)
    for option, field, owner in (("--mtp-stacked", "mtp_recursive", "mtp"), ("--layers=2", "num_layers", "dflash")):
        res = run_cli("--out", str(tmp_path / "o"), "-m", "eagle3", option, "--data", "d")
        assert res.exit_code == 2 and f"{field} (a {owner} option)" in res.output and "eagle3" in res.output, res.output
    res = run_cli("--out", str(tmp_path / "o"), "-m", "eagle3", "--config", '{"drafter": {"markov_rank": 64}}', "--data", "d")
    assert res.exit_code == 2 and "markov_rank (a dspark option)" in res.output, res.output  # even at its default


def test_campaign_ledger_replays_exactly_what_the_run_drew(toy_method, tiny_target, data, tmp_path, monkeypatch):
    """scripts/campaign/campaign_data.py: the records a run drew, replayed from its provenance (seed, steps, batch,
    accumulation), are the ones the trainer batched; the next segment holds every other train record but
    those that open with a val prompt (a second turn gives a val prompt a new id)."""
    import importlib.util
    import sys

    import selfdraft.training.trainer as trainer

    spec = importlib.util.spec_from_file_location("campaign_data", "scripts/campaign/campaign_data.py")
    cd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cd)
    seen: list[list[int]] = []
    real = trainer.make_batch
    monkeypatch.setattr(trainer, "make_batch", lambda seqs, *a: (seen.extend(s.input_ids for s in seqs), real(seqs, *a))[1])
    dcfg, tcfg = cfgs(data, steps=5, batch_size=2, grad_accum=2, val_every=0, val_batches=0, seed=3)  # 20 of 24 drawn
    train(tiny_target, dcfg, tcfg, tmp_path / "run")
    recs, info = cd.drawn(tmp_path / "run", data)
    assert sorted(r["input_ids"][:32] for r in recs) == sorted(seen) and info["drawn"] == 20
    ledger = tmp_path / "ledger.json"
    monkeypatch.setattr(sys, "argv", ["campaign_data.py", "ledger", "--run", str(tmp_path / "run"), "--out", str(ledger)])
    assert cd.main() == 0
    (data / "manifest.json").write_text(json.dumps({"target": {"vocab_size": 96}}))
    from selfdraft.training.records import ShardWriter, load_records

    # a second source answered two turns: the one that opens with a val prompt must stay out of training
    val_prompt = load_records(data, "val")[0]["messages"][0]["content"]
    two = [{**load_records(data, "train")[0], "id": f"t{i}", "messages": [{"role": "user", "content": u} for u in (first, "and?")]}
           for i, first in enumerate((val_prompt, "a new prompt"))]
    ShardWriter(tmp_path / "turns2").write(two)
    monkeypatch.setattr(sys, "argv", ["campaign_data.py", "segment", "--from", str(data), "--from", str(tmp_path / "turns2"),
                                      "--ledger", str(ledger), "--vocab-size", "8", "--out", str(tmp_path / "seg")])
    assert cd.main() == 0
    left = load_records(tmp_path / "seg", "train")
    assert len(left) == 5 and not {r["id"] for r in left} & {r["id"] for r in recs} and "t0" not in {r["id"] for r in left}
    assert [r["id"] for r in load_records(tmp_path / "seg", "val")] == [r["id"] for r in load_records(data, "val")]


def test_the_final_validation_reaches_the_log_on_disk(toy_method, tiny_target, data, tmp_path):
    """A run whose last step is a save step but not a validation step validates once more at the end;
    that validation must be in train_log.jsonl (it was saved before the final validation ran)."""
    dcfg, tcfg = cfgs(data, steps=10, val_every=4, save_every=5)
    res = train(tiny_target, dcfg, tcfg, tmp_path / "out")
    log = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [v.step for v in res.val] == [4, 8, 10]
    assert [x["step"] for x in log if x["kind"] == "val"] == [4, 8, 10]


def test_shipping_a_segment_keeps_the_campaign_lineage(tmp_path):
    """scripts/campaign/ship_drafter.py: a run warm-started from the weights it replaces adds itself to their lineage;
    any other run (a fresh drafter, another source) ships without one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ship_drafter", "scripts/campaign/ship_drafter.py")
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    dst = tmp_path / "dspark"
    dst.mkdir()
    lineage = [{"segment": 0, "steps": 10, "tokens": 100}]
    (dst / "config.json").write_text(json.dumps({"provenance": {"campaign": lineage, "campaign_ledger": "ledger.json"}}))
    prov = {"steps": 5, "tokens": 50, "train": {"init_from": str(dst), "data": "seg", "lr": 1e-4}}
    ship.carry_lineage(prov, dst)
    assert [e["segment"] for e in prov["campaign"]] == [0, 1]
    assert prov["campaign"][1]["tokens"] == 50 and prov["campaign"][1]["started_from"] == "segment 0 (step 10)"
    assert prov["campaign_ledger"] == "ledger.json"
    fresh = {"steps": 5, "tokens": 50, "train": {"init_from": None}}
    ship.carry_lineage(fresh, dst)
    assert "campaign" not in fresh
    # a family's first segment: the weights it starts from had no lineage, so their own run becomes segment 0
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    (mtp / "config.json").write_text(json.dumps({"provenance": {"steps": 1432, "tokens": 800119, "train": {
        "init_from": "", "data": "work/data/regen-v1", "lr": 1e-3, "warmup_steps": 50, "token_budget": 800000}}}))
    first = {"steps": 7, "tokens": 70, "train": {"init_from": str(mtp), "data": "seg1", "lr": 1e-4}}
    ship.carry_lineage(first, mtp)
    assert [(e["segment"], e["tokens"]) for e in first["campaign"]] == [(0, 800119), (1, 70)]
    assert first["campaign"][0]["started_from"] == "random init"
    assert first["campaign"][1]["started_from"] == "segment 0 (step 1432)"
    assert first["campaign_ledger"].startswith("ledger.json")
