"""Committed tokens → text, the one copy every surface uses: :class:`IncrementalDecoder` (round deltas; a
split multi-byte character waits), :class:`StopStrings` (streamed text cut at a stop string, a possible
prefix held back) and :func:`stop_string_cut` (the in-process loop cuts tokens, not text)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class IncrementalDecoder:
    """Committed token ids → text deltas, holding back a multi-byte character split across rounds."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def add(self, ids: list[int], final: bool = False) -> str:
        """The new text that ``ids`` (appended to all ids so far) make final (``final``: no more come)."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta


class StopStrings:
    """Streamed text cut at the first stop string (the stop string itself is not emitted)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.held, self.stopped = list(stops), "", False

    def feed(self, text: str) -> str:
        """The part of ``held + text`` that is final; sets :attr:`stopped` at a stop string."""
        text, self.held = self.held + text, ""
        if not self.stops:
            return text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        keep = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        if keep:
            text, self.held = text[:-keep], text[-keep:]
        return text

    def flush(self) -> str:
        """The held-back tail, once no more text comes (it was not a stop string after all)."""
        held, self.held = self.held, ""
        return held


def stop_string_cut(decode: Callable[[list[int]], str], generated: list[int], stops: Sequence[str],
                    before: int) -> int | None:
    """Smallest token count (> ``before``) whose decoded text contains a stop string (kept, as HF does)."""
    if not any(s in decode(generated) for s in stops):
        return None
    for count in range(before + 1, len(generated) + 1):
        text = decode(generated[:count])
        if any(s in text for s in stops):
            return count
    return None
