"""The CUDA path end to end, on the tiny models of tests/conftest.py (marker `cuda`; scripts/device_check.sh
runs this file on a GPU machine). Skipped, with the reason, where PyTorch sees no GPU.

Lossless on the GPU as on the CPU: float32 greedy output equals HF generate() for every drafter kind
(chains and an EAGLE-2 tree, both backends), sampled output follows p (chi-square against the law
enumerated on the CPU), the batched engine equals single requests, calibration, regeneration's
sampler, the cost table, --compile's CUDA graphs, and training (2 steps, resume; 2-rank DDP and FSDP
when the machine has 2 GPUs).

SELFDRAFT_TEST_DEVICE=cpu runs the same tests on the CPU (a dry run of the tests themselves, e.g. on
a machine without a GPU; --compile's test needs CUDA graphs and stays skipped there).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfdraft import methods
from selfdraft.config import GenerationConfig, SamplingParams, TrainConfig
from selfdraft.decode import generate
from selfdraft.engine import Engine
from selfdraft.target import Target
from selfdraft.training.strategy import STRATEGIES
from tests.helpers import tiny_llama
from tests.helpers import ModelDrafter

DEVICE = torch.device(os.environ.get("SELFDRAFT_TEST_DEVICE", "cuda"))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                       reason=f"needs an NVIDIA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
                              f"CUDA build {torch.version.cuda or 'none'}); scripts/device_check.sh runs these on a GPU machine"),
]
two_gpus = pytest.mark.skipif(DEVICE.type != "cuda" or GPUS < 2, reason=f"needs 2 GPUs (this machine: {GPUS})")

V, H, LAYERS, FEATS = 96, 48, 5, (1, 2, 3)
PROMPT = [5, 17, 3, 42, 8, 8, 61, 5, 17, 3]
N = 32


def on_device(model):
    return model.to(DEVICE)


@pytest.fixture(scope="module")
def model():
    # a peaked p (logits of std ~3), as in trained LMs: greedy far from ties, so float32 kernels agree
    return on_device(tiny_llama(vocab=V, hidden=H, layers=LAYERS, seed=0, peaked=3.0, intermediate=64))


@pytest.fixture(scope="module", params=["hf", "native"])
def target(model, request):
    return Target(model, backend=request.param)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def drafter(kind: str, target: Target, seed: int = 1, **kw):
    """A random tiny drafter of `kind` on the target's device (trained kinds: fresh weights)."""
    if kind in ("none", "ngram"):
        return methods.get(kind).new(target)
    torch.manual_seed(seed)
    tree = {k: kw.pop(k) for k in ("tree_depth", "tree_top_k", "tree_total_tokens") if k in kw}
    cfg = methods.get(kind).config(feature_layers=() if kind == "mtp" else FEATS, **kw)
    module = STRATEGIES[kind].build(cfg, target)
    markov = getattr(module, "markov", None)
    if markov is not None:  # W2 starts at zero: make the Markov head matter
        torch.nn.init.normal_(markov.W2.weight, std=0.5)
    d = methods.get(kind).wrap(module, cfg, target)
    if tree:
        d.set_tree(tree.get("tree_depth", 3), tree.get("tree_top_k", 3), tree.get("tree_total_tokens", 12))
    return d


KINDS = {"none": {}, "ngram": {}, "mtp": {}, "eagle3": {}, "eagle3-tree": {"tree_depth": 3}, "dflash": {},
         "dspark": {"markov_rank": 8}}


def make(kind: str, target: Target):
    return drafter(kind.removesuffix("-tree"), target, **dict(KINDS[kind]))


# ----------------------------------------------------------------------------- the target on the device
def test_native_matches_hf_on_the_device(model):
    """float32 logits of prefill, decode and a verify block within 1e-4 of HF's, on the device."""
    hf, nat = Target(model), Target(model, backend="native")
    assert nat.backend == "native" and nat.device.type == DEVICE.type
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    c1, c2 = hf.new_cache(), nat.new_cache()
    for s in (slice(0, 12), slice(12, 13), slice(13, 20)):
        a, b = hf.forward(ids[:, s], c1, FEATS), nat.forward(ids[:, s], c2, FEATS)
        assert a.logits.device.type == DEVICE.type and float((a.logits - b.logits).abs().max()) <= 1e-4
        assert float((a.features - b.features).abs().max()) <= 1e-4


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_kernels_on_the_device(weights):
    """The int8 / int4 kernels of the device (bf16) reproduce their dequantised weights."""
    from tests.helpers import _dequantized_hf, build

    model = build("llama").to(DEVICE, torch.bfloat16)
    nat = Target(model, backend="native", weights=weights)
    ref = Target(_dequantized_hf(model, nat))
    ids = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(5))
    d = float((ref.forward(ids, None).logits.float() - nat.forward(ids, None).logits.float()).abs().max())
    assert d < 0.1, d  # bf16 activations: a few ulps of logits of size ~3


