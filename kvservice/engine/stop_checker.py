"""Stop strings: where a request's text ends, and what of it may be streamed yet.

Plain Python, no torch. The engine runs every request's output through an
`OutputText`; the prefill worker runs the first token through one too, so both sides
of a disaggregated request cut the text at the same place and emit the same deltas.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvservice.loading.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringChecker:
    """Finds the first stop string in a growing text and holds back what could start one.

    `push` returns the text that is safe to show: everything before the earliest stop
    string once one matched, otherwise everything but the longest tail that is a
    prefix of some stop string (it may still turn into one). So a client never sees
    text that is later cut. `flush` releases the held tail when the request ends.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        assert all(stop), "stop strings are non-empty (SamplingParams validates them)"
        self.stop = tuple(stop)
        self.text = ""  # released so far
        self.is_stopped = False
        self._held = ""

    def push(self, delta: str) -> str:
        """Add newly decoded text; returns the newly releasable text."""
        if self.is_stopped:
            return ""
        if not self.stop:
            self.text += delta
            return delta
        # Every stop string that could match starts inside `buffer`: nothing released
        # so far ends with a prefix of one (that is what `_held` keeps back).
        buffer = self._held + delta
        cut = min((i for s in self.stop if (i := buffer.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.is_stopped = True
            self._held = ""
            return self._release(buffer[:cut])
        num_held = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return self._release(buffer[: len(buffer) - num_held])

    def flush(self) -> str:
        """The request ended for another reason: the held tail is text like any other."""
        held, self._held = self._held, ""
        return self._release(held)

    def _release(self, text: str) -> str:
        self.text += text
        return text

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class OutputText:
    """A request's output text: incremental detokenization, then stop strings.

    Tokens go in one at a time (a step may bring several, e.g. accepted draft tokens),
    so a stop string also says which token ended the request."""

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = ()) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop: this model has no tokenizer, so stop strings cannot match; use stop_token_ids")
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.checker = StopStringChecker(stop)

    @property
    def text(self) -> str:
        return self.checker.text

    @property
    def is_stopped(self) -> bool:
        """Whether a stop string matched: the request ends, its text cut before it."""
        return self.checker.is_stopped

    def push(self, token_ids: Sequence[int], is_last: bool = False) -> tuple[int, str]:
        """Add new tokens; returns how many of them count (up to the one that completed a
        stop string) and the new text to show. `is_last`: the request ends with these
        tokens whatever they say, so nothing is held back."""
        # Without stop strings nothing depends on which token ends the text: decode them at once.
        groups = [[t] for t in token_ids] if self.checker.stop else [list(token_ids)]
        delta = ""
        num_kept = 0
        for group in groups:
            num_kept += len(group)
            delta += self.checker.push(self.detokenizer.push(group))
            if self.checker.is_stopped:
                return num_kept, delta
        if is_last:
            delta += self.checker.push(self.detokenizer.flush())
            delta += self.checker.flush()
        return num_kept, delta
