"""--compile: the torch.compile'd native step computes what the eager native step computes (float32,
<= 1e-4) through decode, verify, rollback, ragged rows, tree masks and sliding windows, greedy
generation is token for token the same, and what it cannot compile is refused with a message or
stays eager. Block lengths 1..5 (γ = 4) compile up front, about a minute on a tiny model, so the tests
share one compiled target."""

from __future__ import annotations

import gc

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache
from typer.testing import CliRunner

from selfdraft.cli import app
from selfdraft.config import GenerationConfig
from selfdraft.decode import generate
from selfdraft import methods
from selfdraft.target import Target, TargetError
from selfdraft.tree import tree_inputs
from tests.helpers import assert_steps_close, build

slow = pytest.mark.slow  # torch.compile: 10-40 s per block length on a tiny model, a loaded CPU


@pytest.fixture(scope="module")
def pair():
    """(eager, compiled) native targets over the same HF model (llama with every bias)."""
    torch.set_num_threads(1)  # as conftest sets it for each test: a graph is guarded on the thread count
    model = build("llama")
    return Target(model, backend="native"), Target(model, backend="native", compile=5)


@slow
def test_compiled_equals_eager_through_decode_verify_rollback(pair):
    eager, comp = pair
    assert comp.native.compiled is not None and comp.profile_key.endswith("-compiled")
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    c_e, c_c = eager.new_cache(), comp.new_cache()
    c_e.min_capacity = c_c.min_capacity = 16  # the cache grows 32 -> 48 below, the graph must not change
    graphs = counters["stats"]["unique_graphs"]  # all of T = 1..5 were compiled when comp was built
    # prefill (eager in both: longer than the compiled block lengths), decode-1, verify-4 (the cache
    # grows), rolled back by 3, verify-4 again over the stale slots, decode-1 at the new capacity
    for sl, back in ((slice(0, 30), None), (slice(30, 31), None), (slice(31, 35), 32), (slice(32, 36), None),
                     (slice(36, 37), None)):
        assert_steps_close(eager.forward(ids[:, sl], c_e, (0, 1)), comp.forward(ids[:, sl], c_c, (0, 1)))
        if back is not None:
            eager.rollback(c_e, back)
            comp.rollback(c_c, back)
    assert c_c.lengths == c_e.lengths == [37] and c_c.capacity == 48
    assert counters["stats"]["unique_graphs"] == graphs  # no graph per context, capacity or rollback


@slow
def test_compiled_ragged_rows_and_tree_mask(pair):
    eager, comp = pair
    seq = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    c_e, c_c = eager.new_cache(), comp.new_cache()
    eager.forward(seq, c_e)
    comp.forward(seq, c_c)
    c_e.lengths[0] = c_c.lengths[0] = 20  # row 0 rolled back by 4: its stale slots must stay hidden
    block = seq[:, :4].flip(1)
    assert_steps_close(eager.forward(block, c_e, (1,)), comp.forward(block, c_c, (1,)))
    assert c_c.lengths == [24, 28]
    # a tree of 4 nodes (root, two children of it, one grandchild) after a uniform cache
    c_e, c_c = eager.new_cache(), comp.new_cache()
    eager.forward(seq[:1], c_e)
    comp.forward(seq[:1], c_c)
    t = tree_inputs(torch.tensor([-1, 0, 0, 1]), 24, torch.float32)  # 4 nodes after the anchor
    ids = seq[:1, 4:9]
    assert_steps_close(eager.forward(ids, c_e, (), t.position_ids, t.attention_mask),
                       comp.forward(ids, c_c, (), t.position_ids, t.attention_mask))


@slow
def test_compiled_greedy_generation_equals_eager(pair):
    eager, comp = pair
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(4)).tolist() * 2  # n-gram hits
    cfg = GenerationConfig(max_new_tokens=30, gamma=4)
    for name in ("none", "ngram"):
        ref = generate(eager, methods.get(name).new(eager), prompt, config=cfg).token_ids
        assert generate(comp, methods.get(name).new(comp), prompt, config=cfg).token_ids == ref, name