def test_fingerprint_and_profile_key_on_the_device(model, tmp_path, monkeypatch):
    from selfdraft.profile import cost_table_for, profile_path

    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path))
    cpu = Target(tiny_llama(vocab=V, hidden=H, layers=LAYERS, seed=0, peaked=3.0, intermediate=64))
    nat = Target(model, backend="native")
    assert nat.fingerprint() == cpu.fingerprint()  # the same target wherever it runs
    if DEVICE.type == "cuda":
        assert "-cuda-" in nat.profile_key
    table = cost_table_for(nat, 8)
    assert profile_path(nat, nat.profile_key).exists() and all(s > 0 for s in table.sps)


# ----------------------------------------------------------------------------- one request
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_equals_hf_for_every_drafter_kind(model, target, kind):
    expected = hf_greedy(model, PROMPT, N)
    res = generate(target, make(kind, target), PROMPT, SamplingParams(), GenerationConfig(max_new_tokens=N, gamma=4))
    assert res.token_ids == expected, kind


def test_dspark_under_the_hardware_scheduler_equals_hf(model, target, tmp_path, monkeypatch):
    """auto = hardware on the device: the cost table measured there (synchronised), DSpark's online
    admission (a whole block, cut at the first refusal, off the CPU)."""
    from selfdraft.profile import scheduler_for

    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path))
    d = make("dspark", target)
    sched = scheduler_for("auto", target, d, 4)
    res = generate(target, d, PROMPT, SamplingParams(), GenerationConfig(max_new_tokens=N, gamma=4), scheduler=sched)
    assert sched.kind == "hardware" and res.token_ids == hf_greedy(model, PROMPT, N)


@pytest.mark.parametrize("kind", ["ngram", "eagle3-tree", "dspark", "mtp"])
def test_seeded_sampling_runs_and_repeats(target, kind):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    runs = [generate(target, make(kind, target), PROMPT, params, GenerationConfig(max_new_tokens=16, gamma=3)).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16 and all(0 <= t < V for t in runs[0])


DeviceModelDrafter = ModelDrafter  # test_decode's two-model drafter: its inputs follow the model's device


def test_sampling_follows_p_chi_square():
    """Rejection sampling on the device follows the target's law (enumerated on the CPU copy)."""
    from scipy.stats import chisquare

    from tests.helpers import N_NEW, V_SMALL, _sequence_law

    cpu = Target(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0))
    params, prompt, n = SamplingParams(temperature=1.0), [1, 3, 2], 1000
    law = _sequence_law(cpu, prompt, params)
    dev = Target(on_device(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0)), backend="native")
    d = DeviceModelDrafter(on_device(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=2, peaked=1.0)))
    counts = dict.fromkeys(law, 0)
    cfg = GenerationConfig(max_new_tokens=N_NEW, gamma=4, stop_on_eos=False)
    for s in range(n):
        counts[tuple(generate(dev, d, prompt, dataclasses.replace(params, seed=s), cfg).token_ids)] += 1
    keys = [k for k in law if law[k] > 0]
    exp = torch.tensor([law[k] for k in keys], dtype=torch.float64)
    assert chisquare([counts[k] for k in keys], (exp / exp.sum() * n).numpy()).pvalue > 1e-3


