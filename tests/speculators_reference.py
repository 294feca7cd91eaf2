"""Reference drafts and load reports through speculators' own model classes (no selfdraft import).

Run by tests/test_export.py with an interpreter that has `speculators` (it pins its own transformers,
so it usually lives in a separate virtual environment):
    python speculators_reference.py CASES.json OUT.safetensors
CASES.json: [{"dir": exported checkpoint, "inputs": safetensors with ids [n+1], features [n, F], last_hidden
[n, H], optional forced [γ]} or {"dir", "report_only": true}, ...]. For case i, OUT holds i.tokens [γ] (target ids), i.logits [γ, V]
(-inf outside the draft vocabulary), i.conf [γ] (empty without a confidence head); stdout ends with one
JSON line: per case the load report {missing, unexpected, mismatched, nan, not_shipped} of speculators' loader.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def load(dir: str):
    """speculators' own loading path, plus the report its Hugging Face loader produces.

    `SpeculatorModel.from_pretrained(dir)` is what users (and vLLM's tooling) call; it drops the
    loading info, so the same load runs once more through the concrete class with
    output_loading_info=True, followed by the verifier-weight step from_pretrained does itself."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    SpeculatorModel.from_pretrained(dir)  # must load as a user loads it
    config = SpeculatorModelConfig.from_pretrained(dir)
    config.transformer_layer_config._attn_implementation = "eager"  # plain masks on CPU
    cls = SpeculatorModel.registered_model_class_from_config(config)
    # float32: the function of the shipped tensors (vLLM computes in the served dtype; config.json's
    # torch_dtype, the drafter's, would round float32 verifier LM-head rows to bf16 here)
    model, info = super(SpeculatorModel, cls).from_pretrained(dir, config=config, output_loading_info=True,
                                                              dtype=torch.float32)  # fmt: skip
    # speculators marks the tensors the verifier supplies (embedding, a full-vocabulary LM head) with a NaN
    # sentinel, and its EAGLE-3 load_verifier_weights fills only a NaN tensor; transformers 5 builds the
    # model on the meta device and then allocates those tensors uninitialised, so the sentinel is lost
    # and EAGLE-3 drafted from whatever memory the embedding got (speculators' MTP re-sets the sentinel
    # itself for this reason; speculators PR #962 dropped the guard for DFlash / DSpark). Re-set it for
    # every such tensor the checkpoint does not ship, so `nan` below catches one the verifier did not fill.
    with safe_open(f"{dir}/model.safetensors", "pt") as f:
        shipped = {k.removeprefix("model.") for k in f.keys()}
    state = model.state_dict()
    with torch.no_grad():
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in state and name not in shipped:
                model.get_parameter(name).fill_(torch.nan)
    model.load_verifier_weights()
    model = model.float().eval()
    # transformers builds the model on the meta device and does not recompute the rotary embedding's
    # non-persistent inv_freq buffer for these custom modules (it holds whatever memory it got, so
    # drafts were not even reproducible): rebuild that module from its own config. No weight changes.
    rot = model.rotary_emb
    fresh = type(rot)(rot.config).float()
    if not torch.allclose(rot.inv_freq, fresh.inv_freq):
        print(f"{dir}: rotary inv_freq left uninitialised by the loader; rebuilt", file=sys.stderr)
    model.rotary_emb = fresh
    nan = sorted(k for k, v in model.state_dict().items() if v.is_floating_point() and bool(v.isnan().any()))
    report = {k: sorted(map(str, info.get(k, []))) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    report["nan"] = nan  # a parameter the loader left at its NaN sentinel is missing in disguise
    # Stricter than the loader's missing_keys, which skips its ignore list (d2t, t2d, lm_head, ...): every
    # tensor of the module comes from the checkpoint, except those the verifier supplies.
    from_verifier = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    if "lm_head.weight" in (getattr(model, "_keys_to_ignore_on_load_missing", None) or []):
        from_verifier.add("lm_head.weight")  # DFlash / DSpark full vocabulary, MTP: the verifier's own head
    report["not_shipped"] = sorted(set(model.state_dict()) - shipped - from_verifier)
    return model, config, report


def to_target(model, draft_ids: torch.Tensor) -> torch.Tensor:
    d2t = getattr(model, "d2t", None)
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def full_logits(model, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V'] draft-vocabulary logits -> [V] (-inf outside)."""
    ids = to_target(model, torch.arange(logits.shape[-1]))
    return logits.new_full((vocab_size,), float("-inf")).index_copy_(0, ids, logits)


def choose(k: int, logits: torch.Tensor, model, forced) -> int:
    return int(forced[k]) if forced is not None else int(to_target(model, logits.argmax().view(1))[0])


@torch.no_grad()
def dflash(model, config, x: dict, forced, temps) -> tuple:
    """One block: [anchor, mask, ..] over the fused context, then the serial Markov / confidence heads."""
    ids, feats = x["ids"], x["features"]
    n, L = feats.shape[0], config.block_size
    offset = 0 if config.sample_from_anchor else 1
    g = L - offset
    block = torch.tensor([int(ids[n])] + [config.mask_token_id] * (L - 1))
    h = model.embed_tokens(block)[None]  # [1, L, H]
    ctx = model.hidden_norm(model.fc(feats[None]))  # [1, n, H]
    pos = torch.arange(n + L)[None]
    pe = model.rotary_emb(h, pos)
    for layer in model.layers:  # no mask: the block sees the whole context and itself
        h = layer(hidden_states=h, target_hidden=ctx, attention_mask=None, position_ids=pos, position_embeddings=pe)
    h = model.norm(h)[0, offset : offset + g]  # [g, H]
    U = model.lm_head(h)  # [g, V']
    markov, conf_head = getattr(model, "markov_head", None), getattr(model, "confidence_head", None)
    prev, tokens, logits, conf = [int(ids[n])], [], [], []
    for k in range(g):
        logit = U[k]
        if markov is not None:
            logit = logit + markov.block_bias(prev_token_ids=torch.tensor([prev]), hidden_states=h[None, : k + 1])[0, k]
        if conf_head is not None:
            feat = h[k]
            if config.confidence_head_with_markov:
                feat = torch.cat([feat, markov.prev_embeddings(torch.tensor(prev[-1]))])
            conf.append(torch.sigmoid(conf_head(feat) / temps[k]))
        tokens.append(choose(k, logit, model, forced))
        logits.append(full_logits(model, logit, config.transformer_layer_config.vocab_size))
        prev.append(tokens[-1])
    return tokens, torch.stack(logits), torch.stack(conf) if conf else torch.zeros(0)


def causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


@torch.no_grad()
def eagle3(model, config, x: dict, forced, gamma: int) -> tuple:
    """vLLM's EAGLE-3 proposer, with speculators' layer: slots 0..n-1 read (embed x_{s+1}, fc(features_s)) at
    position s; draft step j reads (embed d_j, the pre-norm output of step j-1) one position further;
    causal over the whole sequence, recomputed per step (the same as vLLM's KV cache)."""
    ids, feats = x["ids"], x["features"]
    n = feats.shape[0]
    g = model.fc(feats)  # [n, H]
    toks, hs, out_tokens, logits = [int(t) for t in ids[1 : n + 1]], [g], [], []
    for k in range(gamma):
        seq = torch.cat([model.embed_tokens(torch.tensor(toks)), torch.cat(hs)], -1)[None]  # [1, S, 2H]
        pos = torch.arange(seq.shape[1])[None]
        out = model.layers[0](hidden_states=seq, attention_mask=causal(seq.shape[1]), position_ids=pos,
                              position_embeddings=model.rotary_emb(seq, pos))  # fmt: skip
        h = out[0] if isinstance(out, tuple) else out
        h = h[0, -1]  # [H] pre-norm output of the last position
        logit = model.lm_head(model.norm(h))
        out_tokens.append(choose(k, logit, model, forced))
        logits.append(full_logits(model, logit, config.transformer_layer_config.vocab_size))
        toks.append(out_tokens[-1])
        hs.append(h[None])
    return out_tokens, torch.stack(logits), torch.zeros(0)


@torch.no_grad()
def mtp(model, config, x: dict, forced, gamma: int) -> tuple:
    """speculators' own teacher-forced MTPDraftModel.forward over [x_0..x_n, d_1..d_γ]: step k's logits at
    slot n-1 draft d_{k+1}; rerun as the chain grows (greedy) or once (forced chain)."""
    ids, h0 = x["ids"], x["last_hidden"]
    n = h0.shape[0]
    chain = [int(t) for t in forced] if forced is not None else [0] * gamma
    hidden = torch.cat([h0, h0.new_zeros(gamma + 1, h0.shape[1])])[None]  # rows past n-1 are never read by slot n-1
    for k in range(1 if forced is not None else gamma):
        input_ids = torch.tensor([[int(t) for t in ids[: n + 1]] + chain])
        all_logits, _, _ = model(input_ids=input_ids, hidden_states=hidden)
        if forced is None:
            chain[k] = int(all_logits[k][0, n - 1].argmax())
    logits = torch.stack([all_logits[k][0, n - 1] for k in range(gamma)])
    return chain, logits, torch.zeros(0)


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    out, reports = {}, []
    for i, case in enumerate(cases):
        model, config, report = load(case["dir"])
        reports.append(report)
        if case.get("report_only"):
            continue
        x = load_file(case["inputs"])
        x = {k: (v.float() if v.is_floating_point() else v) for k, v in x.items()}
        forced = x.get("forced")
        method = config.speculators_model_type
        gamma = config.speculators_config.proposal_methods[0].speculative_tokens
        if method in ("dflash", "dspark"):
            mine = json.load(open(f"{case['dir']}/config.json")).get("selfdraft") or {}  # T_k: no speculators field
            temps = mine.get("confidence_temperatures") or [1.0] * gamma
            tokens, logits, conf = dflash(model, config, x, forced, temps)
        else:
            tokens, logits, conf = (eagle3 if method == "eagle3" else mtp)(model, config, x, forced, gamma)
        out[f"{i}.tokens"] = torch.tensor(tokens, dtype=torch.long)
        out[f"{i}.logits"] = logits.float().contiguous()
        out[f"{i}.conf"] = conf.float().reshape(-1).contiguous()
    save_file(out, sys.argv[2])
    print(json.dumps(reports))


if __name__ == "__main__":
    main()
