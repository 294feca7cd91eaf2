"""Training data pipeline: prompt sources, regeneration (batched, resumable), masks, features, vocab."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from selfdraft.config import SamplingParams
from selfdraft.target import Target
from selfdraft.training.draft_vocab import build_draft_vocab
from selfdraft.training.records import DataError, ShardWriter, iter_records, load_records, tokenize_conversation
from selfdraft.training.regenerate import RegenConfig, regenerate, sample_batch
from selfdraft.training.sources import Prompt, SourceStats, check_not_eval, collect_prompts, prompt_id, select_prompts, split_of
from selfdraft.vocab import DraftVocab
from selfdraft.training.features import (
    FeatureCache,
    FeatureSpec,
    compute_features,
    estimate_bytes,
    write_feature_cache,
)
from tests.helpers import needs_embedded, tiny_llama

needs_tokenizer = needs_embedded  # the embedded target's tokenizer and chat template


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


@pytest.fixture
def chat_target(tokenizer) -> Target:
    """A tiny random Llama speaking the real tokenizer's vocabulary and chat template."""
    target = Target(tiny_llama(vocab=len(tokenizer), hidden=16, layers=3, max_pos=512), tokenizer, "tiny-chat")
    target.eos_ids = {tokenizer.eos_token_id}
    return target


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ---------------------------------------------------------------- prompt sources


def test_jsonl_malformed_lines_skipped_and_counted(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [
        json.dumps({"turns": ["What is a monad?", "Give an example."]}),
        json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]}),
        '{"turns": ["cut mid-li',  # truncated line
        "not json at all",
        json.dumps({"prompt": "unknown shape"}),
        json.dumps({"messages": [{"role": "assistant", "content": "no user turn"}]}),
        json.dumps({"turns": ["   "]}),  # empty prompt
        json.dumps({"turns": ["What is a monad?", "Give an example."]}),  # duplicate
    ])
    prompts, stats = collect_prompts([str(src)], num_turns=2)
    assert stats.as_dict() == {"kept": 2, "malformed": 4, "empty": 1, "duplicates": 1, "too_long": 0}
    assert sorted(p.turns for p in prompts) == [["Hi", "Bye"], ["What is a monad?", "Give an example."]]
    first_only, _ = collect_prompts([str(src)], num_turns=1)
    assert sorted(p.turns for p in first_only) == [["Hi"], ["What is a monad?"]]


def test_truncated_sharegpt_json_decoded_record_by_record(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "only an answer"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"},
                                      {"from": "human", "value": "Q3"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Q4 will be cut off"}]},
    ]
    text = json.dumps(records, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index("Q4") + 3])  # cut mid-record, like the packaged file
    prompts, stats = collect_prompts([str(path)], num_turns=2)
    assert sorted(p.turns for p in prompts) == [["Q1"], ["Q2", "Q3"]]
    assert (stats.kept, stats.malformed) == (2, 2)  # "b" has no user turn; "d" is the cut tail


def test_empty_prompts_rejected(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"turns": [""]}), json.dumps({"turns": ["\n\t "]}),
                                             json.dumps({"messages": [{"role": "user", "content": ""}]})])
    prompts, stats = collect_prompts([str(src)])
    assert prompts == [] and stats.empty == 3


def test_overlong_prompts_filtered_with_count():
    prompts = [Prompt(prompt_id([t]), "x", [t], "train") for t in ["a" * n for n in (5, 50, 8, 80, 3)]]
    prompts.sort(key=lambda p: p.id)
    stats = SourceStats(kept=5)
    chosen = select_prompts(prompts, lambda p: len(p.turns[0]), max_prompt_tokens=10, limit=None, stats=stats)
    assert sorted(len(p.turns[0]) for p in chosen) == [3, 5, 8]
    assert (stats.kept, stats.too_long) == (3, 2)
    limited = select_prompts(prompts, lambda p: len(p.turns[0]), 10, limit=1, stats=SourceStats())
    assert len(limited) == 1


def test_split_is_a_stable_function_of_the_prompt():
    ids = [prompt_id([f"prompt {i}"]) for i in range(2000)]
    splits = [split_of(i, 0.05) for i in ids]
    assert splits == [split_of(i, 0.05) for i in ids]
    assert 0.03 < splits.count("val") / len(ids) < 0.07
    assert all(split_of(i, 0.0) == "train" for i in ids)
    first = sorted(ids)[:200]  # a small sample in id order (how prompts are selected) is still mixed
    assert 0 < [split_of(i, 0.05) for i in first].count("val") < 30