# ----------------------------------------------------------------------------- the batched engine
def test_engine_batched_greedy_equals_single_requests(model):
    """Chains and a tree in one padded batch on the device; each request's output is its own."""
    target = Target(model, backend="native")
    kinds = ["ngram", "dspark", "eagle3-tree", "mtp", "none"]
    prompts = [PROMPT[: 4 + i] + [i] for i in range(len(kinds))]
    engine = Engine(target, compact_slack=4)
    ids = {engine.add_request(p, make(k, target), SamplingParams(), GenerationConfig(max_new_tokens=12 + 3 * i, gamma=4)): i
           for i, (k, p) in enumerate(zip(kinds, prompts))}
    results = engine.run()
    for rid, i in ids.items():
        assert results[rid].token_ids == hf_greedy(model, prompts[i], 12 + 3 * i), kinds[i]


# ----------------------------------------------------------------------------- calibration, regeneration
def test_calibrate_checkpoint_on_the_device(tmp_path):
    from safetensors.torch import load_file

    from selfdraft.checkpoint import load_checkpoint, save_checkpoint
    from selfdraft.methods.dspark.config import DSparkConfig
    from selfdraft.training.calibrate import calibrate_checkpoint

    target = Target(on_device(tiny_llama(vocab=48, hidden=32, layers=4, seed=0, peaked=3.0)))
    torch.manual_seed(2)
    cfg = DSparkConfig(feature_layers=(1, 2), gamma=3, markov_rank=8)
    module = STRATEGIES["dspark"].build(cfg, target).to(DEVICE)
    with torch.no_grad():
        module.confidence.weight.mul_(20.0)
    ckpt = save_checkpoint(tmp_path / "d", module, cfg, target, {"note": "test"})
    prompts = [[i, i + 1, 7, 3] for i in range(6)]
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        rep = calibrate_checkpoint(ckpt, target, prompts, params, max_new_tokens=16)
        assert len(rep) == 3
    temps = load_file(str(ckpt / "model.safetensors"))["conf_temperature"].tolist()
    d = load_checkpoint(ckpt, target)
    assert d.model.conf_temperature.device.type == DEVICE.type
    assert torch.allclose(d.model.conf_temperature.cpu(), torch.tensor(temps))


def test_checkpoint_draft_vocabulary_on_the_device(tmp_path):
    """A checkpoint's draft_vocab.safetensors (ids loaded on the CPU) drafts on the device, losslessly."""
    from selfdraft.checkpoint import load_checkpoint, save_checkpoint
    from selfdraft.methods.dspark.config import DSparkConfig
    from selfdraft.vocab import DraftVocab

    model = on_device(tiny_llama(vocab=V, hidden=H, layers=LAYERS, seed=0, peaked=3.0, intermediate=64))
    target = Target(model, backend="native")
    torch.manual_seed(1)
    cfg = DSparkConfig(feature_layers=FEATS, gamma=4, markov_rank=8)
    ckpt = save_checkpoint(tmp_path / "d", STRATEGIES["dspark"].build(cfg, target), cfg, target, {})
    ids = torch.arange(0, V, 3)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    DraftVocab(ids - torch.arange(ids.numel()), t2d, 1.0).save(ckpt / "draft_vocab.safetensors")
    d = load_checkpoint(ckpt, target)
    assert d.vocab is not None and d.vocab.device.type == DEVICE.type
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=0)):
        res = generate(target, d, PROMPT, params, GenerationConfig(max_new_tokens=N, gamma=4))
        if params.greedy:
            assert res.token_ids == hf_greedy(model, PROMPT, N)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=50), SamplingParams(temperature=0.7, top_p=0.9)])
def test_regeneration_sampler_on_the_device(params):
    """data regenerate's batched sampler: the candidate path (vocabulary > 1024), the CPU generator
    drawing for device probabilities, rows leaving at their EOS; seeded runs repeat."""
    from selfdraft.training.regenerate import sample_batch

    target = Target(on_device(tiny_llama(vocab=2048, hidden=32, layers=2, peaked=3.0)))
    target.eos_ids = {7, 11}
    runs = [sample_batch(target, [[1, 2, 3], [4, 5], [6]], params, 12, torch.Generator().manual_seed(0)) for _ in range(2)]
    assert runs[0] == runs[1]
    for row in runs[0]:
        assert 1 <= len(row) <= 12 and all(0 <= t < 2048 for t in row)
        assert all(t not in target.eos_ids for t in row[:-1])


def test_bench_hf_peers_on_the_device(model):
    from selfdraft.bench.harness import BenchConfig, _hf_runner

    target = Target(model)
    for lookup in (False, True):
        sample = _hf_runner(target, BenchConfig(max_new_tokens=8, gamma=3), lookup).run(PROMPT, 0, 8)
        assert sample.token_ids == hf_greedy(model, PROMPT, 8)


