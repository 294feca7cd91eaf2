"""Device propagation without a GPU: every tensor the code makes follows its inputs' device.

The CUDA path cannot run here, but what breaks it (a tensor built on the CPU and mixed with GPU ones)
shows on PyTorch's `meta` device: tensors with shapes and no data, on a device that is not the CPU.
Models and inputs go to meta and the code runs unchanged under two modes (`on_meta`):

- `HostCopies` stands in for what CUDA allows and meta cannot do, a copy to the host (`.cpu()`,
  `.tolist()`, `int()`, `.item()`, ...): it hands back a host tensor of the right shape, all zeros
  (uniform logits, log-probabilities that never grow along a draft tree), and records the copy, so
  a test can count what a round sends to the host; a multinomial draw over such zeros draws
  uniformly. `.numpy()` of a device tensor stays an error, as on CUDA.
- `DeviceAudit` records every aten op whose tensor arguments mix the device with the CPU (except what
  CUDA accepts too: copies, CPU index tensors into a device tensor, CPU 0-dim scalars) and every
  tensor a factory op (arange, zeros, ...) creates off the device; meta itself already refuses most
  mixed ops, the audit catches those it lets through (matmul, embedding, indexing a CPU tensor, a
  CPU generator drawing for device probabilities).

Values are meaningless on meta: these tests check devices, shapes and host copies; the exactness
tests (test_decode, test_engine, ...) check values on the CPU, and tests/test_cuda.py on a GPU.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from selfdraft import methods
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.target import Target
from selfdraft.training.strategy import STRATEGIES
from tests.helpers import tiny_llama

META = torch.device("meta")
V, H, LAYERS, FEATS = 96, 48, 5, (1, 2, 3)
PROMPT = [5, 17, 3, 42, 8, 8, 61, 5, 17]

# ----------------------------------------------------------------------------- the two modes
_HOST = {"cpu", "tolist", "item", "__int__", "__float__", "__bool__", "__index__"}  # what CUDA answers with a copy
# Ops that accept a CPU tensor beside a device one on CUDA: copies, and CPU index tensors into a device
# tensor (checked below: the indexed tensor itself must be on the device).
_CROSS = {"aten::copy_", "aten::_to_copy", "aten::lift_fresh", "aten::lift_fresh_copy"}
_INDEX = {"aten::index.Tensor", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}


class DeviceAudit(TorchDispatchMode):
    def __init__(self, device: torch.device = META) -> None:
        super().__init__()
        self.device, self.paused = device, False
        self.mixed: list[tuple] = []  # (op, devices, shapes)
        self.created: list[tuple] = []  # (op, device, shape) of factory outputs off the device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = func._schema.name if func._schema.overload_name == "" else f"{func._schema.name}.{func._schema.overload_name}"
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        checked = tensors
        if name in _INDEX:  # CPU index tensors are fine; the indexed tensor and the values must be on the device
            checked = [a for i, a in enumerate(args) if i != 1 and isinstance(a, torch.Tensor)]
            checked += [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor) and t.device == self.device]
        devs = {t.device.type for t in checked if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devs) > 1 and name not in _CROSS:
            self.mixed.append((name, sorted(devs), [tuple(t.shape) for t in tensors]))
        if not tensors:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and o.device != self.device and o.dim() > 0:
                    self.created.append((name, o.device.type, tuple(o.shape)))
        return out


class HostCopies(TorchFunctionMode):
    def __init__(self, audit: DeviceAudit) -> None:
        super().__init__()
        self.audit = audit
        self.copies: list[tuple[str, tuple[int, ...]]] = []  # (call, shape) of every device -> host copy

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        self.audit.paused = True  # the stand-in is the copy's result, not a tensor the code created
        try:
            return torch.zeros(t.shape, dtype=t.dtype)
        finally:
            self.audit.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        gen = kwargs.get("generator")
        if gen is not None and t is not None and gen.device != t.device:  # CUDA: "Expected a 'cuda' device type for generator"
            self.audit.mixed.append((name, sorted({gen.device.type, t.device.type}), "generator"))
        if func is torch.multinomial and t.device.type == "cpu" and not bool(t.any()):  # drawn from a stand-in
            return func(torch.ones_like(t), *args[1:], **kwargs)
        if t is not None and t.device == META and (name in _HOST or (name == "to" and _to_host(args[1:], kwargs))):
            self.copies.append((name, tuple(t.shape)))
            host = self._host(t)
            return host if name == "cpu" else func(host, *args[1:], **kwargs)
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    dev = kwargs.get("device", args[0] if args else None)
    dev = dev.device if isinstance(dev, torch.Tensor) else dev
    return isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu"


@contextlib.contextmanager
def on_meta():
    audit = DeviceAudit()
    host = HostCopies(audit)
    with host, audit:
        yield host, audit


def test_the_audit_sees_what_meta_lets_through():
    """The modes themselves: a CPU operand of a matmul or an embedding (meta accepts both, CUDA does
    not), a CPU tensor indexed by a device index, and a CPU factory tensor are all reported; a copy
    to the host is simulated and counted; numpy() of a device tensor still fails, as on CUDA."""
    x = torch.empty(3, 4, device=META)
    with on_meta() as (host, audit):
        x @ torch.ones(4, 2)
        torch.nn.functional.embedding(torch.tensor([1]), x)
        torch.arange(5)[torch.zeros(2, dtype=torch.long, device=META)]
        x[torch.tensor([0, 1])]  # a CPU index into a device tensor: CUDA accepts it
        x[:, 0] = torch.ones(3)  # a copy into a slice: CUDA accepts it
        x[torch.tensor([0, 1])] = torch.ones(2, 4)  # CPU values for an index_put: CUDA refuses them
        assert x.sum(1).tolist() == [0.0, 0.0, 0.0] and int(x[0, 0]) == 0 and host.copies[-1] == ("__int__", ())
        with pytest.raises(TypeError):
            x.numpy()
        torch.multinomial(x.softmax(-1), 1, generator=torch.Generator())
    assert [m[0] for m in audit.mixed] == ["aten::mm", "aten::embedding", "aten::index.Tensor", "aten::index_put_", "multinomial"]
    assert ("aten::arange", "cpu", (5,)) in audit.created


# ----------------------------------------------------------------------------- models on meta
@pytest.fixture(scope="module")
def meta_model():
    return tiny_llama(vocab=V, hidden=H, layers=LAYERS, intermediate=64).to(META)


def meta_drafter(name: str, target: Target, **kw):
    if name in ("none", "ngram"):
        return methods.get(name).new(target)
    cfg = methods.get(name).config(feature_layers=() if name == "mtp" else FEATS, **kw)
    with torch.device(META):
        module = STRATEGIES[name].build(cfg, target)
    return methods.get(name).wrap(module, cfg, target)


KINDS = [("none", {}), ("ngram", {}), ("mtp", {}), ("eagle3", {}), ("eagle3", {"tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 6}),
         ("dflash", {}), ("dspark", {"markov_rank": 8})]


# Greedy drafting that never waits for the device mid-round (MTP and EAGLE-2 trees still read scalars per draft).
DEVICE_DRAFTING = ("none", "ngram", "dflash", "dspark", "eagle3")
# Every drafter kind on the native backend; the HF backend's forward (its own masks) with a chain and a tree.
CASES = [("native", k, kw) for k, kw in KINDS] + [("hf", *KINDS[1]), ("hf", *KINDS[4])]


@pytest.mark.parametrize("backend,kind,kw", CASES, ids=[f"{b}-{k}" + ("-tree" if kw.get("tree_depth") else "") for b, k, kw in CASES])
def test_generate_on_meta_keeps_every_tensor_on_the_device(meta_model, backend, kind, kw):
    """generate() with every drafter kind (chains and an EAGLE-2 tree), greedy and sampled, DSpark under
    the threshold scheduler (its online admission): no op mixes the device with the CPU. Greedy rounds
    send ids to the host, never a [.., V] block of logits or probabilities."""
    from selfdraft.scheduler import Scheduler

    target = Target(meta_model, backend=backend)
    drafter = meta_drafter(kind, target, **kw)
    scheduler = Scheduler("threshold", threshold=0.3) if kind == "dspark" else None
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1)):
        with on_meta() as (host, audit):
            res = generate(target, drafter, PROMPT, params, GenerationConfig(max_new_tokens=8, gamma=3), scheduler=scheduler)
        assert len(res.token_ids) == 8 and audit.mixed == [], audit.mixed
        if params.greedy:
            assert not [c for c in host.copies if c[1] and c[1][-1] == V], host.copies
        if params.greedy and kind in DEVICE_DRAFTING and not kw.get("tree_depth"):  # whole tensors, no scalar-by-scalar waits
            assert not [c for c in host.copies if c[0] in ("__int__", "__float__", "__bool__", "item")], host.copies


def test_engine_on_meta_keeps_every_tensor_on_the_device(meta_model):
    """The batched engine: a ragged batched prefill, padded verification forwards with a tree among the
    chains (its 4D mask), compaction, finished rows leaving."""
    from selfdraft.engine import Engine

    target = Target(meta_model, backend="native")
    engine = Engine(target, compact_slack=2)
    for i, (kind, kw) in enumerate([("dspark", {"markov_rank": 8}), ("ngram", {}), ("eagle3", KINDS[4][1])]):
        engine.add_request(PROMPT[: 5 + 2 * i], meta_drafter(kind, target, **kw), SamplingParams(),
                           GenerationConfig(max_new_tokens=6 + 3 * i, gamma=3))
    with on_meta() as (_, audit):
        results = engine.run()
    assert sorted(len(r.token_ids) for r in results.values()) == [6, 9, 12] and audit.mixed == [], audit.mixed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_calibration_rounds_on_meta(meta_model, temperature):
    """DSpark calibration: its own decode of the full block (decode_block), the heads' z_k, a round, and
    the acceptance coins from the CPU generator; the fit's inputs come back on the host."""
    from selfdraft.training.calibrate import collect_rounds

    target = Target(meta_model)
    drafter = meta_drafter("dspark", target, markov_rank=8)
    with on_meta() as (_, audit):
        rounds = collect_rounds(target, drafter, [PROMPT], SamplingParams(temperature=temperature), max_new_tokens=6)
    assert rounds.z.device.type == "cpu" and rounds.accepted.device.type == "cpu" and audit.mixed == [], audit.mixed


