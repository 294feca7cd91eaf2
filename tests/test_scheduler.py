"""Schedulers: Algorithm 1 against hand-computed cases and a brute force over the early-stopped greedy
path; admission never reads an unsampled token; the paper's Appendix A (a (0.7, 0.3) target turns
into (0.85, 0.15) under a global search without the early stop, stays exact with it), both with the
verification functions directly and end to end through the engine."""

from __future__ import annotations

import itertools
import math
import random
from functools import partial

import pytest
import torch
from scipy.stats import chisquare

import selfdraft.scheduler as sched_mod
from selfdraft.config import GenerationConfig, SamplingParams
from selfdraft.drafters import Drafter, Proposal
from selfdraft.engine import Engine
from selfdraft.sampling import probs_from_logits
from selfdraft.scheduler import CostTable, Scheduler, hardware_lengths, padded_lengths, threshold_lengths, with_overhead
from selfdraft.target import Target
from selfdraft.verify import verify_chain
from tests.helpers import tiny_llama


def test_cost_table_interpolates_and_saturates():
    t = CostTable((1, 4, 8), (10.0, 7.0, 5.0))
    assert t(1) == 10.0 and t(0) == 10.0 and t(4) == 7.0 and t(2) == pytest.approx(9.0) and t(6) == pytest.approx(6.0)
    assert t(16) == pytest.approx(2.5)  # beyond the table: tokens/s stays SPS(8)·8


def test_algorithm1_hand_computed():
    c = [torch.tensor([0.9, 0.9, 0.5]), torch.tensor([0.6, 0.5])]  # a = (.9, .81, .405), (.6, .3)
    assert hardware_lengths(c, lambda B: 10.0) == [3, 2]  # light load (memory bound): verify everything
    assert hardware_lengths(c, lambda B: 10.0 / B) == [0, 0]  # compute bound: only a = 1 drafts would pay
    # B=2 Θ=20 | +.9 B=3 Θ=29 | +.81 B=4 Θ=37.1 | +.6 B=5 Θ=4.31·9=38.79 | +.405 B=6 Θ=4.715·7=33.0 stop
    table = CostTable((1, 2, 3, 4, 5, 6, 7), (10.0, 10.0, 10.0, 10.0, 9.0, 7.0, 5.0))
    assert hardware_lengths(c, table) == [2, 1]
    assert threshold_lengths(c, 0.5) == [2, 1] and threshold_lengths(c, 0.95) == [0, 0]


def brute_force_early_stopped(conf: list[list[float]], sps) -> list[int]:
    """Slow reference: Θ of every prefix of the sorted candidate path, computed from scratch; the
    answer is the last prefix before Θ first fails to increase."""
    R = len(conf)
    a = {(r, j): math.prod(c[:j]) for r, c in enumerate(conf) for j in range(1, len(c) + 1)}
    order = sorted((rj for rj in a if a[rj] > 0), key=lambda rj: (-a[rj], rj))

    def theta(n: int) -> tuple[float, list[int]]:
        lengths = [max([j for rr, j in order[:n] if rr == r], default=0) for r in range(R)]
        tau = R + sum(a[(r, j)] for r in range(R) for j in range(1, lengths[r] + 1))
        return tau * sps(R + sum(lengths)), lengths

    n = 0
    while n < len(order) and theta(n + 1)[0] > theta(n)[0]:
        n += 1
    return theta(n)[1]


def random_table(rng: random.Random) -> CostTable:
    """A plausible SPS(B): flat while memory bound, then falling (random knee and slope)."""
    bs = (1, 2, 4, 8, 16, 32, 64)
    knee, slope, s, out = rng.choice(bs), rng.uniform(0.3, 1.0), 20.0, []
    for b in bs:
        s = s if b <= knee else s * (1 - slope * rng.uniform(0.2, 0.6))
        out.append(s)
    return CostTable(bs, tuple(out))


def test_algorithm1_equals_brute_force_on_random_cases():
    rng = random.Random(0)
    for _ in range(300):
        conf = [[rng.choice([rng.random(), 1.0, 0.0]) if rng.random() < 0.1 else rng.random() ** 0.3
                 for _ in range(rng.randint(0, 7))] for _ in range(rng.randint(1, 6))]
        table = random_table(rng)
        got = hardware_lengths([torch.tensor(c, dtype=torch.float64) for c in conf], table)
        assert got == brute_force_early_stopped(conf, table), (conf, table)


