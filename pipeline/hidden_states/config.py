from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pipeline.choices import Choice


class DumpInput(Choice):
    regen = "regen"  # this experiment's regen output (the target's own answers)
    data = "data"  # the data sources as they are (answers included)


@dataclass
class DumpConfig:
    # Input: "regen" reads this experiment's regen output; "data" tokenizes the data sources directly.
    input: DumpInput = DumpInput.regen
    # Input-to-layer ids (hidden_states[i] enters decoder layer i). None: pipeline.heads.default_aux_layer_ids.
    layer_ids: Optional[list] = None
    batch_tokens: int = 8192  # tokens per forward batch (padded length x rows)
    max_batch_size: int = 16
    # Payload per shard file. 1 GiB: a 70B EAGLE-3 dump stores 64 KiB of bf16 states per token ((3+1) x 8192 x 2),
    # so 500k conversations (33-43 TB) are 31-40k shards instead of 125-160k at 256 MiB: fewer files, manifest
    # entries and index/verify opens, and one forward batch of 8192 tokens (512 MiB) no longer fills a shard alone.
    # Larger would make a kill, and the repair of one bad shard, rewrite more. Part of the plan key: a dump made
    # with another value is rewritten on rerun, so pin dump.shard_bytes to resume an older dump.
    shard_bytes: int = 1024 * 1024 * 1024
    dtype: str = "auto"  # auto (= target dtype) | bfloat16 | float16 | float32
    limit: Optional[int] = None
    verify: bool = False
    # Print the sizing (tokens, bytes on disk per precision, shards, estimated memory per rank for the
    # target.tensor_parallel layout) and stop: no weights are loaded beyond the target's parts, nothing is written
    # but <dump dir>/plan.json (pipeline/hidden_states/sizing.py).
    plan_only: bool = False

    def __post_init__(self) -> None:
        from pipeline.precision import parse_dtype

        self.input = DumpInput.parse(self.input, "dump.input")
        if self.dtype != "auto":
            parse_dtype(self.dtype, "dump.dtype")
