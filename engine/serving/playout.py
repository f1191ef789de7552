"""Per-stream playout accounting: cursor, slack, stalls, pauses, prompt-switch resets.

Everything is in seconds of content on the stream's timeline. ``generated_s`` is the end of playable
content produced so far; the *cursor* is the playout position. Playout slack P = generated - cursor.

At admission the cursor starts at ``-initial_slack`` (the client shows nothing yet), so the first chunk's
deadline is arrival + initial slack and P starts at the initial slack. P is never negative except during
a stall, where it is minus the stall's duration so far. While playing, the cursor advances
at 1 s/s; it can never pass ``generated``: if it reaches it before the next chunk is ready, that is a
*stall*, which ends when the chunk arrives (playback resumes from there, so later deadlines shift).
A chunk is on time iff it is ready no later than the moment the cursor reaches its first frame.

Stalls are detected lazily when a chunk arrives, so no timer events are needed. In the simulator the
cursor is driven by this clock; in the live server ``report_cursor`` re-anchors it to the client's report.
A prompt switch discards buffered content (generated := cursor) and grants a fresh initial slack
(cursor := cursor - initial slack): the viewer holds the last frame while the new prompt's chunk renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Stall:
    start_t: float
    end_t: float

    @property
    def duration_s(self) -> float:
        return self.end_t - self.start_t


@dataclass(frozen=True, slots=True)
class ChunkOutcome:
    on_time: bool
    stall: Stall | None


@dataclass
class PlayoutTracker:
    arrival_t: float
    initial_slack_s: float
    content_s: float
    generated_s: float = 0.0
    paused: bool = False
    epoch: int = 0  # bumped by prompt switches; chunks started in an older epoch are discarded
    stalls: list[Stall] = field(default_factory=list)
    chunks_on_time: int = 0
    chunks_late: int = 0
    first_chunk_t: float | None = None
    # Observation log (kind, t, chunk duration) so accounting can be re-derived independently.
    log: list[tuple[str, float, float]] = field(default_factory=list)
    # Live servers run for days: keep at most this many log rows and stalls (None = all, the simulator).
    max_log: int | None = None
    stall_count: int = 0  # every stall, also those trimmed from ``stalls``
    _anchor_t: float = 0.0
    _anchor_cursor: float = 0.0
    _stall_carry: bool = False  # a stall was cut short by a pause/switch; the next chunk is late

    def __post_init__(self) -> None:
        if self.initial_slack_s < 0 or self.content_s <= 0:
            raise ValueError(f"need initial_slack_s >= 0 and content_s > 0, got {self.initial_slack_s}, {self.content_s}")
        self._anchor_t = self.arrival_t
        self._anchor_cursor = -self.initial_slack_s

    def _free_cursor(self, t: float) -> float:
        """Where the cursor would be if content were unlimited."""
        if self.paused:
            return self._anchor_cursor
        return self._anchor_cursor + max(0.0, t - self._anchor_t)

    def cursor(self, t: float) -> float:
        return min(self._free_cursor(t), self.generated_s)

    def slack(self, t: float) -> float:
        """P at t. During a stall it is negative: minus how long the viewer has been frozen. Clamping it
        at 0 would make every stalled stream look alike and let the earliest one win every tie (observed
        as starvation in the property test); the stall depth keeps the longest-stalled stream first."""
        if self.done_generating:
            return self.generated_s - self.cursor(t)
        return self.generated_s - self._free_cursor(t)

    def stalled(self, t: float) -> bool:
        return not self.done_generating and self._free_cursor(t) > self.generated_s

    def stall_in_progress_s(self, t: float) -> float:
        """How long the current (not yet closed) stall has lasted at t; 0 when playing normally."""
        return max(0.0, self._free_cursor(t) - self.generated_s) if not self.done_generating else 0.0

    @property
    def done_generating(self) -> bool:
        return self.generated_s >= self.content_s - 1e-9

    @property
    def remaining_content_s(self) -> float:
        return max(0.0, self.content_s - self.generated_s)

    def _close_stall(self, t: float) -> Stall | None:
        """If the cursor is stuck at ``generated`` at t, record the stall up to t and re-anchor there."""
        free = self._free_cursor(t)
        if free <= self.generated_s or self.done_generating:
            return None
        start = self._anchor_t + (self.generated_s - self._anchor_cursor)
        stall = Stall(start, t)
        self.stalls.append(stall)
        self.stall_count += 1
        self._trim(self.stalls)
        self._anchor_t, self._anchor_cursor = t, self.generated_s
        return stall

    def _note(self, kind: str, t: float, duration_s: float) -> None:
        self.log.append((kind, t, duration_s))
        self._trim(self.log)

    def _trim(self, rows: list[Any]) -> None:
        if self.max_log is not None and len(rows) > self.max_log:
            del rows[: len(rows) - self.max_log // 2]  # down to half: trimming stays amortised O(1)

    def on_chunk_ready(self, t: float, duration_s: float) -> ChunkOutcome:
        if duration_s <= 0:
            raise ValueError(f"chunk duration must be positive, got {duration_s}")
        self._note("chunk", t, duration_s)
        stall = None if self.paused else self._close_stall(t)
        on_time = stall is None and not self._stall_carry
        self._stall_carry = False
        if on_time:
            self.chunks_on_time += 1
        else:
            self.chunks_late += 1
        if self.first_chunk_t is None:
            self.first_chunk_t = t
        self.generated_s = min(self.content_s, self.generated_s + duration_s)
        return ChunkOutcome(on_time, stall)

    def pause(self, t: float) -> None:
        if self.paused:
            return
        self._note("pause", t, 0.0)
        if self._close_stall(t) is not None:
            self._stall_carry = True
        self._anchor_cursor = self.cursor(t)
        self._anchor_t = t
        self.paused = True

    def resume(self, t: float) -> None:
        if not self.paused:
            return
        self._note("resume", t, 0.0)
        self._anchor_t = t
        self.paused = False

    def report_cursor(self, t: float, cursor_s: float) -> None:
        """Live server: the client says it is at ``cursor_s`` at time t (re-anchor the clock there)."""
        if self._close_stall(t) is not None:
            self._stall_carry = True
        self._anchor_t, self._anchor_cursor = t, min(cursor_s, self.generated_s)

    def reset_slack(self, t: float) -> None:
        """Prompt switch: buffered content is useless; the new prompt gets the initial slack again."""
        self._note("switch", t, 0.0)
        if not self.paused:
            self._close_stall(t)
        self._stall_carry = False  # any stall ends with the switch; the new content has a fresh deadline
        # Before playback began (cursor < 0) everything generated is discarded and the wait restarts.
        c = max(0.0, self.cursor(t))
        self.generated_s = c
        self._anchor_t, self._anchor_cursor = t, c - self.initial_slack_s
        self.epoch += 1

    @property
    def cpr(self) -> float:
        n = self.chunks_on_time + self.chunks_late
        return self.chunks_on_time / n if n else 1.0