@slow
def test_compiled_sliding_window_beyond_the_window():
    model = build("mistral-window-6")
    eager, comp = Target(model, backend="native"), Target(model, backend="native", compile=3)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(5))
    c_e, c_c = eager.new_cache(), comp.new_cache()
    for sl in (slice(0, 10), slice(10, 11), slice(11, 14)):  # the window of 6 is exceeded
        assert_steps_close(eager.forward(ids[:, sl], c_e), comp.forward(ids[:, sl], c_c))


def test_compile_refusals(tmp_path):
    model = build("llama")
    with pytest.raises(TargetError, match="native backend"):
        Target(model, backend="hf", compile=5)
    with pytest.raises(TargetError, match=r"dense \(fp32 / bf16\) or fp16 weights"):
        Target(model, backend="native", weights="int8", compile=5)
    model.save_pretrained(tmp_path / "t")
    res = CliRunner().invoke(app, ["generate", "--target", str(tmp_path / "t"), "--backend", "hf", "--compile", "-p", "hi"])
    assert res.exit_code == 2 and res.output.startswith("error: --compile compiles the native backend"), res.output


@slow
def test_the_batched_engines_dynamic_cache_stays_eager(pair):
    eager, comp = pair
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(6))
    d_e, d_c = DynamicCache(config=eager.model.config), DynamicCache(config=eager.model.config)
    assert_steps_close(eager.forward(ids, d_e), comp.forward(ids, d_c))
    assert_steps_close(eager.forward(ids[:, :1], d_e), comp.forward(ids[:, :1], d_c))


@slow
def test_two_compiled_models_keep_their_own_weights():
    """The weights are frozen into the graph: a second model of the same shapes must not reuse the first's."""
    models = [build("llama", seed=s) for s in (0, 1)]
    comps = [Target(m, backend="native", compile=1) for m in models]
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(7))
    for m, comp in zip(models, comps):
        eager = Target(m, backend="native")
        c_e, c_c = eager.new_cache(), comp.new_cache()
        eager.forward(ids[:, :8], c_e)
        comp.forward(ids[:, :8], c_c)  # T = 8: eager in both
        assert_steps_close(eager.forward(ids[:, 8:], c_e), comp.forward(ids[:, 8:], c_c))


@slow
def test_compiled_fp16_weights_equal_eager_fp16_and_keep_their_own_weights():
    """fp16 weights stay in FBGEMM's packed form, called from the graph by handle: compiled = eager
    fp16 (decode, verify, greedy generation) for two models of the same shapes, and a dropped
    model's packed weights leave the handle table."""
    from selfdraft.native import compiled

    models = [build("llama", seed=s) for s in (0, 1)]
    comps = [Target(m, backend="native", weights="fp16", compile=2) for m in models]
    assert all(c.native.compiled.mode == "default" for c in comps)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(8))
    for m, comp in zip(models, comps):
        eager = Target(m, backend="native", weights="fp16")
        c_e, c_c = eager.new_cache(), comp.new_cache()
        for sl in (slice(0, 9), slice(9, 10), slice(10, 12)):  # prefill (eager in both), decode-1, verify-1
            assert_steps_close(eager.forward(ids[:, sl], c_e, (0, 1)), comp.forward(ids[:, sl], c_c, (0, 1)))
        cfg = GenerationConfig(max_new_tokens=12, gamma=1)
        prompt = ids[0, :6].tolist()
        none = methods.get("none")
        assert generate(comp, none.new(comp), prompt, config=cfg).token_ids == generate(eager, none.new(eager), prompt, config=cfg).token_ids
    held = len(compiled._PACKED)
    del comps[1], comp
    gc.collect()
    assert len(compiled._PACKED) == held - 4 * models[1].config.num_hidden_layers
