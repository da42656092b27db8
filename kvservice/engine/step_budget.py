"""How many prompt tokens a step may add while requests decode, sized by measured step time.

Every decoding request waits for the whole step, so a step's time is the inter-token latency
its streams see. `StepTimeBudget` learns what a step costs on this machine from the steps the
engine timed: time = base + per decode row x rows + per prompt token x tokens, a least-squares
fit that forgets old steps (contexts grow, the machine's load changes). It then lets a step add
as many prompt tokens as keep its predicted time within the target: more when few requests
decode or the machine is fast, fewer when many decode. Until the fit has seen both kinds of
step, and whenever it is degenerate, the fixed cap serves. No torch, no clock: the engine times
the steps and reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

_FORGET = 0.97  # weight kept by the older steps at each new one: ~33 steps' memory
_MIN_STEPS = 8  # steps observed, some with prompt tokens, before the fit is trusted
_RIDGE = 1e-9  # keeps the normal equations solvable when every step looked alike


class StepBudget(Protocol):
    """What the scheduler asks of a step budget; the engine reports each timed step to it."""

    def prompt_tokens(self, decode_rows: int) -> int: ...

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None: ...


@dataclass(frozen=True, slots=True)
class FixedStepBudget:
    """The same cap whatever the steps measure (`--max-prefill-tokens-with-decode`)."""

    cap: int

    def prompt_tokens(self, decode_rows: int) -> int:
        return self.cap

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        pass


@dataclass(slots=True)
class StepTimeBudget:
    """Prompt tokens for the next step: `prompt_tokens(decode_rows)`; feed it every timed step
    with `observe`. `target_s`: the step time aimed at; `fixed_cap`: prompt tokens per step
    before the fit is trusted; `min_tokens`: a floor, so prompts always progress."""

    target_s: float
    fixed_cap: int
    max_tokens: int
    min_tokens: int = 16
    # Exponentially weighted sums of x x^T and x t over steps, x = (1, decode rows, prompt tokens).
    _xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xt: list[float] = field(default_factory=lambda: [0.0] * 3)
    _num_steps: int = 0
    _num_prompt_steps: int = 0
    _coefficients: tuple[float, float, float] | None = None

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step's composition and wall time."""
        x = (1.0, float(decode_rows), float(prompt_tokens))
        for i in range(3):
            self._xt[i] = _FORGET * self._xt[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = _FORGET * self._xx[i][j] + x[i] * x[j]
        self._num_steps += 1
        self._num_prompt_steps += prompt_tokens > 0
        self._coefficients = None  # refit on the next question

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(base s, s per decode row, s per prompt token), or None while the fit is not trusted."""
        if self._num_steps < _MIN_STEPS or self._num_prompt_steps < _MIN_STEPS // 2:
            return None
        if self._coefficients is None:
            scale = max(self._xx[i][i] for i in range(3))
            a = [[self._xx[i][j] + (_RIDGE * scale if i == j else 0.0) for j in range(3)] for i in range(3)]
            self._coefficients = _solve3(a, self._xt)
        return self._coefficients

    def prompt_tokens(self, decode_rows: int) -> int:
        """Prompt tokens the next step may compute beside `decode_rows` decoding rows."""
        fit = self.coefficients
        if fit is None or fit[2] <= 0:
            return self.fixed_cap
        base, per_row, per_token = fit
        tokens = int((self.target_s - base - per_row * decode_rows) / per_token)
        return max(self.min_tokens, min(self.max_tokens, tokens))


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """x with a x = b by Cramer's rule; None when a is singular."""

    def det(m: list[list[float]]) -> float:
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    d = det(a)
    if d == 0.0:
        return None
    columns = []
    for k in range(3):
        m = [[b[i] if j == k else a[i][j] for j in range(3)] for i in range(3)]
        columns.append(det(m) / d)
    return columns[0], columns[1], columns[2]
