"""Bookkeeping of records the readers could not use (and of the repairs they made).

Nothing is dropped silently: every rejected record lands here with its location and a reason, the
counts go into the stage manifest (`to_dict`), and `summary()` is what a human reads in the log.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Optional

# Reasons a record is rejected. The readers use exactly these strings. One bad record can stand for the rest of
# its file (the detail then says "rest of file unread" or "file skipped"): a syntax error in a JSON list, a broken
# gzip stream, binary data. The records before the break are kept.
BAD_REASONS = (
    "invalid_json",
    "not_utf8",
    "bad_gzip",  # a .gz file that is not gzip data, or whose stream breaks
    "binary_file",  # binary data (a NUL byte in the first bytes), not JSON text: the whole file, once
    "missing_field",
    "unknown_role",
    "empty_content",
    "turn_too_long",  # longer than data.max_turn_chars
    "not_alternating",
    "system_not_first",
    "no_user_turn",
    "duplicate_id",
)
# Repairs that keep the record (counted per record, only for records that were yielded).
FIX_REASONS = ("leading_assistant_dropped",)
# Good records left out on purpose (data.dedupe_prompts, data.held_out): counted with examples, never a
# failure under on_bad_record=fail.
SKIP_REASONS = ("duplicate_prompt", "held_out_prompt")


@dataclass(frozen=True)
class Location:
    """Where a record came from: a JSONL line, an element of a JSON list, or a dataset row."""

    file: str
    line: Optional[int] = None  # 1-based line in the file where the record starts
    index: Optional[int] = None  # 0-based position of the record in its file / split
    json_list: bool = False  # element of a JSON list: show the index, the line is secondary

    def __str__(self) -> str:
        if self.json_list or self.line is None:
            where = f"{self.file}:#{self.index}"
            return where if self.line is None else f"{where} (line {self.line})"
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class BadRecord:
    location: Location
    reason: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


class BadRecordError(ValueError):
    """Raised by `on_bad_record="fail"` at the first bad record."""

    def __init__(self, bad: BadRecord):
        super().__init__(str(bad))
        self.bad = bad
        self.file = bad.location.file
        self.line = bad.location.line
        self.reason = bad.reason


class BadRecordReport:
    """Counts per reason (overall and per file), the first `max_examples` examples per reason, and
    counts of repairs ("fixes") applied to records that were kept."""

    def __init__(self, max_examples: int = 5):
        self.max_examples = max_examples
        self.counts: Counter = Counter()
        self.fixes: Counter = Counter()
        self.by_file: dict[str, Counter] = defaultdict(Counter)
        self.examples: dict[str, list[BadRecord]] = defaultdict(list)
        self.skipped: Counter = Counter()
        self.skip_examples: dict[str, list[BadRecord]] = defaultdict(list)

    def add(self, bad: BadRecord) -> None:
        if bad.reason not in BAD_REASONS:
            raise ValueError(f"unknown bad-record reason {bad.reason!r}")
        self.counts[bad.reason] += 1
        self.by_file[bad.location.file][bad.reason] += 1
        if len(self.examples[bad.reason]) < self.max_examples:
            self.examples[bad.reason].append(bad)

    def skip(self, record: BadRecord) -> None:
        if record.reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {record.reason!r}")
        self.skipped[record.reason] += 1
        if len(self.skip_examples[record.reason]) < self.max_examples:
            self.skip_examples[record.reason].append(record)

    def fix(self, reason: str, n: int = 1) -> None:
        if reason not in FIX_REASONS:
            raise ValueError(f"unknown fix reason {reason!r}")
        self.fixes[reason] += n

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __len__(self) -> int:
        return self.total

    def summary(self) -> str:
        if not self.counts and not self.fixes and not self.skipped:
            return "bad records: none"
        lines = [f"bad records: {self.total}"]
        width = max(map(len, [*self.counts, *self.fixes, *self.skipped, "reason"]))
        lines.append(f"  {'reason':<{width}}  {'count':>7}  first example")
        for reason, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])):
            first = self.examples[reason][0]
            example = f"{first.location}" + (f": {first.detail}" if first.detail else "")
            lines.append(f"  {reason:<{width}}  {n:>7}  {example}")
        for reason, n in sorted(self.fixes.items()):
            lines.append(f"  {reason:<{width}}  {n:>7}  (fixed, record kept)")
        for reason, n in sorted(self.skipped.items()):
            first = self.skip_examples[reason][0]
            lines.append(f"  {reason:<{width}}  {n:>7}  (left out on purpose) {first.location}: {first.detail}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-serialisable form for the stage manifest."""
        return {
            "total": self.total,
            "counts": dict(sorted(self.counts.items())),
            "fixes": dict(sorted(self.fixes.items())),
            "skipped": dict(sorted(self.skipped.items())),
            "skipped_examples": {
                reason: [{"where": str(b.location), "detail": b.detail} for b in records]
                for reason, records in sorted(self.skip_examples.items())
            },
            "by_file": {f: dict(sorted(c.items())) for f, c in sorted(self.by_file.items())},
            "examples": {
                reason: [{"where": str(b.location), "detail": b.detail} for b in bads]
                for reason, bads in sorted(self.examples.items())
            },
        }