def admitted_depends_on_later_confidences(early_stop: bool, cases: int = 200, padded: bool = False) -> bool:
    """True if some {ℓ_r ≥ j} changes when only c_{r,j+1..} (which read drafts x_{≥j}) change."""
    rng = random.Random(1)
    for _ in range(cases):
        conf = [[rng.random() ** 0.3 for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 4))]
        table = random_table(rng)

        def run(cs: list[list[float]]) -> list[int]:
            cs = [torch.tensor(c, dtype=torch.float64) for c in cs]
            if padded:
                return padded_lengths(cs, table, rows=len(cs), early_stop=early_stop)
            return hardware_lengths(cs, table, early_stop=early_stop)

        base = run(conf)
        for r, c in enumerate(conf):
            for j in range(len(c) + 1):
                for _ in range(3):
                    other = [list(x) for x in conf]
                    other[r][j:] = [rng.random() for _ in c[j:]]
                    if (run(other)[r] >= j) != (base[r] >= j):
                        return True
    return False


def test_admission_never_reads_an_unsampled_token():
    for padded in (False, True):
        assert not admitted_depends_on_later_confidences(early_stop=True, padded=padded)
        assert admitted_depends_on_later_confidences(early_stop=False, padded=padded)  # the global search does


def brute_force_padded(conf: list[list[float]], sps, floor: int = 0) -> list[int]:
    """Slow reference for the padded engine: Θ(W) = (R + Σ_r Σ_{j≤min(W,γ_r)} a_{r,j}) · SPS(R·(W+1))
    from scratch for every width; the answer is the last W before Θ first fails to increase."""
    R, gamma = len(conf), max(len(c) for c in conf)

    def theta(W: int) -> float:
        tau = R + sum(math.prod(c[:j]) for c in conf for j in range(1, min(W, len(c)) + 1))
        return tau * sps(R * (W + 1))

    W = floor
    while W < gamma and theta(W + 1) > theta(W):
        W += 1
    return [min(W, len(c)) for c in conf]


def test_padded_algorithm_equals_brute_force_and_algorithm1_for_one_request():
    rng = random.Random(2)
    for _ in range(300):
        conf = [[rng.random() ** 0.3 for _ in range(rng.randint(0, 7))] for _ in range(rng.randint(1, 6))]
        if not any(conf):
            continue
        table, floor = random_table(rng), rng.choice([0, 0, 1, 2])
        floor = min(floor, max(len(c) for c in conf))
        tens = [torch.tensor(c, dtype=torch.float64) for c in conf]
        assert padded_lengths(tens, table, len(conf), floor) == brute_force_padded(conf, table, floor), (conf, table)
        assert padded_lengths(tens[:1], table, 1) == hardware_lengths(tens[:1], table)


def test_padded_pricing_and_drafting_overhead():
    # Two requests; a = (.9, .45), (.2, .1). SPS halves from B=2 to B=4: one column costs 2x.
    c = [torch.tensor([0.9, 0.5]), torch.tensor([0.2, 0.5])]
    table = CostTable((2, 4, 6), (10.0, 5.0, 2.0))
    # Θ(0) = 2·10 = 20, Θ(1) = 3.1·5 = 15.5: the padded engine verifies nothing ...
    assert padded_lengths(c, table, rows=2) == [0, 0]
    # ... while Σ(ℓ+1) pricing admits request 0's first draft (B=3, Θ = 2.9·7.5 = 21.75): the
    # forward would still carry 2·2 = 4 tokens.
    assert hardware_lengths(c, table) == [1, 0]
    # A 0.2 s draft pass paid either way: Θ(0) = 2/(0.1+0.2) = 6.7 < Θ(1) = 3.1/(0.2+0.2) = 7.75.
    assert padded_lengths(c, with_overhead(table, 0.2), rows=2) == [1, 1]
    s = Scheduler("hardware", cost=table)
    props = [Proposal(torch.tensor([1, 2]), confidences=x) for x in c]
    assert s.lengths(props) == [0, 0] and s.lengths(props, overhead_s=0.2) == [1, 1]


