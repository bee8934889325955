"""Two device checks of the GPU kit (device.py runs them; both run on CPU too, for the dry run).

--ties: bf16 tree decoding against bf16 vanilla decoding on a seeded tiny Llama. A tree forward and a one-token
  forward round differently in bf16, so the two may part; where they do, the margin between vanilla's token
  and the tree decoder's at the first differing position is checked against the rounding bound derived in
  tests/support/bf16_ties.py: a divergence inside it is a numerical tie, one outside it is a bug.
--tree-cost: the verification forward's wall time by tree size on the target (autotree.verify_costs, what
  eval's tree.total_tokens=-1 measures).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def ties(device: str, prompts: int = 6, new_tokens: int = 96) -> dict:
    """The suite's tie criterion (tests/support/bf16_ties.py), on this device."""
    from tests.support import bf16_ties
    from tests.support.tiny import build_tiny_llama, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = build_tiny_llama(len(tok)).to(device=device, dtype=torch.bfloat16).eval()
    rows = bf16_ties.divergences(model, bf16_ties.prompts(tok, prompts), new_tokens,
                                 bf16_ties.oracle(model.config.vocab_size))
    return {"dtype": "bfloat16", "device": device, "prompts": len(rows),
            "identical": sum(r["identical"] for r in rows),
            "divergences_outside_tie_bound": sum(1 for r in rows if not r["identical"] and not r["tie"]),
            "rows": rows}


def tree_cost(device: str, target: str | None) -> dict:
    from pipeline.decoding.autotree import verify_costs
    from pipeline.target import TargetConfig, load_target

    cfg = TargetConfig(device=device, path=target) if target else TargetConfig(device=device)
    loaded = load_target(cfg)
    sizes = [1, 4, 8, 16, 32, 60]
    cost = verify_costs(loaded.model, sizes, repeats=5, prefix_tokens=400)
    return {"dtype": str(loaded.dtype), "device": device, "seconds": {str(n): cost[n] for n in sizes},
            "ratio_to_one_token": {str(n): cost[n] / cost[1] for n in sizes}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tree-cost", action="store_true")
    ap.add_argument("--target", default=None)
    ap.add_argument("--prompts", type=int, default=6, help="--ties: prompts decoded")
    ap.add_argument("--new-tokens", type=int, default=96, help="--ties: tokens each")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = tree_cost(args.device, args.target) if args.tree_cost else ties(args.device, args.prompts,
                                                                             args.new_tokens)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    if not args.tree_cost and result["divergences_outside_tie_bound"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