def test_draft_vocabulary_from_a_file_follows_the_model(meta_model):
    """restrict_vocab with host ids (a checkpoint's draft_vocab.safetensors loads on the CPU): the ids
    index drafts and scatter q on the model's device."""
    target = Target(meta_model)
    drafter = meta_drafter("dspark", target, markov_rank=8)
    drafter.restrict_vocab(torch.arange(0, V, 2))
    assert drafter.vocab.device == META
    with on_meta() as (_, audit):
        generate(target, drafter, PROMPT, SamplingParams(temperature=0.7, seed=0), GenerationConfig(max_new_tokens=6, gamma=3))
    assert audit.mixed == [], audit.mixed


def test_regeneration_sampler_on_meta():
    """data regenerate's batched sampler: top-k over a vocabulary large enough for the candidate path
    (the CPU generator draws for device probabilities), finished-row bookkeeping on the host."""
    from selfdraft.training.regenerate import sample_batch

    target = Target(tiny_llama(vocab=2048, hidden=32, layers=2).to(META))
    gen = torch.Generator().manual_seed(0)
    with on_meta() as (_, audit):
        out = sample_batch(target, [[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, top_k=50), 5, gen)
    assert [len(o) for o in out] == [5, 5] and audit.mixed == [], audit.mixed


def test_fingerprint_reads_device_weights_through_the_host(meta_model):
    """numpy() reads host memory only (a CUDA tensor's numpy() raises, as a meta one does)."""
    target = Target(meta_model)
    with on_meta() as (host, _):
        fp = target.fingerprint()
    assert len(fp) == 16 and host.copies == [("cpu", (1, H))]


def test_bench_hf_peers_get_their_input_on_the_models_device(meta_model, monkeypatch):
    """HF generate() does not move its input to the model: the peer runner puts it there. (HF's own loop
    cannot run on meta, its stopping rule reads data: a stand-in generate records what it was given.)"""
    from selfdraft.bench.harness import BenchConfig, _hf_runner

    target = Target(meta_model)
    seen = []

    def fake_generate(inp, attention_mask=None, max_new_tokens=0, **kw):
        seen.append((inp.device, attention_mask.device))
        return torch.cat([inp, inp.new_zeros(1, max_new_tokens)], 1)

    monkeypatch.setattr(meta_model, "generate", fake_generate)
    with on_meta():
        sample = _hf_runner(target, BenchConfig(max_new_tokens=4), prompt_lookup=False).run(PROMPT, 0, 4)
    assert seen == [(META, META)] and len(sample.token_ids) == 4


# ----------------------------------------------------------------------------- pure pieces: all they create is on the device
def _pure(fn, *args, **kwargs):
    with on_meta() as (host, audit):
        out = fn(*args, **kwargs)
    assert audit.mixed == [] and audit.created == [], (audit.mixed, audit.created)
    assert all(o.device == META for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
    return out, host


def test_masks_positions_sampling_and_verification_pieces_stay_on_the_device():
    from selfdraft.drafters.blocks import block_attention_mask, block_positions
    from selfdraft.methods.eagle3.drafter import frontier_mask
    from selfdraft.native.ops import attention, rope_tables
    from selfdraft.sampling import probs_from_logits, residual
    from selfdraft.scheduler import prefix_survival
    from selfdraft.verify import greedy_outcome

    anchors = torch.zeros(2, 3, dtype=torch.long, device=META)
    assert _pure(block_attention_mask, anchors, 10, 4)[0].shape == (2, 12, 22)
    assert _pure(block_positions, anchors, 4)[0].shape == (2, 12)
    logits = torch.empty(4, V, device=META)
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)):
        _pure(probs_from_logits, logits, params)
    _pure(residual, logits.softmax(-1), logits.softmax(-1))
    _pure(prefix_survival, torch.empty(5, device=META))
    _pure(rope_tables, torch.zeros(1, 5, dtype=torch.long, device=META), torch.empty(8, device=META), 1.0, torch.float32)
    out, host = _pure(greedy_outcome, logits, torch.zeros(3, dtype=torch.long))  # drafts on the host, as verify gets them
    assert out.shape == (5,) and host.copies == []  # nothing reaches the host before verify's one copy
    q, kv = torch.empty(1, 4, 3, 8, device=META), torch.empty(1, 2, 7, 8, device=META)
    _pure(attention, q, kv, kv, torch.ones(1, 1, 3, 7, dtype=torch.bool, device=META), expand_kv=True)
    assert _pure(frontier_mask, [[True, False], [False, True], [True, True]], 4, 2, META)[0].shape == (1, 3, 9)