def test_scheduler_falls_back_to_fixed_without_confidences():
    s = Scheduler("hardware", cost=CostTable((1,), (1.0,)))
    props = [Proposal(torch.tensor([1, 2, 3])), Proposal(torch.tensor([4, 5]), confidences=torch.tensor([0.9, 0.1]))]
    with pytest.warns(UserWarning, match="no confidences"):
        lengths = s.lengths(props)
    assert lengths[0] == 3
    assert Scheduler("fixed").lengths(props) == [3, 2]


# ----------------------------------------------------------------------------- Appendix A
# One request, γ = 2, drafts from q; c_1 = 0.5, c_2 = 1 if x_1 is token m else 0.01 (c_2 reads x_1).
# DIP: Θ(ℓ=0) = 1 > Θ(1) = 0.9, but Θ(2) = 1.2 if x_1 = m (0.903 otherwise): the early stop keeps
# ℓ = 0; a global search verifies x_1 exactly when x_1 = m. RISE: the early stop picks ℓ = 1 or 2
# depending on x_1 (allowed: x_1 is verified either way).
DIP = CostTable((1, 2, 3), (1.0, 0.6, 0.6))
RISE = CostTable((1, 2, 3), (1.0, 0.9, 0.8))


def appendix_a_confidences(x: torch.Tensor, m: int) -> torch.Tensor:
    return torch.tensor([0.5] + [1.0 if int(x[k - 1]) == m else 0.01 for k in range(1, len(x))])


def first_two_tokens(table: CostTable, early_stop: bool, n: int = 2000) -> dict[tuple[int, int], int]:
    """Target p = (0.7, 0.3) at every position, q = (0.5, 0.5), m = token 0. One round, then the
    second token from a plain target step when the round committed only one."""
    p, q = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])
    g = torch.Generator().manual_seed(0)
    counts = dict.fromkeys(itertools.product((0, 1), repeat=2), 0)
    for _ in range(n):
        x = torch.multinomial(q, 2, replacement=True, generator=g)
        ell = hardware_lengths([appendix_a_confidences(x, 0)], table, early_stop=early_stop)[0]
        v = verify_chain(p.expand(ell + 1, 2), x[:ell], q.expand(ell, 2), g)
        y = v.tokens + [int(torch.multinomial(p, 1, generator=g))]
        counts[(y[0], y[1])] += 1
    return counts


def test_appendix_a_global_search_is_biased_early_stop_is_exact():
    law = {(a, b): (0.7, 0.3)[a] * (0.7, 0.3)[b] for a, b in itertools.product((0, 1), repeat=2)}
    for table in (DIP, RISE):
        counts = first_two_tokens(table, early_stop=True)
        assert chisquare(list(counts.values()), [law[k] * 2000 for k in counts]).pvalue > 1e-3
    biased = first_two_tokens(DIP, early_stop=False)
    p0 = (biased[(0, 0)] + biased[(0, 1)]) / 2000
    assert abs(p0 - 0.85) < 0.025  # the paper's (0.7, 0.3) -> (0.85, 0.15)


class AppendixADrafter(Drafter):
    """Drafts uniformly at random (q uniform over V); c_1 = 0.5, c_2 = 1 if x_1 == m else 0.01."""

    gives_confidences = True

    def __init__(self, vocab: int, m: int) -> None:
        self.vocab, self.m = vocab, m

    def propose(self, tokens, gamma, params, generator):
        if gamma == 0:
            return Proposal.empty()
        x = torch.randint(self.vocab, (gamma,), generator=generator)
        return Proposal(x, torch.full((gamma, self.vocab), 1.0 / self.vocab), appendix_a_confidences(x, self.m))


V_SMALL = 4


