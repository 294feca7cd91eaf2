"""Incremental detokenization with stop strings (pure; no model, no I/O).

Tokens arrive a few at a time; text is released as soon as it is final: never half of a multi-byte
character (the decoder shows it as U+FFFD until the rest arrives) and never a tail that could be the
start of a stop string. When a stop string appears, the text is cut before it and the stream stops,
so streamed pieces concatenated always equal the non-streamed text.

Each token costs O(1) decoding, whatever the output length: only a short window is decoded (the
last tokens already turned into text, as context, and the new ones), and the new text is the
difference, as in vLLM's and Hugging Face's streamers. Re-decoding the whole output per token would
be quadratic, and it runs in the engine thread, where it stalls every request in the batch.
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
    prefix: int = 0  # ids[prefix:read]: tokens already in text, decoded again as context for the next ones
    read: int = 0  # ids[:read] are text already (released or pending)
    pending: str = ""  # text not yet released: a possible start of a stop string
    stopped: bool = False  # a stop string was found: no more text, no more tokens

    def __post_init__(self) -> None:
        self.stop = tuple(s for s in self.stop if s)

    def push(self, token: int) -> str:
        """Add one token; return the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        new = self._new_text(final=False)
        if not new:
            return ""
        self.pending += new
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self.pending) - self._stop_prefix_len())

    def flush(self) -> str:
        """Generation ended (length / EOS / cancel): release everything not yet released."""
        if self.stopped:
            return ""
        self.pending += self._new_text(final=True)
        return self._release(len(self.pending))

    def _new_text(self, final: bool) -> str:
        """The text the tokens after `read` add (empty while it ends in half a character, unless final)."""
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def _release(self, end: int) -> str:
        out, self.pending = self.pending[:end], ("" if self.stopped else self.pending[end:])
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        text = self.pending
        for k in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0