# ----------------------------------------------------------------------------- --compile (CUDA graphs)
@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_compiled_cuda_graph_steps_are_exact_and_keep_their_cache(model):
    """reduce-overhead: outputs cloned out of the graph pool (MTP keeps the states it reads), one cache
    address across requests (no re-recording), greedy output equal to eager's."""
    eager = Target(model, backend="native")
    comp = Target(model, backend="native", compile=2)  # T = 1, 2 (γ = 1): seconds of compiling, not minutes
    assert comp.native.compiled.graphs and comp.native.pool is not None
    for kind in ("mtp", "ngram"):
        out = [generate(t, make(kind, t), PROMPT, SamplingParams(), GenerationConfig(max_new_tokens=20, gamma=1)).token_ids
               for t in (eager, comp)]
        assert out[0] == out[1], kind
    a = comp.new_cache()
    comp.forward(torch.tensor([PROMPT]), a)
    buffers = a.keys[0]  # the tensor itself: the caching allocator could hand out a freed address again
    del a
    b = comp.new_cache()
    comp.forward(torch.tensor([PROMPT]), b)
    assert b.keys[0] is buffers


# ----------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    from tests.helpers import write_equal_length_dataset

    root = tmp_path_factory.mktemp("train")
    tiny_llama(peaked=3.0).save_pretrained(root / "target")
    return root, root / "target", write_equal_length_dataset(root / "data")


TRAIN = dict(batch_size=4, max_seq_len=32, lr=5e-3, warmup_steps=1, min_lr_ratio=1.0, val_every=0, val_batches=1,
             save_every=1, seed=0, bf16=False)


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_two_steps_then_resume_on_the_device(train_setup, method):
    """2 steps, then a resumed third: the resumed run continues on the device (drafter, optimizer
    state) and lands where an uninterrupted 3-step run does."""
    from safetensors.torch import load_file

    from selfdraft.training.trainer import train

    root, target_dir, data = train_setup
    target = Target.load(str(target_dir), dtype="float32", device=DEVICE.type)
    cfg = methods.drafter_config({"method": method, "gamma": 3, **({"markov_rank": 8} if method == "dspark" else {})})
    straight = train(target, cfg, TrainConfig(data=str(data), steps=3, **TRAIN), root / f"{method}-straight")
    first = train(target, cfg, TrainConfig(data=str(data), steps=2, **TRAIN), root / f"{method}-resumed")
    assert first.steps == 2
    again = train(target, cfg, TrainConfig(data=str(data), steps=3, **TRAIN), root / f"{method}-resumed")
    assert again.resumed_from == 2 and again.steps == 3 and again.tokens == straight.tokens
    a, b = load_file(root / f"{method}-straight" / "model.safetensors"), load_file(root / f"{method}-resumed" / "model.safetensors")
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < 1e-4


def _cli(*args: str, nproc: int = 0) -> subprocess.CompletedProcess:
    import selfdraft

    src = str(Path(selfdraft.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else [sys.executable]
    res = subprocess.run([*head, "-m", "selfdraft", *args], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def test_cli_train_takes_the_device(train_setup):
    from tests.helpers import cli_args

    root, target_dir, data = train_setup
    out = root / "cli"
    _cli(*cli_args(target_dir, data, out, steps=2), "--device", DEVICE.type)
    assert (out / "model.safetensors").exists()


@two_gpus
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_ranks_on_two_gpus_match_one(train_setup, fsdp):
    """torchrun --nproc_per_node 2 on NCCL (cuda:LOCAL_RANK per rank; FSDP on a CUDA mesh): the
    1-process trajectory (test_distributed's setup: equal-length sequences, MTP's deterministic loss)."""
    from safetensors.torch import load_file

    from tests.helpers import STEPS, cli_args

    root, target_dir, data = train_setup
    single, multi = root / f"single-{fsdp}", root / f"multi-{fsdp}"
    _cli(*cli_args(target_dir, data, single), "--device", "cuda")
    _cli(*cli_args(target_dir, data, multi, fsdp=fsdp), "--device", "cuda", nproc=2)
    a, b = load_file(single / "model.safetensors"), load_file(multi / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4, STEPS