def test_native_masks_follow_the_device(meta_model):
    """The native stack's mask pieces (causal + padding, sliding window, a caller's 4D mask) for ragged
    rows: everything but the host lengths is made on the device."""
    from selfdraft.native import NativeModel

    native = NativeModel(meta_model)
    past = torch.tensor([3, 5])  # host bookkeeping (NativeCache.lengths)
    _pure(native._mask, past, 4, 9, False, None)
    _pure(native._mask, past, 4, 9, False, torch.ones(2, 9, dtype=torch.long))
    _pure(native._window, None, past, 4, 9, 2, None)
    assert native._window(None, past, 4, 9, 64, None) is None  # the window holds every key: no mask, no sync


def test_gguf_exact_int4_check_reads_device_weights_on_the_host(tmp_path):
    """The GGUF's Q4 blocks are decoded on the host; a model on a device is compared there (a mixed
    torch.equal is an error on CUDA)."""
    import gguf
    import numpy as np

    from selfdraft.native.gguf import _read_exact

    rows, cols = 16, 64
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("blk.0.ffn_up.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    name = "model.layers.0.mlp.up_proj.weight"
    exact = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_0)).reshape(rows, cols)
    assert name in _read_exact(path, {name: exact}, 4, 2)  # the file is what the test thinks it is
    with on_meta() as (host, _):
        assert _read_exact(path, {name: exact.to(META)}, 4, 2) == {}  # (meta's stand-in values differ: no match)
    assert host.copies == [("cpu", (rows, cols))]