def engine_joint_pvalue(target: Target, table: CostTable, n: int = 500) -> float:
    """Chi-square of (y_1, y_2) from the engine (hardware scheduler on `table`) vs the target's law."""
    prompt, params = [1, 3, 2], SamplingParams(temperature=1.0)
    law = {}
    with torch.no_grad():
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], params)
        for y1 in range(V_SMALL):
            p2 = probs_from_logits(target.model(torch.tensor([prompt + [y1]])).logits[0, -1], params)
            for y2 in range(V_SMALL):
                law[(y1, y2)] = float(p1[y1] * p2[y2])
    engine = Engine(target, Scheduler("hardware", cost=table), max_concurrency=1)
    cfg = GenerationConfig(max_new_tokens=4, gamma=2, stop_on_eos=False)
    for s in range(n):
        engine.add_request(prompt, AppendixADrafter(V_SMALL, m=0), SamplingParams(temperature=1.0, seed=s), cfg)
    counts = dict.fromkeys(law, 0)
    for res in engine.run().values():
        counts[tuple(res.token_ids[:2])] += 1
    total = sum(law.values())  # float32 probabilities: renormalise in float64 so the expected counts sum to n
    return float(chisquare(list(counts.values()), [law[k] / total * n for k in counts]).pvalue)


def test_appendix_a_through_the_engine(monkeypatch):
    target = Target(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0))
    assert engine_joint_pvalue(target, RISE) > 1e-3  # ℓ = 1 or 2, chosen after seeing x_1: still exact
    monkeypatch.setattr(sched_mod, "padded_lengths", partial(padded_lengths, early_stop=False))
    assert engine_joint_pvalue(target, DIP) < 1e-5  # x_1 verified only when x_1 = m: biased (p ≈ 1e-8 here)


def test_profile_cli_stores_table_the_hardware_scheduler_loads(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from selfdraft.cli import app
    from selfdraft.profile import load_cost_table, profile_path

    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    tiny_llama(vocab=32, hidden=16, layers=2).save_pretrained(tmp_path / "t")
    res = CliRunner().invoke(app, ["profile", "--target", str(tmp_path / "t"), "--dtype", "float32",
                                   "--max-tokens", "6", "--kv-len", "8", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    target = Target.load(str(tmp_path / "t"), dtype="float32", backend="auto")  # as the CLI loads it
    assert target.profile_key == "native-fp32-float32"  # profiles are per backend and weight format
    table = load_cost_table(target, target.profile_key)
    assert table.batch_tokens == (1, 2, 3, 4, 6) and all(s > 0 for s in table.sps)
    assert profile_path(target, target.profile_key).with_suffix(".png").stat().st_size > 1000
    assert "SPS(B)" in res.output


def generate_joint_pvalue(target: Target, table: CostTable, n: int = 500) -> float:
    """As engine_joint_pvalue, through the single-request loop (decode.generate with a scheduler)."""
    from selfdraft.decode import generate

    prompt = [1, 3, 2]
    with torch.no_grad():
        params = SamplingParams(temperature=1.0)
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], params)
        law = {(a, b): float(p1[a] * probs_from_logits(target.model(torch.tensor([prompt + [a]])).logits[0, -1], params)[b])
               for a in range(V_SMALL) for b in range(V_SMALL)}
    sched = Scheduler("hardware", cost=table, padded=False)
    cfg = GenerationConfig(max_new_tokens=4, gamma=2, stop_on_eos=False)
    counts = dict.fromkeys(law, 0)
    for s in range(n):
        res = generate(target, AppendixADrafter(V_SMALL, m=0), prompt, SamplingParams(temperature=1.0, seed=s), cfg,
                       scheduler=sched)
        counts[tuple(res.token_ids[:2])] += 1
    total = sum(law.values())
    return float(chisquare(list(counts.values()), [law[k] / total * n for k in counts]).pvalue)


def test_appendix_a_through_generate(monkeypatch):
    target = Target(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0))
    assert generate_joint_pvalue(target, RISE) > 1e-3


    def global_search(self, tokens, gamma, params, generator, admission):  # reads c_2 to decide on x_1
        p = self.propose(tokens, gamma, params, generator)
        return p if p.confidences is None else p.truncate(hardware_lengths([p.confidences], DIP, early_stop=False)[0])

    monkeypatch.setattr(AppendixADrafter, "propose_until", global_search)
    assert generate_joint_pvalue(target, DIP) < 1e-5  # the broken cut is caught through this loop too