@pytest.mark.parametrize("where", ["component", "component-symlink", "bundled", "copy"])
def test_evaluation_prompts_refused(tmp_path, where):
    import selfdraft.training.sources as sources

    bundled = Path(sources.__file__).resolve().parents[1] / "bench" / "prompts"
    path = {
        "component": tmp_path / "data" / "eval" / "mine.jsonl",
        "component-symlink": tmp_path / "data" / "eval" / "link.jsonl",  # resolves outside data/eval
        "bundled": bundled / "mt-bench.jsonl",
        "copy": tmp_path / "elsewhere" / "prompts.jsonl",  # the bytes of a bundled file, renamed
    }[where]
    if where == "component-symlink":
        (tmp_path / "real.jsonl").write_text(json.dumps({"turns": ["hi"]}) + "\n")
        path.parent.mkdir(parents=True)
        path.symlink_to(tmp_path / "real.jsonl")
    if where == "copy":
        path.parent.mkdir(parents=True)
        path.write_bytes((bundled / "qa.jsonl").read_bytes())
    with pytest.raises(DataError, match="evaluation"):
        check_not_eval(path)
    if where == "component":
        path.parent.mkdir(parents=True)
        write_jsonl(path, [json.dumps({"turns": ["hi"]})])
        with pytest.raises(DataError, match="evaluation"):
            collect_prompts([str(path)])
    # Neighbours are fine: another file, a different file of a bundled file's size, an "eval" dir elsewhere.
    check_not_eval(tmp_path / "data" / "train.jsonl")
    check_not_eval(tmp_path / "eval" / "x.jsonl")
    near = tmp_path / "near.jsonl"
    near.write_bytes(b"x" * (bundled / "qa.jsonl").stat().st_size)
    check_not_eval(near)


# ---------------------------------------------------------------- assistant mask


def masked_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


@needs_tokenizer
def test_assistant_mask_covers_exactly_the_assistant_tokens(tokenizer):
    msgs = [
        {"role": "user", "content": "Name two primes."},
        {"role": "assistant", "content": "2 and 3.\n\nBoth are prime."},
        {"role": "user", "content": "And a third?"},
        {"role": "assistant", "content": "5 ```code``` <b>bold</b>"},
    ]
    conv = tokenize_conversation(tokenizer, msgs)
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert conv.input_ids == tokenizer(full, add_special_tokens=False)["input_ids"]  # same as the template
    assert len(conv.loss_mask) == len(conv.input_ids)
    spans = masked_spans(conv.input_ids, conv.loss_mask)
    end = tokenizer.eos_token  # <|im_end|>
    assert [tokenizer.decode(s) for s in spans] == [m["content"] + end for m in msgs if m["role"] == "assistant"]
    assert "assistant" not in "".join(tokenizer.decode(s) for s in spans)  # never the role header


@needs_tokenizer
def test_truncated_last_answer_gets_no_end_token(tokenizer):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 4"}]
    conv = tokenize_conversation(tokenizer, msgs, open_last=True)
    prompt = tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(conv.input_ids) == prompt + "1 2 3 4"
    assert [tokenizer.decode(s) for s in masked_spans(conv.input_ids, conv.loss_mask)] == ["1 2 3 4"]