# ----------------------------------------------------------------------------- CUDA-only code paths, run on the CPU
def test_compiled_outputs_are_cloned_under_cuda_graphs(meta_model):
    """A CUDA-graph step returns buffers the next replay overwrites (what MTP keeps a view of): the
    native model copies them out. A fake compiled step reuses one buffer to show it."""
    from selfdraft.native import NativeModel

    model = tiny_llama(vocab=V, hidden=H, layers=LAYERS, intermediate=64)
    native = NativeModel(model)

    class GraphStep:  # what a CUDA graph replay looks like from outside: the same output buffers every call
        max_tokens, graphs, calls = 4, True, 0
        last, feats = torch.zeros(1, 1, H), [torch.zeros(1, 1, H) for _ in range(LAYERS)]

        def __call__(self, x, *args):
            self.calls += 1
            for t in [self.last, *self.feats]:
                t.fill_(self.calls)
            return self.last, self.feats

    native.compiled = GraphStep()
    cache = native.new_cache()
    first = native.forward(torch.tensor([[3]]), cache, (1,))
    native.forward(torch.tensor([[4]]), cache, (1,))
    assert float(first.last_hidden.max()) == 1.0 and float(first.features[0].max()) == 1.0
    native.compiled.graphs = False  # CPU compile: outputs are fresh tensors, no copy
    assert native.forward(torch.tensor([[5]]), cache, (1,)).last_hidden is native.compiled.last


