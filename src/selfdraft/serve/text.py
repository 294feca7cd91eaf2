"""Incremental detokenization with stop strings (pure; no model, no I/O).

Tokens arrive a few at a time; text is released as soon as it is final: never half of a multi-byte
character (the decoder shows it as U+FFFD until the rest arrives) and never a tail that could be the
start of a stop string. When a stop string appears, the text is cut before it and the stream stops,
so streamed pieces concatenated always equal the non-streamed text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class TextStream:
    """Feed committed tokens one at a time with `push`; `flush` at the end releases the held tail."""

    decode: Callable[[list[int]], str]
    stop: Sequence[str] = ()
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of decode(ids) already released
    stopped: bool = False  # a stop string was found: no more text, no more tokens

    def __post_init__(self) -> None:
        self.stop = tuple(s for s in self.stop if s)

    def push(self, token: int) -> str:
        """Add one token; return the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self.decode(self.ids)
        cut = min((i for i in (text.find(s, self.emitted) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text, cut)
        if text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            return ""
        return self._release(text, len(text) - self._stop_prefix_len(text))

    def flush(self) -> str:
        """Generation ended (length / EOS / cancel): release everything not yet released."""
        if self.stopped:
            return ""
        return self._release(self.decode(self.ids), None)

    def _release(self, text: str, end: int | None) -> str:
        out = text[self.emitted : end]
        self.emitted += len(out)
        return out

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest unreleased tail of `text` that is a proper prefix of a stop string."""
        tail = len(text) - self.emitted
        for k in range(min(tail, max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0