def test_generate_with_scheduler_verifies_what_pays_and_stays_greedy_exact():
    """A cost table where verifying anything costs more than it can earn -> no draft verified; a
    flat one -> all of them; the greedy output equals plain decoding either way."""
    from selfdraft.decode import generate

    target = Target(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0))
    cfg = GenerationConfig(max_new_tokens=12, gamma=2, stop_on_eos=False)
    plain = generate(target, AppendixADrafter(V_SMALL, m=0), [1, 3, 2], SamplingParams(seed=0), cfg)
    steep, flat = CostTable((1, 2), (1.0, 0.1)), CostTable((1, 3), (1.0, 1.0))
    for table, verified in ((steep, 0), (flat, 2)):
        res = generate(target, AppendixADrafter(V_SMALL, m=0), [1, 3, 2], SamplingParams(seed=0), cfg,
                       scheduler=Scheduler("hardware", cost=table, padded=False))
        assert res.token_ids == plain.token_ids
        assert max(r.proposed for r in res.rounds) == verified


def test_scheduler_for_auto_measures_once_and_picks_by_drafter(tmp_path, monkeypatch):
    from selfdraft.config import ConfigError
    from selfdraft.loader import load_drafter
    from selfdraft.profile import profile_path, scheduler_for

    import selfdraft.profile as profile_mod

    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(profile_mod, "busy_cpu_seconds", lambda: None)  # whatever else runs beside the test
    target = Target(tiny_llama(vocab=32, hidden=16, layers=2))
    conf = AppendixADrafter(32, m=0)
    conf.gives_confidences = True
    ngram = load_drafter("ngram", target)
    assert scheduler_for("auto", target, load_drafter("none", target), 3) is None
    assert scheduler_for("auto", target, ngram, 3, batch_tokens=16) is None  # engine: no c_k, verify all
    logs: list[str] = []
    s = scheduler_for("auto", target, conf, 3, log=logs.append)
    assert s.kind == "hardware" and s.cost.batch_tokens == (1, 2, 3, 4) and len(logs) == 1
    assert profile_path(target, target.profile_key).exists()
    assert scheduler_for("hardware", target, conf, 3, log=logs.append).cost == s.cost and len(logs) == 1  # reused
    # bench prices on the machine as it is: a table stored by another process is measured again, once
    monkeypatch.setattr(profile_mod, "_MEASURED_HERE", {})
    scheduler_for("hardware", target, conf, 3, log=logs.append, fresh=True)
    scheduler_for("hardware", target, conf, 3, log=logs.append, fresh=True)
    assert len(logs) == 2
    assert scheduler_for("threshold", target, conf, 3, threshold=0.3).threshold == 0.3
    assert scheduler_for("auto", target, ngram, 3).kind == "hardware"  # one request: its own past acceptance
    with pytest.raises(ConfigError, match="scheduler must be"):
        scheduler_for("bogus", target, conf, 3)


def test_a_stored_profile_is_measured_again_on_another_machine_or_when_it_was_taken_beside_other_work(tmp_path, monkeypatch):
    """The cost table follows the machine: one stored by another CPU, or timed while other processes held
    the cores, is measured again when next needed; the quieter of the two is kept and priced with."""
    import selfdraft.profile as profile_mod
    from selfdraft.profile import OTHER_WORK_LIMIT, cost_table_for, load_profile, profile_path

    monkeypatch.setenv("SELFDRAFT_CACHE", str(tmp_path / "cache"))
    target = Target(tiny_llama(vocab=32, hidden=16, layers=2))
    path = profile_path(target, target.profile_key)
    others = iter([])  # cores of other work each measurement sees, set per step below

    def busy_readings():  # /proc/stat as measure_sps reads it: before, then after the timed forwards
        state = {"t": 0.0}

        def read():
            state["t"] += 1e6 * next(others) if state["t"] else 1.0  # a huge jump: other work over any wall time
            return state["t"]
        return read

    def measure(*work, fresh=False):
        nonlocal others
        others = iter(work)
        monkeypatch.setattr(profile_mod, "busy_cpu_seconds", busy_readings())
        logs: list[str] = []
        cost_table_for(target, 3, log=logs.append, fresh=fresh)
        return logs

    assert len(measure(0)) == 1 and load_profile(target, target.profile_key).other_cores == 0  # quiet: stored
    assert measure() == []  # reused: nothing measured
    prof = load_profile(target, target.profile_key)
    path.write_text(path.read_text().replace(prof.machine, "x86_64 Some Other CPU 64 cpus"))
    assert "measured on x86_64 Some Other CPU" in measure(0)[0]  # another machine's table: measured again
    assert load_profile(target, target.profile_key).machine == prof.machine
    assert measure() == []
    monkeypatch.setattr(profile_mod, "_MEASURED_HERE", {})
    busy = measure(1, fresh=True)  # bench on a busy machine prices with its own table but keeps the quiet one
    assert "cores busy" in busy[0] and load_profile(target, target.profile_key).other_cores == 0
    path.write_text(path.read_text().replace('"other_cores": 0.0', '"other_cores": 3.0'))
    assert "beside other work" in measure(5)[0] and load_profile(target, target.profile_key).other_cores == 3.0  # busier now: kept
    assert "beside other work" in measure(0)[0] and load_profile(target, target.profile_key).other_cores == 0  # quiet: replaced
    assert measure() == [] and OTHER_WORK_LIMIT < 1