def test_compiled_step_gets_its_inputs_on_the_device(meta_model):
    """What the compiled step is called with (mask over the cache's capacity, sliding-window mask,
    slots, rope tables) is built on the device, for a decode step, a 2D padding mask and a tree's 4D mask."""
    from selfdraft.native import NativeModel
    from selfdraft.tree import tree_inputs

    native = NativeModel(meta_model)
    native.layers[1].window = 4  # a sliding-window layer: the `near` mask too

    class Step:
        max_tokens, graphs = 8, True

        def __call__(self, x, cos, sin, mask, near, rows, slots, keys, values):
            self.devices = {t.device for t in (x, cos, sin, mask, near, rows, slots, *keys, *values)}
            return torch.empty_like(x), [torch.empty_like(x) for _ in keys]

    native.compiled = Step()
    cache = native.new_cache()
    parents = torch.tensor([-1, 0, 0])
    tree = tree_inputs(parents, 6, torch.float32)
    with on_meta() as (_, audit):
        native.forward(torch.tensor([PROMPT[:6]]), cache)  # T = 6 <= max_tokens: compiled
        native.forward(torch.tensor([[3]]), cache, (1,), attention_mask=torch.ones(1, 7, dtype=torch.long))
        cache.rollback(6)
        native.forward(torch.tensor([[3, 4, 5, 6]]), cache, (1,), tree.position_ids, tree.attention_mask)
    assert native.compiled.devices == {META} and audit.mixed == [], audit.mixed


def test_cache_pool_hands_one_requests_buffers_to_the_next():
    """With CUDA graphs the cache keeps its addresses across requests: a new cache reuses the buffers of
    the last one once it is gone (never while it lives), and the output does not change."""
    import gc

    from selfdraft.methods.ngram.drafter import NgramDrafter
    from selfdraft.native.cache import CachePool

    target = Target(tiny_llama(), backend="native")
    ref = generate(target, NgramDrafter(), PROMPT, config=GenerationConfig(max_new_tokens=30)).token_ids
    target.native.pool = CachePool()
    a = target.new_cache()
    target.forward(torch.tensor([PROMPT]), a)
    b = target.new_cache()
    target.forward(torch.tensor([PROMPT]), b)
    assert a.keys[0] is not b.keys[0]  # a lives: b allocates its own
    buffers = b.keys[0]  # the same tensor object, not an address a CPU allocator may hand out again
    del a, b
    gc.collect()
    for _ in range(2):  # stale keys in the lent buffers never show
        assert generate(target, NgramDrafter(), PROMPT, config=GenerationConfig(max_new_tokens=30)).token_ids == ref
        c = target.new_cache()
        target.forward(torch.tensor([PROMPT]), c)
        assert c.keys[0] is buffers
        del c


