"""Synthesized training data: near-duplicate search (against brute force), the gates, bad input,
resume after a kill, follow-up turns and their loss mask."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from selfdraft.target import Target
from selfdraft.target_loading import cache_root
from selfdraft.training.records import DataError, ShardWriter, load_records
from selfdraft.training.regenerate import RegenConfig
from selfdraft.training.synthesize.config import GateConfig, SynthConfig
from selfdraft.training.synthesize.domains import DOMAINS, resolve_domains
from selfdraft.training.synthesize.gates import GateCounts, PromptGates, is_garbage, is_language
from selfdraft.training.synthesize.loop import LOG, ChatTemplate, SynthesisLog, synthesize
from selfdraft.training.synthesize.neardup import NearDupIndex, normalize
from selfdraft.training.synthesize.references import eval_prompts, excluded_prompts, excluded_turns
from tests.helpers import tiny_llama

EMBEDDED_DIR = cache_root() / "targets" / "smollm2-135m-instruct"
needs_tokenizer = pytest.mark.skipif(not EMBEDDED_DIR.exists(), reason="embedded target not converted yet")
WORDS = ("the cat sat on a mat while dog ran to see what python code sorts lists of primes fast "
         "how do i write function that adds two numbers in math problem solve x").split()


# ---------------------------------------------------------------- near-duplicate search


def brute_jaccard(a: str, b: str, n: int = 3) -> float:
    """The obviously correct reference: word n-gram sets as Python sets of strings."""
    def grams(t):
        w = normalize(t).split()
        return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)} or {" ".join(w)}
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def corpus(rng: random.Random, size: int) -> list[str]:
    """Random short texts over a small vocabulary, a third of them edited copies of earlier ones."""
    texts = []
    for _ in range(size):
        if texts and rng.random() < 0.5:
            words = rng.choice(texts).split()
            for _ in range(rng.randint(0, 3)):  # a few edits: replace, insert or delete a word
                i = rng.randrange(len(words))
                op = rng.choice("rid")
                if op == "r":
                    words[i] = rng.choice(WORDS)
                elif op == "i":
                    words.insert(i, rng.choice(WORDS))
                elif len(words) > 1:
                    del words[i]
        else:
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 25))]
        texts.append(" ".join(words))
    return texts


@pytest.mark.parametrize("threshold", [0.4, 0.7, 0.9, 1.0])
def test_near_duplicate_search_equals_brute_force(threshold):
    """The prefix-filtered index finds exactly the pairs a full scan finds, for prompts indexed at
    construction and for prompts added later (they share the index's fixed n-gram order)."""
    rng = random.Random(int(threshold * 10))
    texts = corpus(rng, 300)
    index = NearDupIndex(texts[:150], threshold)
    for t in texts[150:250]:
        index.add(t)
    found_any = 0
    for q in texts[200:]:
        want = {i for i, t in enumerate(texts[:250]) if brute_jaccard(q, t) >= threshold - 1e-12}
        got = {m.index for m in index.matches(q)}
        assert got == want, (q, sorted(want - got), sorted(got - want))
        for m in index.matches(q):
            assert m.similarity == pytest.approx(brute_jaccard(q, texts[m.index]))
        found_any += bool(want - {texts.index(q)})
    assert found_any >= 5  # the corpus really has near-duplicates to find


def test_exact_duplicates_ignore_case_and_punctuation():
    index = NearDupIndex(["How do I sort a list?"])
    assert index.find_exact("how do i SORT a list") == 0 and index.find_exact("How do I sort a dict?") is None
    assert index.best("How do I sort a list, please?").similarity == pytest.approx(4 / 5)  # 3-grams: 4 shared of 5
    assert index.best("How do I sort a dict, please?") is None  # 3 shared of 6: 0.5


# ---------------------------------------------------------------- gates


def gates(eval_texts=("Write a python function to find the volume of a triangular prism.",), excluded=()) -> PromptGates:
    cfg = GateConfig()
    return PromptGates(cfg, NearDupIndex(list(eval_texts), cfg.near_dup), NearDupIndex(list(excluded), cfg.near_dup))


def test_each_gate_removes_its_kind_and_counts_it():
    g = gates(excluded=["What is the capital of France and why is it famous?"])
    cases = [
        ("An unfinished prompt that ran past the token budget", 128, False, "cut"),
        ("Hi", 1, True, "too_short"),
        ("🎹💡💚💋👉👕👥👦👶👷👸👹 hello", 20, True, "garbage"),
        ("buy now " * 12, 24, True, "garbage"),  # a sampling loop
        ("Расскажите мне о погоде в Москве сегодня вечером", 20, True, "language"),
        ("Write a Python function to find the volume of a triangular prism", 14, True, "eval"),
        ("what is the capital of France, and why is it famous", 13, True, "duplicate"),
        ("What is the capital of France and why is it so famous?", 14, True, "near_duplicate"),
        ("How do I reverse a linked list in C without recursion?", 14, True, "kept"),
    ]
    counts = GateCounts()
    for text, n, finished, want in cases:
        got = g.check(text, n, finished)
        assert got == want, text
        counts.count(got)
        if got == "kept":
            g.keep(text)
    assert g.check("How do I reverse a linked list in C without any recursion?", 15, True) == "near_duplicate"
    assert g.check("How do I reverse a linked list in C without any recursion?", 15, True, first_turn=False) == "kept"
    assert counts.kept == 1 and counts.sampled == len(cases)
    assert counts.removed == {"cut": 1, "too_short": 1, "garbage": 2, "language": 1, "eval": 1, "duplicate": 1,
                              "near_duplicate": 1}
    assert "near_duplicate  -1" in counts.table("first turns")


def test_code_and_math_prompts_are_not_garbage():
    cfg = GateConfig()
    for text in ["Add 10% to all values in a list.\nList: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]",
                 "Solve for x: 3x^2 - 5x + 2 = 0. Show each step.",
                 "Why does `for (int i = 0; i < n; i++) { a[i] = b[i] * 2; }` segfault?",
                 "Solve 8x - 11 = 3x - 2 using linear equations."]:  # removed as "language" before numbers stopped counting
        assert not is_garbage(text, cfg) and is_language(text, "en"), text
    assert is_language("Расскажите мне о погоде", "any")


def test_references_read_datasets_ledgers_and_eval_dirs(tmp_path):
    ShardWriter(tmp_path / "ds").write([{"id": "a", "split": "train", "source": "p.jsonl", "input_ids": [1], "loss_mask": [1],
                                         "messages": [{"role": "user", "content": "Q one"}, {"role": "assistant", "content": "A"},
                                                      {"role": "user", "content": "Q two"}]}])
    assert excluded_prompts(str(tmp_path / "ds")) == ["Q one", "Q two"]
    src = tmp_path / "mine.jsonl"
    src.write_text(json.dumps({"turns": ["first", "second"]}) + "\n")
    assert excluded_prompts(str(src)) == ["first", "second"]
    ledger = tmp_path / "ledger.json"
    ledger.write_text(json.dumps({"records": ["synth-chat:0123456789abcdef"]}))
    with pytest.raises(DataError, match="cannot be read here"):
        excluded_prompts(str(ledger))
    # the synthesized source's own directory beside the ledger covers it (the campaign's exclude after a
    # segment on synthesized prompts): read from the directory, not by name
    ShardWriter(tmp_path / "synth").write([{"id": "0123456789abcdef", "split": "train", "source": "synth-chat",
                                            "input_ids": [1], "loss_mask": [1],
                                            "messages": [{"role": "user", "content": "Q synth"}, {"role": "assistant", "content": "A"}]}])
    assert excluded_turns([str(ledger), str(tmp_path / "synth"), str(src)]) == ["Q synth", "first", "second"]
    with pytest.raises(DataError, match="cannot be read here"):
        excluded_turns([str(ledger), str(tmp_path / "ds")])  # a directory of another source does not cover it
    evals = tmp_path / "evalsets"
    (evals / "sub").mkdir(parents=True)
    (evals / "sub" / "x.jsonl").write_text(json.dumps({"turns": ["an eval question"]}) + "\n")
    texts, labels = eval_prompts([evals])
    bundled, _ = eval_prompts([])
    assert texts[-1] == "an eval question" and labels[-1] == "x.jsonl" and len(texts) == len(bundled) + 1
    assert len(bundled) > 2000  # every bundled benchmark, every turn


# ---------------------------------------------------------------- bad input


def test_domains_topics_and_system_resolve(tmp_path):
    from selfdraft.config import ConfigError

    with pytest.raises(ConfigError, match="unknown --domain 'poetry'"):
        resolve_domains(["chat", "poetry"], None, None)
    empty = tmp_path / "topics.txt"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(DataError, match="holds no topics"):
        resolve_domains(["code"], empty, None)
    mine = tmp_path / "mine.txt"
    mine.write_text("tax law  # a comment\nsailing\n")
    (chat,) = resolve_domains(["chat"], mine, None)
    assert chat.topics == ("tax law", "sailing") and "{topic}" in chat.system
    assert resolve_domains(["chat"], None, None)[0].system is None  # plain Magpie: the template's header alone
    (code,) = resolve_domains(["code"], None, "Ask about {topic} in Rust.")
    assert code.steering("traits") == "Ask about traits in Rust." and code.topics == DOMAINS["code"].topics


@needs_tokenizer
def test_bad_input_is_one_line_and_exit_2(tmp_path):
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    from selfdraft.cli import app

    bare = tmp_path / "no-template"
    tiny_llama(vocab=49152, hidden=16, layers=1).save_pretrained(bare)
    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    tok.chat_template = None
    tok.save_pretrained(bare)
    (tmp_path / "empty.txt").write_text("\n")
    out = ["--out", str(tmp_path / "d"), "--limit", "2", "--threads", "1"]
    for args, msg in [
        (["--domain", "poetry"], "unknown --domain 'poetry'"),
        (["--topics", str(tmp_path / "empty.txt")], "holds no topics"),
        (["--topics", str(tmp_path / "missing.txt")], "missing.txt"),
        (["--target", str(bare)], "has no chat template"),
    ]:
        res = CliRunner().invoke(app, ["data", "synthesize", *out, *args])
        assert res.exit_code == 2 and msg in res.output, res.output
        lines = [line for line in res.output.splitlines() if not line.startswith("gates: ")]  # the progress note
        assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert not (tmp_path / "d" / LOG).exists()


# ---------------------------------------------------------------- the loop


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(EMBEDDED_DIR)


@pytest.fixture
def talker(tokenizer) -> Target:
    return make_talker(tokenizer)


def make_talker(tokenizer) -> Target:
    """A tiny random Llama with the real tokenizer and template, its head biased towards a few
    words and the end-of-turn token: it writes short word salads and ends its turns."""
    model = tiny_llama(vocab=len(tokenizer), hidden=16, layers=2, max_pos=1024)
    head = torch.nn.Linear(16, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.normal_(0, 0.5)
        head.bias.fill_(-4.0)
        words = {i for w in WORDS for i in tokenizer(" " + w, add_special_tokens=False)["input_ids"]}
        head.bias[sorted(words)] = 3.0
        head.bias[tokenizer.convert_tokens_to_ids("<|im_end|>")] = 5.0  # p(end) ~ 0.08 a token
    model.lm_head = head
    target = Target(model, tokenizer, "tiny-talker")
    target.eos_ids = {tokenizer.eos_token_id}
    return target


def run(target, out, limit=10, turns=1, gate_cfg=GateConfig(language="any", min_prompt_tokens=2), **kw):
    cfg = SynthConfig(domains=(DOMAINS["chat"], DOMAINS["code"]), max_prompt_new_tokens=24, val_fraction=0.3, gates=gate_cfg)
    regen = RegenConfig(max_new_tokens=12, batch_size=4, shard_size=4, num_turns=turns)
    g = PromptGates(gate_cfg, NearDupIndex([], gate_cfg.near_dup), NearDupIndex([], gate_cfg.near_dup))
    return synthesize(target, out, limit, cfg, regen, g, progress=False, **kw)


@needs_tokenizer
def test_a_killed_synthesis_loses_and_duplicates_nothing(tmp_path, talker, monkeypatch):
    """Killed after two batches (a half-written shard line and log line left behind), then killed again
    between a batch's records and its log line: the reruns end with the records and the log of an
    uninterrupted run, byte for byte in content."""
    ref = run(talker, tmp_path / "ref")
    assert ref.kept == 10 and ref.first.sampled > 10  # the gates removed some
    out = tmp_path / "killed"
    first = run(talker, out, stop_after_batches=2)
    assert 0 < first.kept < 10
    with open(sorted(out.glob("shard-*.jsonl"))[-1], "a") as f:
        f.write('{"id": "half-written rec')
    with open(out / LOG, "a") as f:
        f.write('{"batch": 2, "prom')
    real_append, calls = SynthesisLog.append, []

    def dies_before_logging(self, batch, prompts):
        calls.append(batch)
        if len(calls) == 1:
            raise KeyboardInterrupt("kill -9")  # the batch's records are written, its log line is not
        return real_append(self, batch, prompts)

    monkeypatch.setattr(SynthesisLog, "append", dies_before_logging)
    with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning, match="half-written"):
        run(talker, out)
    monkeypatch.setattr(SynthesisLog, "append", real_append)
    last = run(talker, out)
    assert last.kept == 10
    by_id = lambda recs: sorted(recs, key=lambda r: r["id"])  # noqa: E731
    assert by_id(load_records(out)) == by_id(load_records(tmp_path / "ref"))
    assert SynthesisLog(out).batches == SynthesisLog(tmp_path / "ref").batches
    assert last.first.as_dict() == ref.first.as_dict()  # counts replayed from the log over all runs
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and [r["status"] for r in manifest["runs"]] == ["finished", "killed", "finished"]
    assert manifest["gates"]["first_turn"]["kept"] == 10 and manifest["synthesis"]["domains"][1]["name"] == "code"
    assert {r["source"] for r in load_records(out)} == {"synth-chat", "synth-code"}
    assert {r["split"] for r in load_records(out)} == {"train", "val"}
    assert run(talker, out).written == 0  # done: a rerun writes nothing
    more = run(talker, out, limit=14)  # a larger --limit extends the dataset
    assert more.kept == 14 and len(load_records(out)) == 14


@needs_tokenizer
def test_resume_refuses_other_synthesis_settings(tmp_path, talker):
    run(talker, tmp_path / "d", limit=2)
    with pytest.raises(DataError, match="other domains, topics or prompt settings"):
        run(talker, tmp_path / "d", limit=2, gate_cfg=GateConfig(language="any", min_prompt_tokens=3))


@needs_tokenizer
def test_follow_up_turns_train_each_answer_once(tmp_path, talker, tokenizer):
    """--turns 3: the target writes the follow-ups; a record's loss mask covers exactly its answers
    (content + end of turn), never the user turns it wrote, and each conversation is one record."""
    s = run(talker, tmp_path / "d", limit=8, turns=3)
    recs = load_records(tmp_path / "d")
    assert len(recs) == 8 and len({r["id"] for r in recs}) == 8 and s.followup.sampled > 0
    assert max(len(r["messages"]) for r in recs) > 2  # some conversations really went on
    end = "<|im_end|>"
    for r in recs:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        spans, cur = [], []
        for t, m in zip(r["input_ids"], r["loss_mask"]):
            if m:
                cur.append(t)
            elif cur:
                spans, cur = spans + [cur], []
        spans += [cur] if cur else []
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert len(spans) == len(answers)
        for span, a in zip(spans, answers):
            assert tokenizer.decode(span, skip_special_tokens=True).strip() == a.strip()
            assert tokenizer.decode(span[-1:]) == end or span is spans[-1]  # only a cut last answer lacks it
        users = [m["content"] for m in r["messages"] if m["role"] == "user"]
        masked = tokenizer.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m])
        assert all(u not in masked for u in users if len(u) > 20)
    log = [e for entries in SynthesisLog(tmp_path / "d").batches.values() for e in entries]
    assert {e["turn"] for e in log} >= {1, 2} and s.followup.sampled == sum(e["turn"] > 1 for e in log)