def test_online_admission_equals_algorithm1_and_threshold_for_one_request():
    from selfdraft.scheduler import Admission

    rng = random.Random(3)
    for _ in range(300):
        c = torch.tensor([rng.choice([0.0, 1.0, rng.random()]) for _ in range(rng.randint(1, 7))])
        table = random_table(rng)
        for adm, want in ((Admission(table), hardware_lengths([c], table)[0]),
                          (Admission(None, 0.4), threshold_lengths([c], 0.4)[0])):
            answers = [adm.admit(float(x)) for x in c]
            n = answers.index(False) if False in answers else len(answers)
            assert n == want and not any(answers[n:])  # a prefix, closed after the first refusal


def test_acceptance_history_counts_conditional_acceptance_and_explores():
    from selfdraft.scheduler import AcceptanceHistory, Admission

    h = AcceptanceHistory(gamma=4, explore=3)
    h.update(verified=3, accepted=1)  # draft 1 accepted, draft 2 rejected, draft 3 never reached
    h.update(verified=4, accepted=4)
    assert h.tried == [2, 2, 1, 1] and h.accepted == [2, 1, 1, 1]
    never = CostTable((1, 2), (1.0, 0.01))  # verifying anything costs 100 decodes
    got = [h.admitted(Admission(never), 4) for _ in range(8)]
    assert got == [0, 0, 0, 1, 0, 0, 0, 1]  # idle rounds, then one draft to re-measure
    free = CostTable((1, 5), (1.0, 1.0))
    assert h.admitted(Admission(free), 4) == 4 and h.admitted(Admission(free), 2) == 2


class BlindDrafter(AppendixADrafter):
    """The same uniform drafts with no confidences: ℓ comes from the request's past acceptance."""

    gives_confidences = False

    def propose(self, tokens, gamma, params, generator):
        p = super().propose(tokens, gamma, params, generator)
        return Proposal(p.tokens, p.q) if gamma else p


def test_history_cut_for_drafters_without_confidences_is_exact():
    """Joint law of the first two tokens through generate, ℓ from past acceptance (chi-square),
    and greedy output equal to plain decoding."""
    from selfdraft.decode import generate

    target = Target(tiny_llama(vocab=V_SMALL, hidden=16, layers=2, seed=1, peaked=1.0))
    prompt, cfg = [1, 3, 2], GenerationConfig(max_new_tokens=8, gamma=2, stop_on_eos=False)
    sched = Scheduler("hardware", cost=RISE, padded=False)
    params = SamplingParams(temperature=1.0)
    with torch.no_grad():
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], params)
        law = {(a, b): float(p1[a] * probs_from_logits(target.model(torch.tensor([prompt + [a]])).logits[0, -1], params)[b])
               for a in range(V_SMALL) for b in range(V_SMALL)}
    counts, lengths = dict.fromkeys(law, 0), set()
    for s in range(500):
        res = generate(target, BlindDrafter(V_SMALL, m=0), prompt, SamplingParams(temperature=1.0, seed=s), cfg,
                       scheduler=sched)
        counts[tuple(res.token_ids[:2])] += 1
        lengths |= {r.proposed for r in res.rounds}
    total = sum(law.values())
    assert chisquare(list(counts.values()), [law[k] / total * 500 for k in counts]).pvalue > 1e-3
    assert {0, 1} <= lengths  # the history did cut some rounds and keep others
    plain = generate(target, BlindDrafter(V_SMALL, m=0), prompt, SamplingParams(seed=0), cfg)
    cut = generate(target, BlindDrafter(V_SMALL, m=0), prompt, SamplingParams(seed=0), cfg, scheduler=sched)
    assert cut.token_ids == plain.token_ids