def test_shared_dense_weights_hold_the_model_once_and_compute_the_same():
    """share_weights (the CUDA default): the HF parameters become row slices of the native fused
    projections, one copy of the model; both backends still compute what they did."""
    from selfdraft.native import NativeModel

    model = tiny_llama(layers=2)
    ids = torch.tensor([PROMPT])
    hf_before = model(ids).logits
    copy_logits = NativeModel(model).logits(NativeModel(model).forward(ids, None).last_hidden)
    native = NativeModel(model, share_weights=True)
    attn = model.model.layers[0].self_attn
    fused = native.layers[0].qkv.weight_t
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert model.model.layers[1].mlp.down_proj.weight.data_ptr() == native.layers[1].down.weight_t.data_ptr()
    torch.testing.assert_close(model(ids).logits, hf_before, rtol=0, atol=0)
    torch.testing.assert_close(native.logits(native.forward(ids, None).last_hidden), copy_logits, rtol=0, atol=0)


def test_expanded_kv_attention_equals_grouped_attention(monkeypatch):
    """The CUDA choice for masked GQA: SDPA gets the kv heads repeated (the memory-efficient kernel takes
    that, not enable_gqa) and computes the grouped attention; the CPU keeps SDPA's own grouping."""
    from selfdraft.native.ops import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 5, 8, generator=g) for n in (4, 2, 2))
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    mask[..., 0] = True
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((k.shape[1], kw["enable_gqa"])) or sdpa(q, k, v, **kw))
    torch.testing.assert_close(attention(q, k, v, mask, expand_kv=True), attention(q, k, v, mask))
    assert calls == [(4, False), (2, True)]


def test_profiles_are_keyed_and_timed_by_device(meta_model, monkeypatch):
    import selfdraft.profile as profile_mod
    from selfdraft.target import device_tag

    assert device_tag(torch.device("cpu")) == ""  # CPU keys are the ones of before
    assert Target(tiny_llama(), backend="native").profile_key == "native-fp32-float32"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    assert device_tag(torch.device("cuda", 0)) == "cuda-nvidia-h200"
    target = Target(meta_model, backend="native")
    assert target.profile_key == "native-fp32-float32-meta"
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    profile_mod.synchronize(torch.device("cuda", 0))
    profile_mod.synchronize(torch.device("cpu"))
    assert synced == [torch.device("cuda", 0)]
    waits = []
    monkeypatch.setattr(profile_mod, "synchronize", lambda d: waits.append(d))
    with on_meta() as (_, audit):
        prof = profile_mod.measure_sps(target, target.profile_key, [1, 2], kv_len=8, repeats=1)
    assert waits == [META] * 8 and len(prof.seconds) == 2 and audit.mixed == []  # before and after each timed forward


# ----------------------------------------------------------------------------- training
def test_resume_loads_trainer_state_to_the_cpu_and_the_drafter_to_the_targets_device(tmp_path, monkeypatch):
    """A GPU run's trainer_state.pt loads anywhere (map_location), and the resumed drafter lives with the
    target, as a fresh run's does (checked on meta: the loaded module must come off the CPU)."""
    import selfdraft.training.checkpointing as checkpointing_mod
    import selfdraft.training.trainer as trainer_mod
    from selfdraft.config import TrainConfig
    from tests.toy_training import write_dataset

    data = write_dataset(tmp_path / "data")
    cfg = methods.drafter_config({"method": "mtp", "gamma": 2})
    tcfg = TrainConfig(data=str(data), steps=1, batch_size=2, max_seq_len=32, val_every=0, save_every=0, bf16=False)
    cpu_target = Target(tiny_llama())
    trainer_mod.train(cpu_target, cfg, tcfg, tmp_path / "out")
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))
    plan = trainer_mod._plan(cpu_target, cfg, tcfg, None)
    meta_target = Target(cpu_target.model.to(META))
    monkeypatch.setattr(checkpointing_mod, "check_target", lambda *a: None)  # meta weights have no fingerprint to match
    monkeypatch.setattr("selfdraft.checkpoint.check_target", lambda *a: None)
    run = checkpointing_mod.start_or_resume(meta_target, plan.strategy, plan.cfg, tcfg, tmp_path / "out", True, len(plan.train_seqs))
    assert loads and all(kw.get("map_location") == "cpu" and kw.get("weights_only") for kw in loads)
    assert run.step == 1 and {p.device for p in run.model.parameters()} == {META}


