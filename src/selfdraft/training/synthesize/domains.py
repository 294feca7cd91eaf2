"""Domains: how the target is steered to write the user prompts users of a domain send.

A domain is a steering system prompt with a `{topic}` slot and a list of seed topics; each prompt
slot draws one topic (seeded), so a few hundred prompts spread over the domain instead of
collapsing on the target's favourite question. The steering system prompt is only shown while the
target writes the prompt: the answer is written under the template's own system prompt, the context
users' requests arrive in. `chat` has no steering: the template's user header alone (Magpie,
arXiv 2406.08464), the target's own prompt distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from selfdraft.config import ConfigError
from selfdraft.training.records import DataError

# A topic file without a --system prompt is steered by this one.
TOPIC_SYSTEM = "You are a helpful assistant. The user will ask you a question about {topic}."


@dataclass(frozen=True)
class Domain:
    name: str
    system: str | None  # steering system prompt, "{topic}" replaced by the slot's topic; None = the template's own
    topics: tuple[str, ...] = ()

    def steering(self, topic: str | None) -> str | None:
        return None if self.system is None else self.system.replace("{topic}", topic or "anything")


DOMAINS = {
    "chat": Domain("chat", None),
    "code": Domain(
        "code",
        "You are an expert programming assistant. The user will ask you to write, explain or fix code "
        "about {topic}.",
        (
            "Python lists and dictionaries", "string manipulation", "sorting algorithms", "recursion",
            "file input and output", "regular expressions", "SQL queries", "JavaScript functions",
            "HTML and CSS layout", "classes and objects", "error handling and exceptions", "unit testing",
            "binary search", "linked lists", "hash maps", "graph traversal", "dynamic programming",
            "shell scripting", "REST APIs", "data processing with pandas", "C pointers and memory",
            "Java collections", "concurrency and threads", "git commands", "debugging a function",
            "time complexity", "JSON parsing", "command-line tools",
        ),
    ),
    "math": Domain(
        "math",
        "You are a math tutor. The user will ask you to solve a math problem about {topic}, step by step.",
        (
            "arithmetic word problems", "fractions and decimals", "percentages", "ratios and proportions",
            "linear equations", "quadratic equations", "systems of equations", "inequalities",
            "exponents and logarithms", "sequences and series", "probability", "combinatorics",
            "statistics and averages", "geometry of triangles", "circles and areas", "volumes of solids",
            "trigonometry", "derivatives", "integrals", "limits", "matrices", "number theory and primes",
            "divisibility and remainders", "functions and graphs", "unit conversion", "interest and money",
            "rates, time and distance", "vectors",
        ),
    ),
}


def resolve_domains(names: list[str], topics_file: Path | None, system: str | None) -> tuple[Domain, ...]:
    """The domains asked for, with --topics FILE (one topic a line, `#` comments) and --system applied."""
    unknown = [n for n in names if n not in DOMAINS]
    if unknown:
        raise ConfigError(f"unknown --domain {unknown[0]!r}: choose from {', '.join(DOMAINS)}")
    if not names:
        raise ConfigError(f"give at least one --domain ({', '.join(DOMAINS)})")
    topics = None
    if topics_file is not None:
        lines = Path(topics_file).read_text(encoding="utf-8").splitlines()
        topics = tuple(t for t in (line.split("#", 1)[0].strip() for line in lines) if t)
        if not topics:
            raise DataError(f"{topics_file} holds no topics: write one topic a line (`#` starts a comment)")
    out = []
    for name in dict.fromkeys(names):
        d = DOMAINS[name]
        steer = system if system is not None else d.system if d.system is not None else TOPIC_SYSTEM if topics else None
        out.append(Domain(name, steer, topics if topics is not None else d.topics))
    return tuple(out)
