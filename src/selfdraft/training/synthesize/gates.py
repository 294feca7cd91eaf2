"""Quality gates for synthesized user prompts, each counted (docs/data.md#quality-gates).

A sampled prompt goes through the gates in order and is removed by the first it fails:

  cut            no end-of-turn within the prompt token budget (an unfinished prompt)
  too_short      fewer content tokens than the minimum
  garbage        mostly symbols or emoji, or one phrase repeated (a sampling loop)
  language       not the configured language (`en`: Latin letters with English function words)
  eval           an exact or near-duplicate of a benchmark / evaluation prompt: never train on what you evaluate
  duplicate      the same words as an earlier prompt or an excluded dataset's
  near_duplicate within the Jaccard threshold of an earlier prompt or an excluded dataset's

Follow-up turns (written by the target after an answer) pass the same gates except the two
duplicate gates: "Can you give an example?" after different answers is a different context.
"""

from __future__ import annotations

import string
from dataclasses import asdict, dataclass, field

from selfdraft.training.synthesize.config import LANGUAGES, GateConfig
from selfdraft.training.synthesize.neardup import WORD, NearDupIndex, normalize, shingles

GATES = ("cut", "too_short", "garbage", "language", "eval", "duplicate", "near_duplicate")
# Enough English function words that any real English sentence of five words or more has one.
ENGLISH_WORDS = frozenset(
    "a an the and or but if of to in on at for with from by as is are was were be been am do does did "
    "i you he she it we they me my your our their this that these those what which who how why when "
    "where can could would should will please not no yes have has had there here about into than then".split()
)
PUNCTUATION = set(string.punctuation)


@dataclass
class GateCounts:
    """How many prompts each gate removed, and how many were kept."""

    sampled: int = 0
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GATES, 0))
    kept: int = 0

    def count(self, verdict: str) -> None:
        self.sampled += 1
        if verdict == "kept":
            self.kept += 1
        else:
            self.removed[verdict] += 1

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self, title: str) -> str:
        """Lines: each gate's removed count and share of the sampled prompts."""
        rows = [f"{title}: {self.sampled} sampled"]
        left = self.sampled
        for g in GATES:
            left -= self.removed[g]
            rows.append(f"  {g:<15} -{self.removed[g]:<6} ({self.removed[g] / max(self.sampled, 1):6.1%})  {left} left")
        rows.append(f"  kept            {self.kept:<7} ({self.kept / max(self.sampled, 1):6.1%})")
        return "\n".join(rows)


def is_garbage(text: str, cfg: GateConfig) -> bool:
    """Mostly symbols/emoji, too few letters, or a phrase repeated (the target stuck in a loop)."""
    body = "".join(text.split())
    if not body:
        return True
    if sum(not c.isalnum() and c not in PUNCTUATION for c in body) / len(body) > cfg.max_symbol_share:
        return True
    if sum(c.isalpha() for c in body) / len(body) < cfg.min_letter_share:
        return True
    words = normalize(text).split()
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return len(grams) >= 10 and 1 - len(set(grams)) / len(grams) > cfg.max_repeated_ngrams


def is_language(text: str, language: str) -> bool:
    """`en`: Latin letters, and an English function word in any prompt of five words or more (numbers and
    terms like "8x" do not count as words: "Solve 8x - 11 = 3x - 2 using linear equations." is English)."""
    if language == "any":
        return True
    letters = [c for c in text if c.isalpha()]
    if letters and sum(c.isascii() for c in letters) / len(letters) < 0.9:
        return False
    words = [w.lower() for w in WORD.findall(text) if w.isalpha()]  # "8x", "11": no language of their own
    return len(words) < 5 or any(w in ENGLISH_WORDS for w in words)


class PromptGates:
    """The gates with their state: the eval index (fixed) and the dedup index (grows with each kept prompt).

    `dedup` starts with every excluded dataset's prompts; `keep` adds a kept prompt so later ones
    are compared against it (the "earlier prompts" of a synthesis, across reruns too).
    """

    def __init__(self, cfg: GateConfig, eval_index: NearDupIndex, dedup: NearDupIndex) -> None:
        self.cfg, self.eval_index, self.dedup = cfg, eval_index, dedup

    def check(self, text: str, n_tokens: int, finished: bool, first_turn: bool = True) -> str:
        """The first gate `text` fails, or "kept". n_tokens: its content tokens."""
        if not finished:
            return "cut"
        if n_tokens < self.cfg.min_prompt_tokens:
            return "too_short"
        if is_garbage(text, self.cfg):
            return "garbage"
        if not is_language(text, self.cfg.language):
            return "language"
        if self.eval_index.find_exact(text) is not None or self.eval_index.matches(text):
            return "eval"
        if not first_turn:
            return "kept"
        if self.dedup.find_exact(text) is not None:
            return "duplicate"
        if self.dedup.matches(text):
            return "near_duplicate"
        return "kept"

    def keep(self, text: str, label: str = "") -> None:
        self.dedup.add(text, label)


def near_duplicate_share(texts: list[str], reference: NearDupIndex) -> tuple[int, int]:
    """(exact or near-duplicates of `reference` among texts, exact ones among them)."""
    near = exact = 0
    for t in texts:
        if reference.find_exact(t) is not None:
            near, exact = near + 1, exact + 1
        elif reference.matches(t):
            near += 1
    return near, exact


__all__ = ["GATES", "LANGUAGES", "GateConfig", "GateCounts", "PromptGates", "is_garbage", "is_language",
           "near_duplicate_share", "shingles"]
