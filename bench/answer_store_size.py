"""What the answer store (pipeline/regen/answer_store.py) costs in the repository for 1.5M answer tokens, the
quality v2 campaign's data (issue budget: 15 MB).

Real answers of the length the target writes: the assistant turns of the ShareGPT sample in ../shared/data
(cut at 384 SmolLM2 tokens, regen.max_new_tokens of the campaign), repeated in turn until 1.5M tokens, each
answer a store line as `save` writes it. Prints the store's size, bytes per token and the ratio to the budget.

    python -m bench.answer_store_size
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from pathlib import Path

from pipeline.target import TargetConfig, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO.parent / "shared" / "data" / "sharegpt_sg92k_sample1000" / "sharegpt_1000.json"
BUDGET_BYTES = 15_000_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_500_000)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    args = ap.parse_args()
    tok = load_tokenizer(TargetConfig())
    answers = []
    for rec in json.loads(SAMPLE.read_text()):
        for turn in rec.get("conversations", []):
            if turn.get("from") == "gpt" and turn.get("value", "").strip():
                ids = tok(turn["value"], add_special_tokens=False)["input_ids"][:args.max_new_tokens]
                answers.append((tok.decode(ids), len(ids)))
    lines, tokens, i = [], 0, 0
    while tokens < args.tokens:
        text, n = answers[i % len(answers)]
        # As `save` writes a record's line (store format 2): its digest (32 hex digits of a sha256) and tokens.
        digest = hashlib.sha256(f"sharegpt_1000-{i}".encode()).hexdigest()[:32]
        lines.append(json.dumps({"id": f"sharegpt_1000-{i}", "digest": digest, "answers": [text], "in": "shard",
                                 "unit": i // 512, "tokens": [n]}, ensure_ascii=False))
        tokens, i = tokens + n, i + 1
    raw = ("\n".join(lines) + "\n").encode()
    packed = len(gzip.compress(raw, compresslevel=9, mtime=0))
    print(json.dumps({"answer_tokens": tokens, "answers": i, "distinct_answers": min(i, len(answers)),
                      "raw_bytes": len(raw), "store_bytes": packed, "bytes_per_token": round(packed / tokens, 3),
                      "budget_bytes": BUDGET_BYTES, "store_over_budget": round(packed / BUDGET_BYTES, 3)}, indent=1))


if __name__ == "__main__":
    main()
