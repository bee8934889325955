"""bench/serve_llamacpp.py: llama.cpp's server decodes with an eaglet GGUF export beside the same server without
a draft and eaglet's decoder in the same chain shape. A random EAGLE-3 head at SmolLM2's dimensions (its
embedding and lm_head from the target) on one demo question: the draft is used, the greedy output of the
drafting server is the plain server's token for token, and tau as the bench computes it from the server's
timings is the mean accepted length llama.cpp itself logs for the request."""
from __future__ import annotations

import json
import re

import pytest

from bench.serve_llamacpp import chain_tree, run, server_tau
from tests.support.gguf import smollm2_head, to_gguf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


def test_chain_shape_and_tau_formula():
    tree = chain_tree(3)  # llama.cpp's --spec-draft-n-max 3: three drafts a step, verified with the root
    assert (tree.top_k, tree.depth, tree.total_tokens) == (1, 2, 4)
    # 9 tokens: the first from the prompt's forward, then 8 from forwards that accepted 5 drafts in all -> 3.
    assert server_tau({"predicted_n": 9, "draft_n": 12, "draft_n_accepted": 5}) == 8 / 3
    assert server_tau({"predicted_n": 1}) is None


def test_llama_server_with_the_export_against_itself_without_and_eaglet(smollm2, server_binary, tmp_path):
    out = to_gguf(smollm2_head(smollm2), tmp_path / "gguf", smollm2)
    result = run(out, "", limit=1, max_new_tokens=24, draft_ns=[2], eaglet_ns=[2], threads=1,
                 log_dir=tmp_path / "logs")
    rows = result["rows"]
    assert set(rows) == {"llama.cpp", "llama.cpp+draft2", "eaglet", "eaglet+chain2"}
    assert rows["eaglet"]["tau"] == 1 and rows["eaglet+chain2"]["speedup"] > 0  # against eaglet without a draft
    turns = result["turns"]
    assert turns >= 1 and all(r["turns"] == turns for r in rows.values())
    drafted = rows["llama.cpp+draft2"]
    assert drafted["drafted"] > 0  # the server loaded the draft and drafted with it
    # Lossless greedy, up to llama.cpp's own arithmetic: a drafting server verifies several tokens per forward,
    # whose kernels round apart from one token's (its activations quantized to 8 bits). An output may part only
    # at a near-tie: where the no-draft server itself ranks the drafted output's token within a logit of its own
    # choice (llama.cpp's rounding moves these logits by up to ~0.5 here), never at a token the target would not
    # come near choosing.
    same, total = map(int, drafted["identical_to_llama_cpp"].split("/"))
    assert total == turns
    for d in result["divergences"]["llama.cpp+draft2"]:
        assert d.get("tie_gap") is not None and d["tie_gap"] < 1.0, json.dumps(d)
    assert drafted["tau"] >= 1 and rows["eaglet+chain2"]["tau"] >= 1
    assert rows["eaglet+chain2"]["drafted"] > 0
    # A drafted step's cost over a plain one is the tau that breaks even; the target's forward over the chain's
    # 3 tokens is timed against one token's on the no-draft server.
    assert drafted["breakeven_tau"] > 0
    if drafted["new_tokens"] == rows["llama.cpp"]["new_tokens"]:  # tau over the break-even tau is the speedup
        assert drafted["tau"] / drafted["breakeven_tau"] == pytest.approx(drafted["speedup"], rel=0.01)
    cost = result["target_forward_cost"]
    assert set(cost["ms"]) == {1, 3} and all(v > 0 for v in cost["ms"].values())
    assert cost["vs_one_token"][1] == 1.0
    # The server's own account of the last request: "draft acceptance = ... mean len = X". Its steps without a
    # draft are none here (p_min 0), so it equals the bench's tau of that request.
    log = (tmp_path / "logs" / "draft2.log").read_text()
    means = [float(m) for m in re.findall(r"mean len =\s*([0-9.]+)", log)]
    assert means, "llama-server logged no draft acceptance"
    assert abs(means[-1] - result["turn_tau"]["llama.cpp+draft2"][-1]) < 0.01
    # Where an output parts from the no-draft server's, the bench asks that server for its top candidates there on
    # its own decoding path: its greedy token is its first.
    for rows in result["divergences"].values():
        for d in rows:
            if d.get("no_draft"):
                assert d["no_draft_token"] == d["no_draft"]["top"][0] and d["no_draft"]["logit_gap"] >= 0, \
                    json.dumps(d)