@needs_tokenizer
def test_chat_template_is_cut_at_the_user_turn(tokenizer):
    tpl = ChatTemplate(tokenizer)
    assert tokenizer.decode([tpl.user_end]) == "<|im_end|>"
    assert tokenizer.decode(tpl.first_turn(None)).endswith("<|im_start|>user\n")
    assert "You are a math tutor" in tokenizer.decode(tpl.first_turn("You are a math tutor."))
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    ids = tpl.next_turn(msgs, {1: tokenizer("Hello!", add_special_tokens=False)["input_ids"]})
    assert tokenizer.decode(ids).endswith("Hello!<|im_end|>\n<|im_start|>user\n")


def test_overlap_reports_the_near_duplicate_rate(tmp_path):
    """`data overlap DIR --against SPEC`: the share of DIR's first prompts (and of the prompts its synthesis
    log saw pass the quality gates) that match SPEC's prompts."""
    from typer.testing import CliRunner

    from selfdraft.cli import app

    recs = [{"id": str(i), "split": "train", "source": "s", "input_ids": [1], "loss_mask": [1],
             "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "A"}]}
            for i, q in enumerate(["How do I sort a list in Python?", "What is the capital of Peru?",
                                   "Tell me a joke about cats and dogs", "Explain how vaccines train immunity"])]
    ShardWriter(tmp_path / "d").write(recs)
    SynthesisLog(tmp_path / "d").append(0, [{"turn": 1, "gate": g, "text": t} for g, t in [
        ("kept", "How do I sort a list in Python?"), ("near_duplicate", "what IS the capital of Peru now"),
        ("garbage", "What is the capital of Peru?")]])
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ["how do I sort a list in python", "What is the capital of Peru now?"]))
    res = CliRunner().invoke(app, ["data", "overlap", str(tmp_path / "d"), "--against", str(ref)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["records"] == {"prompts": 4, "near_or_exact": 2, "exact": 1, "rate": 0.5}
    assert out["sampled_passing_quality_gates"] == {"prompts": 2, "near_or_exact": 2, "exact": 2, "rate": 1.0}


@needs_tokenizer
def test_extend_trains_only_the_new_turns(tmp_path, talker, tokenizer):
    """--extend DIR: each finished conversation of DIR gets a target-written next user turn and its answer;
    the copied conversation (trained already) keeps loss mask 0, so no token is trained twice; a
    conversation whose last answer was cut cannot be continued; a val conversation stays val."""
    run(talker, tmp_path / "base", limit=12)
    base = {r["id"]: r for r in load_records(tmp_path / "base")}
    gate_cfg = GateConfig(language="any", min_prompt_tokens=2)
    cfg = SynthConfig(extend=str(tmp_path / "base"), max_prompt_new_tokens=24, gates=gate_cfg)
    regen = RegenConfig(max_new_tokens=12, batch_size=4, num_turns=1)
    g = PromptGates(gate_cfg, NearDupIndex([], 0.7), NearDupIndex([], 0.7))
    s = synthesize(talker, tmp_path / "ext", 100, cfg, regen, g, progress=False)
    recs = load_records(tmp_path / "ext")
    log = [e for entries in SynthesisLog(tmp_path / "ext").batches.values() for e in entries]
    assert s.first.sampled == 0 and s.followup.sampled == len(log) > 0 and len(recs) > 0
    finished = {k for k, r in base.items() if r["input_ids"][[i for i, m in enumerate(r["loss_mask"]) if m][-1]] == tokenizer.eos_token_id}
    assert {e["extends"].split(":")[1] for e in log} == finished < set(base)  # cut ones are not continued
    for r in recs:
        (origin,) = {e["extends"] for e in log if e["id"] == r["id"]}
        old = base[origin.split(":")[1]]
        n = len(old["input_ids"])
        assert r["input_ids"][:n] == old["input_ids"] and r["messages"][: len(old["messages"])] == old["messages"]
        assert not any(r["loss_mask"][:n]) and any(r["loss_mask"][n:])
        new_answer = [t for t, m in zip(r["input_ids"][n:], r["loss_mask"][n:]) if m]
        assert tokenizer.decode(new_answer, skip_special_tokens=True).strip() == r["messages"][-1]["content"].strip()
        assert r["split"] == old["split"] and r["source"] == "synth-extend" and len(r["messages"]) == len(old["messages"]) + 2


KILLED_RUN = """
import sys
import torch
torch.set_num_threads(1)  # as the tests run (conftest); more threads only spin on a tiny model
from transformers import AutoTokenizer
from tests.test_synthesize import make_talker, run
run(make_talker(AutoTokenizer.from_pretrained(sys.argv[3])), sys.argv[1], limit=int(sys.argv[2]))
"""


@pytest.mark.slow
@needs_tokenizer
def test_kill_9_mid_synthesis_loses_nothing(tmp_path, talker):
    """A real SIGKILL at an arbitrary point (once the log has two batches, likely mid-batch), then the
    same command again: the dataset equals an uninterrupted run's, record for record."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    out, limit = tmp_path / "killed", 16
    cmd = [sys.executable, "-c", KILLED_RUN, str(out), str(limit), str(EMBEDDED_DIR)]
    proc = subprocess.Popen(cmd, cwd=root)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / LOG).exists() and (out / LOG).read_text().count("\n") >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: raise the limit"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(SynthesisLog(out).batches)
    assert 2 <= done_before and len(load_records(out)) < limit
    subprocess.run(cmd, cwd=root, check=True)
    run(talker, tmp_path / "ref", limit=limit)
    by_id = lambda recs: sorted(recs, key=lambda r: r["id"])  # noqa: E731
    assert by_id(load_records(out)) == by_id(load_records(tmp_path / "ref"))
    assert SynthesisLog(out).batches == SynthesisLog(tmp_path / "ref").batches
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert [r["status"] for r in runs] == ["killed", "finished"]