@needs_tokenizer
def test_sampled_answer_ids_are_kept_verbatim(tokenizer):
    """The target may sample a non-canonical tokenization; the record keeps exactly its ids."""
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "hello"]  # canonical would be one token
    msgs = [{"role": "user", "content": "Greet."}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "Again."}]
    conv = tokenize_conversation(tokenizer, msgs, answer_ids={1: spelled}, generation_prompt=True)
    prompt = tokenizer(tokenizer.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]
    assert conv.input_ids[: len(prompt) + 6] == prompt + spelled + [tokenizer.eos_token_id]
    assert masked_spans(conv.input_ids, conv.loss_mask) == [spelled + [tokenizer.eos_token_id]]
    assert tokenizer.decode(conv.input_ids).endswith("<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------- regeneration


def test_batched_sampling_equals_one_by_one():
    """Left padding + mask + positions + dropping finished rows must not change any row (greedy, fp32)."""
    target = Target(tiny_llama(vocab=64, layers=2))
    target.eos_ids = {7}
    prompts = [[5, 9, 11], [3] * 9, [20, 21], [1, 2, 3, 4, 5, 6]]
    alone = [sample_batch(target, [p], SamplingParams(), 12)[0] for p in prompts]
    together = sample_batch(target, prompts, SamplingParams(), 12)
    assert together == alone
    assert all(len(r) == 12 or r[-1] == 7 for r in together)
    assert any(r[-1] == 7 for r in together)  # some rows really finish early and leave the batch


def prompt_file(tmp_path: Path, n: int) -> list[Prompt]:
    src = write_jsonl(tmp_path / "prompts.jsonl", [json.dumps({"turns": [f"Question number {i}?" + " more" * (i % 4),
                                                                          f"Follow-up {i}"]}) for i in range(n)])
    prompts, _ = collect_prompts([str(src)], num_turns=2, val_fraction=0.2)
    return prompts


@needs_tokenizer
def test_resume_after_kill_loses_and_duplicates_nothing(tmp_path, chat_target):
    prompts = prompt_file(tmp_path, 7)
    cfg = RegenConfig(max_new_tokens=4, batch_size=2, shard_size=3, num_turns=2)
    reference = regenerate(chat_target, prompts, tmp_path / "ref", cfg, progress=False)
    assert reference.written == 7

    out = tmp_path / "killed"
    first = regenerate(chat_target, prompts, out, cfg, progress=False, stop_after_batches=2)
    assert first.written == 4
    last = sorted(out.glob("shard-*.jsonl"))[-1]
    with open(last, "a") as f:
        f.write('{"id": "half-written rec')  # killed mid-line
    with pytest.warns(UserWarning, match="dropped 1 half-written line"):
        second = regenerate(chat_target, prompts, out, cfg, progress=False)
    assert (second.written, second.skipped_done) == (3, 4)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no malformed line may remain
        got = load_records(out)
    ids = [r["id"] for r in got]
    assert len(ids) == len(set(ids)) == 7 and set(ids) == {p.id for p in prompts}
    assert sorted(got, key=lambda r: r["id"]) == sorted(load_records(tmp_path / "ref"), key=lambda r: r["id"])
    assert len(list(out.glob("shard-*.jsonl"))) == 3  # shard_size 3 -> 3 + 3 + 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["runs"]) == 2
    totals = manifest["totals"]
    assert totals["train"]["records"] + totals["val"]["records"] == 7
    for split in ("train", "val"):
        assert [r["id"] for r in load_records(out, split)] == [r["id"] for r in got if r["split"] == split]


@needs_tokenizer
def test_regenerated_records_follow_the_contract(tmp_path, chat_target, tokenizer):
    prompts = prompt_file(tmp_path, 3)
    regenerate(chat_target, prompts, tmp_path / "d", RegenConfig(max_new_tokens=3, batch_size=3, num_turns=2),
               progress=False)
    for rec in iter_records(tmp_path / "d"):
        assert set(rec) == {"id", "split", "source", "messages", "input_ids", "loss_mask"}
        assert rec["messages"][0]["role"] == "user" and rec["messages"][1]["role"] == "assistant"
        # a random tiny model never says <|im_end|> within 3 tokens: the first answer is cut, so the
        # conversation stops there and the mask covers exactly the 3 sampled tokens
        assert len(rec["messages"]) == 2 and sum(rec["loss_mask"]) == 3
        assert rec["loss_mask"][-3:] == [1, 1, 1]
        templ = tokenizer.apply_chat_template(rec["messages"][:1], add_generation_prompt=True, tokenize=False)
        assert tokenizer.decode(rec["input_ids"]).startswith(templ)
    totals = json.loads((tmp_path / "d" / "manifest.json").read_text())["totals"]
    assert sum(t["cut_answers"] for t in totals.values()) == sum(t["records"] for t in totals.values()) == 3


@needs_tokenizer
def test_resume_refuses_other_sampling(tmp_path, chat_target):
    prompts = prompt_file(tmp_path, 2)
    regenerate(chat_target, prompts, tmp_path / "d", RegenConfig(max_new_tokens=2), progress=False)
    with pytest.raises(DataError, match="another target or sampling"):
        regenerate(chat_target, prompts, tmp_path / "d", RegenConfig(max_new_tokens=2, temperature=1.0),
                   progress=False)


def test_iter_records_skips_malformed_lines_with_a_warning(tmp_path):
    good = {"id": "a", "split": "train", "source": "s", "messages": [], "input_ids": [1, 2], "loss_mask": [0, 1]}
    write_jsonl(tmp_path / "shard-00000.jsonl", [
        json.dumps(good),
        json.dumps({**good, "id": "b", "loss_mask": [1]}),  # length mismatch
        json.dumps({**good, "id": "c", "split": "test"}),
        '{"id": "d", "split": "tr',
    ])
    with pytest.warns(UserWarning, match="skipped 3 malformed"):
        assert [r["id"] for r in iter_records(tmp_path)] == ["a"]
    with pytest.raises(DataError, match="no shard"):
        list(iter_records(tmp_path / "empty"))


# ---------------------------------------------------------------- draft vocabulary


def test_draft_vocab_counts_assistant_tokens_only(tmp_path):
    writer = ShardWriter(tmp_path)
    rec = {"split": "train", "source": "s", "messages": []}
    writer.write([
        {**rec, "id": "1", "input_ids": [9, 9, 9, 9, 4, 4, 7], "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
        {**rec, "id": "2", "input_ids": [4, 2, 2, 5], "loss_mask": [1, 1, 1, 0]},
        {**rec, "id": "3", "split": "val", "input_ids": [8, 8, 8], "loss_mask": [1, 1, 1]},
    ])
    vocab = build_draft_vocab(tmp_path, size=3, vocab_size=12)
    # assistant counts (train): 4 x3, 2 x2, 9 x1, 7 x1 -> top 3 = {4, 2, 7} (tie 7 vs 9: lower id)
    assert vocab.target_ids.tolist() == [2, 4, 7]
    assert vocab.d2t.tolist() == [2, 3, 5] and vocab.d2t.dtype == torch.long
    assert vocab.t2d.nonzero().squeeze(-1).tolist() == [2, 4, 7] and vocab.t2d.dtype == torch.bool
    assert vocab.coverage == pytest.approx(6 / 7)
    loaded = DraftVocab.load(tmp_path / "draft_vocab_3.safetensors")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    assert loaded.coverage == pytest.approx(vocab.coverage, abs=1e-6)


# ---------------------------------------------------------------- features


def direct_states(target: Target, ids: torch.Tensor, layers: tuple[int, ...]):
    out = target.model(ids, output_hidden_states=True)
    return torch.stack([out.hidden_states[i + 1][0] for i in layers], dim=1), out.logits[0]


def test_features_equal_the_targets_hidden_states():
    target = Target(tiny_llama(layers=5))
    ids = torch.randint(0, 96, (1, 23))
    layers = (0, 2, 3)
    feats, last = compute_features(target, ids, layers)
    assert feats.shape == (23, 3, 32) and last.shape == (23, 32)
    hidden, logits = direct_states(target, ids, layers)
    torch.testing.assert_close(feats, hidden)
    torch.testing.assert_close(target.lm_head(last), logits)  # last_hidden is after the final norm


@needs_tokenizer
def test_feature_cache_round_trip_and_resume(tmp_path, chat_target):
    data = tmp_path / "d"
    regenerate(chat_target, prompt_file(tmp_path, 5), data, RegenConfig(max_new_tokens=6, batch_size=5), progress=False)
    spec = FeatureSpec(feature_layers=(0, 1), shard_tokens=60)
    out = tmp_path / "f"
    index = write_feature_cache(chat_target, data, out, spec, progress=False)
    assert len(index["shards"]) > 1 and index["records"] == 5
    files = list(out.glob("shard-*.safetensors"))
    stored = sum(f.stat().st_size for f in files)
    assert abs(stored - estimate_bytes(data, chat_target, spec)) < 0.1 * stored + 2000 * len(files)  # + headers

    cache = FeatureCache(out)
    cache.check_target(chat_target)
    by_id = {r["id"]: r for r in iter_records(data)}
    for i in range(len(cache)):
        seq = cache[i]
        rec = by_id[seq.id]
        assert seq.input_ids.tolist() == rec["input_ids"] and seq.loss_mask.int().tolist() == rec["loss_mask"]
        feats, last = compute_features(chat_target, seq.input_ids[None], (0, 1))
        torch.testing.assert_close(seq.features, feats.to(torch.bfloat16))
        torch.testing.assert_close(seq.last_hidden, last.to(torch.bfloat16))
        lse = torch.logsumexp(chat_target.lm_head(seq.last_hidden.to(last.dtype)).float(), -1)  # p_t's log-partition
        torch.testing.assert_close(seq.lse, lse)
        assert seq.features.dtype == torch.bfloat16 and seq.features.shape[1:] == (2, 16)

    first_shard = (out / "shard-00000.safetensors").stat().st_mtime_ns
    (out / "index.json").unlink()
    (sorted(files)[-1]).unlink()  # a killed run: last shard missing
    again = write_feature_cache(chat_target, data, out, spec, progress=False)
    assert again["records"] == 5 and (out / "shard-00000.safetensors").stat().st_mtime_ns == first_shard
    with pytest.raises(DataError, match="another target"):
        write_feature_cache(chat_target, data, out, FeatureSpec(feature_layers=(1,)), progress=False)


@pytest.mark.slow
def test_embedded_target_features_equal_hidden_states(embedded_fp32):
    ids = torch.tensor([embedded_fp32.encode_prompt("Explain speculative decoding in one sentence.")])
    layers = embedded_fp32.default_feature_layers()
    feats, last = compute_features(embedded_fp32, ids, layers)
    hidden, logits = direct_states(embedded_fp32, ids, layers)
    torch.testing.assert_close(feats, hidden)
    torch.testing.assert_close(embedded_fp32.lm_head(last), logits)


def test_hf_dataset_source_reads_a_local_dataset(monkeypatch):
    import sys
    import types

    rows = [{"messages": [{"role": "user", "content": "from hf"}]}, {"text": "no conversation"}]
    calls = []

    def load_dataset(name, split, download_mode):
        calls.append((name, split))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    prompts, stats = collect_prompts(["hf:local/chats:train"])
    assert [p.turns for p in prompts] == [["from hf"]] and prompts[0].source == "hf:local/chats:train"
    assert (stats.kept, stats.malformed) == (1, 1) and calls == [("local/chats", "train")]


@pytest.mark.slow
def test_data_cli_end_to_end(tmp_path):
    """regenerate (embedded target) -> vocab -> features through the CLI; eval files refused."""
    from typer.testing import CliRunner

    from selfdraft.cli import app

    src = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"turns": ["Say hi."]}), json.dumps({"turns": ["Say bye."]})])
    data, feats = tmp_path / "d", tmp_path / "f"
    regen = ["data", "regenerate", str(src), "--out", str(data), "-n", "4", "-b", "2", "--threads", "1"]
    runner = CliRunner()
    res = runner.invoke(app, regen)
    assert res.exit_code == 0, res.output
    assert len(load_records(data)) == 2
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["command"].startswith("selfdraft ") and manifest["sampling"]["temperature"] == 0.7
    assert manifest["config"]["max_new_tokens"] == 4 and manifest["sources"] == [str(src)]
    res = runner.invoke(app, ["data", "vocab", str(data), "--size", "64"])
    assert res.exit_code == 0 and (data / "draft_vocab_64.safetensors").exists(), res.output
    res = runner.invoke(app, ["data", "features", str(data), "--out", str(feats), "--feature-layers", "1,27"])
    assert res.exit_code == 0, res.output
    assert FeatureCache(feats)[0].features.shape[1:] == (2, 576)
    evals = tmp_path / "data" / "eval"
    evals.mkdir(parents=True)
    write_jsonl(evals / "alpaca.jsonl", [json.dumps({"turns": ["hi"]})])
    res = runner.invoke(app, ["data", "regenerate", str(evals / "alpaca.jsonl"), "--out", str(data)])
    assert res.exit_code == 2 and "evaluation" in res.output