def test_batches_reach_the_target_device(meta_model):
    """make_batch with cached features: every batch tensor on the target's device (pinned copies are for CUDA only)."""
    from selfdraft.training.trainer import Sequence, make_batch, to_device

    class Cached:
        def __init__(self, n):
            self.features, self.last_hidden, self.lse = torch.zeros(n, 2, H), torch.zeros(n, H), torch.zeros(n)

    target = Target(meta_model)
    with on_meta() as (_, audit):
        batch = make_batch([Sequence([1, 2, 3], [0, 1, 1], Cached(3)), Sequence([4, 5], [0, 1], Cached(2))], target, (1, 2))
    assert {t.device for t in vars(batch).values() if isinstance(t, torch.Tensor)} == {META} and audit.mixed == []
    t = torch.zeros(2)
    assert to_device(t, torch.device("cpu")) is t


def test_torchrun_binds_each_rank_to_its_gpu_and_fsdp_names_the_mesh_device(monkeypatch):
    import torch.distributed.device_mesh as mesh_mod
    import torch.distributed.fsdp as fsdp_mod

    from selfdraft.config import ConfigError
    from selfdraft.training.distributed import Distributed, bind_local_gpu

    bound = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert bind_local_gpu() == 1 and bound == [1]
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="one GPU per rank"):
        bind_local_gpu()
    meshes, sharded = [], []
    monkeypatch.setattr(mesh_mod, "init_device_mesh", lambda kind, shape: meshes.append((kind, shape)) or kind)
    monkeypatch.setattr(fsdp_mod, "fully_shard", lambda module, mesh=None: sharded.append(mesh))
    for cuda in (False, True):
        Distributed(rank=0, world=2, fsdp=True, cuda=cuda).wrap(torch.nn.Linear(2, 2), None, None, None)
    assert meshes == [("cpu", (2,)), ("cuda", (2,))] and sharded == ["cpu", "cuda"]


# ----------------------------------------------------------------------------- the CLI
def test_train_and_data_take_the_one_device_option():
    """--device is declared once (cli/common.py) and reused by train and the data commands."""
    from selfdraft.cli import common, data, train

    for fn in (train.train_cmd, data.data_regenerate, data.data_features, data.data_original):
        assert inspect.signature(fn).parameters["device"].default is common.DeviceOpt, fn.__name__


COMMANDS = {"train": ["train", "--out", "OUT", "--data", "DATA", "--method", "mtp"],
            "regenerate": ["data", "regenerate", "sharegpt", "--out", "OUT", "--limit", "1"],
            "features": ["data", "features", "DATA", "--out", "OUT", "--yes"], "original": ["data", "original", "--out", "OUT"],
            "generate": ["generate", "-p", "hi"]}


def _invoke(name: str, tmp_path, *extra: str):
    from typer.testing import CliRunner

    from selfdraft.cli import app
    from tests.toy_training import write_dataset

    args = [str(tmp_path / a) if a in ("OUT", "DATA") else a for a in COMMANDS[name]]
    if "DATA" in COMMANDS[name]:
        write_dataset(tmp_path / "DATA")
    return CliRunner().invoke(app, [*args, *extra])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("name", list(COMMANDS))
def test_device_cuda_without_cuda_is_a_one_line_error(name, tmp_path):
    res = _invoke(name, tmp_path, "--device", "cuda")
    assert res.exit_code == 2 and "no CUDA device" in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("name", ["train", "regenerate", "features", "original"])
def test_the_device_reaches_the_target(name, tmp_path, monkeypatch):
    from selfdraft.errors import SelfdraftError
    from selfdraft.target import Target as T

    seen = []

    def load(*args, **kw):
        seen.append(kw.get("device"))
        raise SelfdraftError("stop here")  # the target is all this test is about

    monkeypatch.setattr(T, "load", load)
    res = _invoke(name, tmp_path, "--device", "cpu")
    assert seen == ["cpu"] and "stop here" in res.output, res.output