def test_a_noisy_profile_cannot_price_a_wider_forward_above_a_wider_one():
    """A profile measured on a busy machine (real readings) is capped by the larger B it measured:
    padding B tokens to B' costs at most the B' forward."""
    from selfdraft.profile import Profile

    ms = [24.7, 63.7, 44.6, 68.9, 32.0, 42.7, 51.0, 68.1]
    prof = Profile(target="t", fingerprint="f", dtype="x", kv_len=256, threads=1, machine="m", time="now",
                   batch_tokens=list(range(1, 9)), seconds=[m / 1e3 for m in ms])
    table = prof.cost_table()
    assert [round(1e3 / table(b), 1) for b in range(1, 9)] == [24.7, 32.0, 32.0, 32.0, 32.0, 42.7, 51.0, 68.1]


def brute_force_tree(parents: list[int], c: list[float], sps) -> list[int]:
    """Slow reference for `tree_nodes`: a_i as the product of c over node i's whole path, every prefix
    of the a-sorted candidates priced from scratch, stopping where Θ first fails to increase."""
    a = [math.prod(c[j] for j in brute_force_path(parents, i)) for i in range(len(c))]
    order = sorted((i for i in range(len(c)) if a[i] > 0), key=lambda i: (-a[i], i))
    theta = lambda n: (1 + sum(a[i] for i in order[:n])) * sps(1 + n)  # noqa: E731
    n = 0
    while n < len(order) and theta(n + 1) > theta(n):
        n += 1
    return sorted(order[:n])


def test_tree_nodes_equal_brute_force_and_algorithm1_on_chains():
    """Tree sizing: the slow reference on random trees (the kept set is closed under ancestors), the
    threshold rule, and on a chain-shaped tree exactly Algorithm 1 for one request."""
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(0, 12)
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        c = [rng.choice([0.0, 1.0, rng.random()]) if rng.random() < 0.1 else rng.random() ** 0.5 for _ in range(n)]
        table = random_table(rng)
        got = sched_mod.tree_nodes(torch.tensor(parents), torch.tensor(c), table)
        assert got == brute_force_tree(parents, c, table), (parents, c, table)
        assert all(parents[i] < 0 or parents[i] in got for i in got)
        a = [math.prod(c[j] for j in brute_force_path(parents, i)) for i in range(n)]
        assert sched_mod.tree_nodes(torch.tensor(parents), torch.tensor(c), None, 0.3) == [i for i in range(n) if a[i] >= 0.3]
        chain = sched_mod.tree_nodes(torch.arange(n) - 1, torch.tensor(c), table)
        assert chain == list(range(hardware_lengths([torch.tensor(c, dtype=torch.float64)], table)[0]))
    parents, c = torch.tensor([-1, -1, 0, 0, 1]), torch.tensor([0.6, 0.3, 0.5, 0.2, 0.9])  # a = .6 .3 .3 .12 .27
    assert sched_mod.tree_nodes(parents, c, lambda B: 10.0) == [0, 1, 2, 3, 4]  # a free forward: verify all
    assert sched_mod.tree_nodes(parents, c, lambda B: 10.0 / B) == []  # cost ∝ B: no draft with a < 1 pays
    # Θ: 1·10 | +.6 → 1.6·10 | +.3 (node 1) → 1.9·9 = 17.1 | +.3 (node 2) → 2.2·7 = 15.4 stop
    assert sched_mod.tree_nodes(parents, c, CostTable((1, 2, 3, 4), (10.0, 10.0, 9.0, 7.0))) == [0, 1]


def brute_force_path(parents: list[int], i: int) -> list[int]:
    return [] if i < 0 else brute_force_path(parents, parents[i]) + [i]
