"""An eaglet head served by a real engine: llama.cpp's server drafting with the head's GGUF export
(`export.format=gguf`) against the same server without a draft, and eaglet's own decoder with the same head in
the same draft shape, on the same prompts (docs/results/serving.md).

What llama.cpp does with an EAGLE-3 draft (read in its server, tools/server/server-context.cpp, and
common/speculative.cpp): it drafts a *chain*, the draft's top-1 token at each step, up to `--spec-draft-n-max`
tokens (stopping early when the draft's probability falls below `--spec-draft-p-min`, 0 by default, so never
here), and verifies the chain in one target forward. eaglet's decoder drafts the same chain with the tree
`top_k=1, depth=n-1, total_tokens=n+1` (round 0 plus n-1 expansions). So tau should agree, up to the target's
arithmetic: llama.cpp runs the target's Q4_1 GGUF with its own kernels, eaglet the same weights dequantized, in
`target.dtype` (bf16 where `auto` measures it faster).

Every turn is decoded by every subject in a rotating order, one after another, so a slow spell of the machine
hits all of them alike: llama-server without a draft, llama-server with the draft at each chain length
(one server each, all started once and idle while another decodes), and eaglet's decoder at each chain length.
A later turn's history is the no-draft server's answer, so every subject sees the same prompt ids (rendered with
the target's chat template by eaglet and sent to the server as ids). Greedy.

From each server response: the generated tokens, `timings.predicted_n/predicted_ms` (decoding only, prompt
excluded) and `timings.draft_n/draft_n_accepted`. tau is tokens emitted per target forward after the prompt's,
as eaglet counts it (decoder.mean_accepted_tokens): (predicted_n - 1) / (predicted_n - 1 - draft_n_accepted),
each forward emitting its accepted drafts plus one token of its own.

    python -m bench.serve_llamacpp                                # 20 MT-bench questions, 128 tokens
    python -m bench.serve_llamacpp --limit 2 --max-new-tokens 32  # a smoke run
It exports the head first (stage export, export.format=gguf) unless the export is there. Writes
bench/results/serve_llamacpp.json (or --out) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from pipeline.precision import cpu_description

REPO = Path(__file__).resolve().parents[1]
MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
PLAIN = "llama.cpp"


def chain_tree(n: int):
    """eaglet's tree for llama.cpp's chain of up to `n` drafted tokens."""
    from pipeline.decoding.tree import TreeSpec

    return TreeSpec(top_k=1, depth=n - 1, total_tokens=n + 1)


def server_tau(timings: dict) -> Optional[float]:
    """tau from a llama-server response's timings: tokens emitted per target forward after the prompt's (the
    prompt's forward emits the first token; every later one its accepted drafts plus one). None when no forward
    followed the prompt's."""
    n = int(timings["predicted_n"]) - 1
    accepted = int(timings.get("draft_n_accepted", 0))
    return n / (n - accepted) if n > accepted else None


def complete(port: int, prompt_ids: Sequence[int], max_new_tokens: int, timeout_s: float = 600) -> dict:
    """One greedy completion of `prompt_ids` by the llama-server on `port`: its tokens and timings."""
    body = {"prompt": [int(t) for t in prompt_ids], "n_predict": max_new_tokens, "temperature": 0.0,
            "cache_prompt": False, "return_tokens": True}
    t0 = time.perf_counter()
    out = _post(port, body, timeout_s)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _post(port: int, body: dict, timeout_s: float = 600) -> dict:
    """The llama-server on `port`'s answer to a /completion request `body`."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return json.loads(r.read())


@dataclass
class Subject:
    """One column of the table: a server (with or without the draft) or eaglet's decoder at a chain length."""
    name: str
    engine: str  # llama.cpp | eaglet
    draft_n: int = 0  # chain length; 0: no draft
    p_min: float = 0.0  # llama.cpp's --spec-draft-p-min: the chain stops at a draft token less likely than this
    turns: list = field(default_factory=list)

    def totals(self, plain: Optional["Subject"], vanilla: Optional["Subject"] = None) -> dict:
        """This subject's sums; with `plain` (the no-draft server) its identical turns and, for a server with the
        draft, its speedup; with `vanilla` (eaglet's decoder without a draft) an eaglet row's speedup."""
        tokens = sum(t["new_tokens"] for t in self.turns)
        steps = sum(t["forwards"] for t in self.turns)
        decode_s = sum(t["decode_s"] for t in self.turns)
        out = {"engine": self.engine, "draft_n": self.draft_n, **({"p_min": self.p_min} if self.p_min else {}),
               "turns": len(self.turns), "new_tokens": tokens,
               "tau": round((tokens - len(self.turns)) / steps, 4) if steps else None,
               "decode_s": round(decode_s, 3), "tokens_per_s": round(tokens / decode_s, 2) if decode_s else None}
        if steps:  # one decoding step: a target forward, and for a drafting subject the draft's work before it
            out["step_ms"] = round(1000 * decode_s / steps, 3)
        if self.draft_n:
            out["drafted"] = sum(t.get("drafted", 0) for t in self.turns)
            out["accepted"] = sum(t.get("accepted", 0) for t in self.turns)
        if plain is not None and plain is not self:
            same = [t["tokens"] == p["tokens"] for t, p in zip(self.turns, plain.turns)]
            out["identical_to_llama_cpp"] = f"{sum(same)}/{len(same)}"
            base = plain if self.engine == PLAIN else vanilla
            if self.draft_n and base is not None and out["tokens_per_s"]:
                ref = base.totals(None)
                out["speedup"] = round(out["tokens_per_s"] / ref["tokens_per_s"], 3)
                if out.get("step_ms") and ref.get("step_ms"):  # the tau at which this subject would break even
                    out["breakeven_tau"] = round(out["step_ms"] / ref["step_ms"], 3)
        return out


TOP_K_PROBE = 5  # candidates a parting's probe asks each server for


def top_at(port: int, prompt_ids: Sequence[int], tokens: Sequence[int], position: int) -> Optional[dict]:
    """A server's own most likely tokens at `position` of its greedy output `tokens` for `prompt_ids` (up to
    TOP_K_PROBE, with log-probs), and the logit gap between its first two: the same request again with `n_probs`,
    so the logits come from the very path the server decoded (its KV cache built as it was, a token or a verified
    chain at a time; a prefix prefilled in one batch would round differently). None when the server does not report
    them there (llama.cpp reports none for the tokens its speculative path emits)."""
    resp = _post(port, {"prompt": [int(t) for t in prompt_ids], "n_predict": position + 1, "temperature": 0.0,
                        "cache_prompt": False, "n_probs": TOP_K_PROBE, "return_tokens": True})
    probs = resp.get("completion_probabilities") or []
    if list(resp["tokens"][:position + 1]) != list(tokens[:position + 1]) or len(probs) <= position:
        return None
    top = probs[position].get("top_logprobs") or []
    if len(top) < 2:
        return None
    return {"top": [t["id"] for t in top], "logprobs": [round(t["logprob"], 5) for t in top],
            "logit_gap": round(top[0]["logprob"] - top[1]["logprob"], 5)}


def forward_cost(port: int, prefix_ids: Sequence[int], counts: Sequence[int] = (1, 2, 3, 4, 5),
                 repeats: int = 5) -> dict:
    """The no-draft server's target forward over k new tokens after a cached `prefix_ids`, for k in `counts`:
    median milliseconds (the server's prompt timing) and the ratio to one token. A drafting server verifies
    chain + 1 tokens in one such forward, so where k tokens cost about k times one, drafting cannot pay."""
    ids, out = [int(t) for t in prefix_ids], {}
    for k in counts:
        times = []
        for r in range(repeats):
            extra = ids[-k - r - 1:-r - 1]  # k prompt tokens as the continuation
            _post(port, {"prompt": ids, "n_predict": 0, "cache_prompt": True})
            resp = _post(port, {"prompt": ids + extra, "n_predict": 1, "temperature": 0.0, "cache_prompt": True})
            if int(resp["timings"]["prompt_n"]) == k:
                times.append(float(resp["timings"]["prompt_ms"]))
        out[k] = round(sorted(times)[len(times) // 2], 3) if times else None
    one = out.get(1)
    return {"ms": out, "vs_one_token": {k: round(v / one, 3) for k, v in out.items() if v and one}}


def divergences(subject: "Subject", plain: "Subject", prompts: Sequence[Sequence[int]], plain_port: int,
                port: Optional[int] = None) -> list[dict]:
    """Where `subject`'s output parts from the no-draft server's, turn by turn: the first differing position,
    both tokens, and there the no-draft server's own top candidates (`no_draft`) and, for a server (`port`), the
    drafting server's own (`drafted`), each on the path it decoded (top_at); `tie_gap`: how far below the no-draft
    server's choice its log-prob of the other output's token is (None: not among its top candidates)."""
    out = []
    for i, (mine, ref) in enumerate(zip(subject.turns, plain.turns)):
        a, b = mine["tokens"], ref["tokens"]
        if a == b:
            continue
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        row = {"turn": i, "position": j, "token": a[j] if j < len(a) else None,
               "no_draft_token": b[j] if j < len(b) else None}
        if j < len(a) and j < len(b):
            row["no_draft"] = nd = top_at(plain_port, prompts[i], b, j)
            if nd is not None and a[j] in nd["top"]:
                row["tie_gap"] = round(nd["logprobs"][0] - nd["logprobs"][nd["top"].index(a[j])], 5)
            if port is not None:
                row["drafted"] = top_at(port, prompts[i], a, j)
        out.append(row)
    return out


def near_tie_swap(row: dict) -> bool:
    """Whether a divergence (divergences) is two near-equal tokens trading places: the no-draft server's first two
    candidates there are its token then the other output's, and the drafting server's the reverse where it reports
    them (mostly it does not: see top_at)."""
    nd, dr = row.get("no_draft"), row.get("drafted")
    if nd is None or nd["top"][:2] != [row["no_draft_token"], row["token"]]:
        return False
    return dr is None or dr["top"][:2] == [row["token"], row["no_draft_token"]]


def server_turn(resp: dict) -> dict:
    t = resp["timings"]
    n = int(t["predicted_n"])
    accepted = int(t.get("draft_n_accepted", 0))
    return {"tokens": list(resp["tokens"]), "new_tokens": n, "forwards": max(n - 1 - accepted, 0),
            "decode_s": float(t["predicted_ms"]) / 1000, "drafted": int(t.get("draft_n", 0)), "accepted": accepted,
            "tau": server_tau(t), "wall_s": resp["wall_s"]}


def eaglet_turn(target, drafter, prompt_ids, n: int, max_new_tokens: int, eos) -> dict:
    """eaglet's decoder on one prompt: a chain of up to `n` drafts a step, or vanilla decoding for n = 0."""
    from pipeline.decoding.decoder import generate, vanilla_generate

    if n == 0:
        res = vanilla_generate(target.model, torch.tensor(prompt_ids), max_new_tokens, temperature=0.0,
                               eos_token_ids=eos)
        return {"tokens": list(res.tokens), "new_tokens": len(res.tokens), "forwards": max(len(res.tokens) - 1, 0),
                "decode_s": res.wall_time, "tau": 1.0}
    res = generate(target.model, drafter, torch.tensor(prompt_ids), max_new_tokens, temperature=0.0,
                   tree=chain_tree(n), eos_token_ids=eos)
    forwards = res.n_target_forwards
    return {"tokens": list(res.tokens), "new_tokens": len(res.tokens), "forwards": forwards,
            "decode_s": res.wall_time, "accepted": sum(res.accept_lengths), "drafted": n * len(res.accept_lengths),
            "tau": (len(res.tokens) - 1) / forwards if forwards else None}


def ensure_export(experiment: str, head: str, output_root: Path) -> Path:
    """The head's GGUF export folder, made by the export stage if it is not there yet."""
    from pipeline.export.formats.gguf import GGUF_FILE

    out = output_root / experiment / "export" / head / "gguf"
    if not (out / GGUF_FILE).is_file():
        subprocess.run([sys.executable, "-m", "pipeline.run", "stage=export", f"experiment={experiment}",
                        f"head={head}", "export.format=gguf", f"output_root={output_root}"], check=True, cwd=REPO)
    return out


def run(export_dir: Path, questions_path: str, limit: int, max_new_tokens: int, draft_ns: Sequence[int],
        eaglet_ns: Sequence[int], threads: int, log_dir: Path, p_mins: Sequence[float] = (0.0,),
        server_args: Sequence[str] = ()) -> dict:
    """Every turn of the first `limit` questions by every subject (module docstring): a server for each chain
    length in `draft_ns` and p_min in `p_mins`, eaglet's decoder for each chain length in `eaglet_ns`; the result
    document."""
    from pipeline.data.bad_records import BadRecordReport
    from pipeline.data.chat import render_prompt, stop_token_ids
    from pipeline.decoding.drafter import make_drafter
    from pipeline.eval.evaluate import system_messages
    from pipeline.eval.questions import load_questions
    from pipeline.export.exporter import load_export
    from pipeline.export.formats.gguf import GGUF_FILE
    from pipeline.regen.config import LlamaCppConfig
    from pipeline.regen.llama_server import LlamaServer, checked_binary
    from pipeline.target import TargetConfig, load_target, resolve_source

    torch.set_num_threads(threads)
    tcfg = TargetConfig()
    kind, target_gguf = resolve_source(tcfg)
    if kind != "gguf":
        raise SystemExit(f"the serving bench runs llama.cpp on the target's GGUF; the target is a {kind}")
    target = load_target(tcfg)
    eos = set(stop_token_ids(target.tokenizer, target.model))
    drafter = make_drafter(load_export(export_dir, target.model, device=target.device, dtype=target.model.dtype)
                           ) if eaglet_ns else None
    questions = load_questions(questions_path, limit, BadRecordReport())

    scfg = LlamaCppConfig(slots=1, ctx_per_slot=4096, threads=threads)
    binary = checked_binary(scfg, tcfg)
    draft = str(export_dir / GGUF_FILE)
    servers = {PLAIN: LlamaServer(binary, target_gguf, scfg, log_dir / "plain.log", 8192, extra_args=server_args)}
    try:
        subjects = {PLAIN: Subject(PLAIN, PLAIN)}
        for n in draft_ns:
            for p in p_mins:
                name = f"llama.cpp+draft{n}" + (f"-p{p:g}" if p else "")
                servers[name] = LlamaServer(
                    binary, target_gguf, scfg, log_dir / f"{name.split('+')[1]}.log", 8192,
                    extra_args=["-md", draft, "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(n),
                                "--spec-draft-p-min", str(p), "-td", str(threads), "-tbd", str(threads),
                                *server_args])
                subjects[name] = Subject(name, PLAIN, n, p)
        if eaglet_ns:  # eaglet's decoder without a draft, then with the chains
            subjects["eaglet"] = Subject("eaglet", "eaglet")
        subjects.update({f"eaglet+chain{n}": Subject(f"eaglet+chain{n}", "eaglet", n) for n in eaglet_ns})
        order = list(subjects)
        k = 0
        prompts = []
        t0 = time.perf_counter()
        for qi, q in enumerate(questions):
            messages = system_messages(q)
            for user in q.turns:
                messages.append({"role": "user", "content": user})
                ids = render_prompt(target.tokenizer, messages)
                prompts.append(ids)
                rotated = order[k % len(order):] + order[:k % len(order)]
                k += 1
                done = {}
                for name in rotated:
                    s = subjects[name]
                    if s.engine == PLAIN:
                        done[name] = server_turn(complete(servers[name].port, ids, max_new_tokens))
                    else:
                        done[name] = eaglet_turn(target, drafter, ids, s.draft_n, max_new_tokens, eos)
                for name, turn in done.items():
                    subjects[name].turns.append(turn)
                plain_tokens = done[PLAIN]["tokens"]
                messages.append({"role": "assistant",
                                 "content": target.tokenizer.decode(plain_tokens, skip_special_tokens=True).strip()})
            print(f"question {qi + 1}/{len(questions)}: " + ", ".join(
                f"{n} tau {s.totals(None)['tau']}" for n, s in subjects.items() if s.draft_n), flush=True)
        elapsed = time.perf_counter() - t0
        cost = forward_cost(servers[PLAIN].port, prompts[0], counts=sorted({1, *(n + 1 for n in draft_ns)}))
        parted = {name: divergences(s, subjects[PLAIN], prompts, servers[PLAIN].port,
                                    servers[name].port if s.engine == PLAIN else None)
                  for name, s in subjects.items() if name != PLAIN}
    finally:
        for server in servers.values():
            server.close()
    plain = subjects[PLAIN]
    return {"machine": {"cpu": cpu_description(), "threads": threads, "torch": torch.__version__},
            "target": {"gguf": Path(target_gguf).name, "eaglet_dtype": target.precision},
            "draft": {"export": str(export_dir), "gguf_bytes": (export_dir / GGUF_FILE).stat().st_size},
            "questions": questions_path, "limit": limit, "turns": len(plain.turns),
            "max_new_tokens": max_new_tokens, "temperature": 0, "elapsed_s": round(elapsed, 1),
            "rows": {name: s.totals(plain, subjects.get("eaglet")) for name, s in subjects.items()},
            # The target's forward over k tokens against one (llama.cpp, no draft): a chain of n is verified in a
            # forward of n + 1 tokens.
            "target_forward_cost": cost,
            # Turns whose output is not the no-draft server's: where they part, and how near a tie that is.
            "divergences": parted,
            # The no-draft server's largest top-2 gap at a parting: how near a tie every parting was.
            "max_divergence_logit_gap": {name: max((d["no_draft"]["logit_gap"] for d in rows if d.get("no_draft")),
                                                   default=None) for name, rows in parted.items()},
            # The largest tie_gap of a subject's partings (None if some parting's token is not among the no-draft
            # server's top candidates): partings at near-ties only, when small.
            "max_tie_gap": {name: (max((d["tie_gap"] for d in rows), default=0.0)
                                   if all("tie_gap" in d for d in rows) else None) for name, rows in parted.items()},
            # Partings that are near-tie swaps (near_tie_swap): both servers' top-2 are the same two tokens, each
            # picking the other first, as llama.cpp's batched verification and one-token decoding round apart.
            "near_tie_swaps": {name: f"{sum(near_tie_swap(d) for d in rows)}/{len(rows)}"
                               for name, rows in parted.items() if subjects[name].engine == PLAIN},
            "turn_tau": {name: [None if t["tau"] is None else round(t["tau"], 4) for t in s.turns]
                         for name, s in subjects.items() if s.draft_n}}


def table(result: dict) -> str:
    lines = ["| subject | chain | p_min | tau | tokens/s | step ms | speedup | break-even tau "
             "| = llama.cpp without draft |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        lines.append(f"| {name} | {r['draft_n'] or '-'} | {r.get('p_min', 0) if r['draft_n'] else '-'} | {r['tau']} | "
                     f"{r['tokens_per_s']} | {r.get('step_ms', '-')} | {r.get('speedup', '-')} | "
                     f"{r.get('breakeven_tau', '-')} | {r.get('identical_to_llama_cpp', '-')} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="smollm2_methods")
    ap.add_argument("--head", default="eagle3", help="the head's name under <experiment>/train")
    ap.add_argument("--output-root", default=str(REPO / "outputs"))
    ap.add_argument("--export-dir", help="a GGUF export folder to serve instead of the experiment's head")
    ap.add_argument("--questions", default=str(MT_BENCH))
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-n", default="1,2,3,4", help="llama.cpp's chain lengths (--spec-draft-n-max)")
    ap.add_argument("--p-min", default="0", help="llama.cpp's --spec-draft-p-min values, a server each with every "
                                                 "chain length")
    ap.add_argument("--server-args", default="", help="more llama-server options for every server (e.g. '--poll 0')")
    ap.add_argument("--eaglet-n", default="1,2,3", help="eaglet's decoder at these chain lengths ('' for none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_llamacpp.json"))
    args = ap.parse_args(argv)
    export_dir = Path(args.export_dir) if args.export_dir else ensure_export(args.experiment, args.head,
                                                                             Path(args.output_root))
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    result = run(export_dir, args.questions, args.limit, args.max_new_tokens, ints(args.draft_n), ints(args.eaglet_n),
                 args.threads, export_dir / "serve_logs", [float(p) for p in args.p_min.split(",")],
                 args.server_args.split())
    result["table"] = table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(result["table"])
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
