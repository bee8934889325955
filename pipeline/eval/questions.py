"""MT-bench-format question files (`question_id`, `category`, `turns`) read through the data layer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.config import DataConfig, SourceConfig
from pipeline.data.readers import prompt_turns, read_source

DEMO_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "demo" / "questions.jsonl"


@dataclass
class Question:
    id: str
    category: str
    turns: list[str]  # user turns; later ones are asked with the generated answers as history
    system: Optional[str] = None


def load_questions(path: str, limit: Optional[int], report: BadRecordReport, on_bad_record: str = "fail",
                   max_turn_chars: Optional[int] = DataConfig.max_turn_chars) -> list[Question]:
    src = SourceConfig(path=path or str(DEMO_QUESTIONS), format="auto", limit=limit)
    questions = []
    for rec in read_source(src, report, on_bad_record, max_turn_chars=max_turn_chars):
        system, users = prompt_turns(rec)
        questions.append(Question(id=str(rec["id"]), category=str(rec["meta"].get("category", "default")),
                                  turns=users, system=system))
    if not questions:
        raise ValueError(f"{src.path}: no questions")
    return questions