@needs_tokenizer
def test_a_killed_regeneration_run_stays_in_manifest_runs(tmp_path, chat_target, monkeypatch):
    """A run is recorded at its start and after each batch: a kill (here: an exception after two
    batches, so nothing of regenerate's own ending runs) leaves it as "running" with what it wrote;
    the next run marks it "killed" and adds itself."""
    import selfdraft.training.regenerate as data_mod

    prompts = prompt_file(tmp_path, 6)
    cfg = RegenConfig(max_new_tokens=3, batch_size=2, shard_size=3, num_turns=1)
    real, calls = data_mod.answer_batch, []

    def dies_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("kill -9")
        return real(*args, **kwargs)

    monkeypatch.setattr(data_mod, "answer_batch", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        regenerate(chat_target, prompts, tmp_path / "out", cfg, progress=False)
    runs = json.loads((tmp_path / "out" / "manifest.json").read_text())["runs"]
    assert len(runs) == 1 and runs[0]["status"] == "running" and runs[0]["written"] == 4
    monkeypatch.setattr(data_mod, "answer_batch", real)
    regenerate(chat_target, prompts, tmp_path / "out", cfg, progress=False)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["killed", "finished"]
    assert [r["written"] for r in manifest["runs"]] == [4, 2] and manifest["complete"]
    assert manifest["wall_time_s"] == pytest.approx(sum(r["wall_s"] for r in manifest["runs"]))


@needs_tokenizer
def test_original_answers_import_is_masked_split_and_resumable(tmp_path, chat_target):
    """`data original`: first exchanges of a ShareGPT-style file become records whose loss mask covers
    exactly the original answer (+ end of turn); malformed records and duplicates are counted; a rerun
    adds only what is missing; the feature cache then gives every position the target's log-partition."""
    from selfdraft.training.original import SOURCE, import_original

    convs = [{"conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": f"Answer number {i}."}]}
             for i in range(6)]
    convs += [{"conversations": [{"from": "gpt", "value": "no user turn"}]}, convs[0]]  # malformed, duplicate
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(convs))
    out = tmp_path / "orig"
    first = import_original(chat_target, out, limit=4, source=str(src), progress=False)
    assert (first.written, first.duplicates, first.malformed) == (4, 1, 1)
    again = import_original(chat_target, out, limit=6, source=str(src), progress=False)
    assert (again.written, again.skipped_existing) == (2, 4)
    recs = load_records(out)
    assert len(recs) == 6 and {r["source"] for r in recs} == {SOURCE}
    for r in recs:
        answer = [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
        text = chat_target.tokenizer.decode(answer[:-1])
        assert text == r["messages"][1]["content"] and answer[-1] == chat_target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    index = write_feature_cache(chat_target, out, tmp_path / "f", FeatureSpec(feature_layers=(1,)), progress=False)
    assert index["records"] == 6 and FeatureCache(tmp_path / "f")[0].lse is not None


def test_exclude_skips_the_prompts_a_campaign_ledger_holds(tmp_path):
    """`data regenerate --exclude ledger.json --exclude DIR`: prompts already trained on (by source:id), or
    answered in another dataset, are not answered again; others, and the same prompt from another source,
    are kept; `--part 0/2` and `1/2` split the rest between two processes; a bad ledger or part is exit 2."""
    from typer.testing import CliRunner

    from selfdraft.cli import app
    from selfdraft.training.sources import drop_trained, read_ledger, take_part

    ps = [Prompt(prompt_id([t]), "sharegpt", [t], "train") for t in ("a", "b", "c")]
    other = Prompt(ps[0].id, "other.jsonl", ["a"], "train")
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"records": [f"sharegpt:{ps[0].id}", f"sharegpt:{ps[2].id}"]}))
    kept, dropped = drop_trained(ps + [other], read_ledger(ledger))
    assert [p.turns for p in kept] == [["b"], ["a"]] and kept[1].source == "other.jsonl" and dropped == 2
    # a dataset directory holds the prompts answered (not yet trained on): its keys exclude them too
    ShardWriter(tmp_path / "answered").write([{"id": ps[1].id, "source": "sharegpt", "split": "train",
                                               "messages": [], "input_ids": [1, 2], "loss_mask": [0, 1]}])
    assert read_ledger(tmp_path / "answered") == {f"sharegpt:{ps[1].id}"}
    kept, dropped = drop_trained(ps, read_ledger(ledger) | read_ledger(tmp_path / "answered"))
    assert kept == [] and dropped == 3
    many = [Prompt(prompt_id([str(i)]), "sharegpt", [str(i)], "train") for i in range(40)]
    parts = [take_part(many, f"{i}/2") for i in (0, 1)]
    assert sorted(p.id for part in parts for p in part) == sorted(p.id for p in many) and not {p.id for p in parts[0]} & {p.id for p in parts[1]}
    assert parts[0] and parts[1] and take_part(many[5:], "1/2") == [p for p in parts[1] if p in many[5:]]  # a part stays put
    src = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"turns": ["Say hi."]})])
    for bad_part in ("2/2", "1", "a/b"):
        res = CliRunner().invoke(app, ["data", "regenerate", str(src), "--out", str(tmp_path / "d"), "--part", bad_part])
        assert res.exit_code == 2 and "--part takes I/N" in res.output, res.output
    for bad in (tmp_path / "missing.json", write_jsonl(tmp_path / "bad.json", ["[1, 2]"])):
        res = CliRunner().invoke(app, ["data", "regenerate", str(src), "--out", str(tmp_path / "d"), "--exclude", str(bad)])
        assert res.exit_code == 2 and "campaign ledger" in res.output, res.output
        assert not (tmp_path / "d").exists()
