"""Answer every question turn by turn with the tree decoder (and the vanilla baseline), recording
per-turn tokens, target forwards, accept lengths and wall time."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

import torch
from tqdm import tqdm

from pipeline.data.chat import ThinkingMode, render_prompt, stop_token_ids
from pipeline.decoding.decoder import GenerationResult, follow_greedy, generate, mean_accepted_tokens, vanilla_generate
from pipeline.decoding.drafter import Drafter
from pipeline.decoding.ties import GreedyPathError, Parting
from pipeline.decoding.tree import TreeSpec
from pipeline.eval.config import EvalConfig
from pipeline.eval.questions import Question

log = logging.getLogger(__name__)


@dataclass
class TurnRecord:
    question_id: str
    category: str
    turn: int
    prompt_tokens: int
    new_tokens: int
    target_forwards: int  # verification forwards, prefill excluded
    accept_lengths: list[int]
    wall_s: float
    target_s: float
    draft_s: float
    other_s: float
    answer: str
    baseline_wall_s: Optional[float] = None
    baseline_new_tokens: Optional[int] = None
    # Greedy only: the speculative output equals plain greedy decoding (same precision) token for token, i.e. the
    # greedy check (follow_greedy) found no parting. None: not checked.
    matches_baseline: Optional[bool] = None
    # Greedy, checked turns: every step where the target's one-token forward ranks another token first
    # (ties.Parting.as_dict: step, emitted, greedy, margin, bound, verify_gap, tie); [] on the greedy path.
    partings: Optional[list] = None
    # The share of the answer's token 4-grams that already occurred earlier in it (a loop repeats itself).
    repeat_share: Optional[float] = None
    # CPU with a reduced-precision target: vanilla decoding again with an fp32 copy, which can be the faster
    # baseline (one-token forwards gain nothing from bf16 on CPU); speedup is against the faster of the two.
    fp32_baseline_wall_s: Optional[float] = None
    fp32_baseline_new_tokens: Optional[int] = None
    extra: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        # 0, not nan, for a turn with no verification forward (EOS at prefill): it is written into answers JSON.
        return mean_accepted_tokens(self.accept_lengths) if self.accept_lengths else 0.0


def answer_questions(target, drafter: Drafter, questions: Iterable[Question], cfg: EvalConfig, tree: TreeSpec,
                     system_prompt: Optional[str] = None, progress=None,
                     deadline: Optional[float] = None, fp32_model=None, agree=None,
                     thinking=ThinkingMode.template) -> list[TurnRecord]:
    """Answer every question (all its turns) with the tree decoder and `drafter`, plus the vanilla baseline on the first
    `cfg.baseline_limit` questions (also with `fp32_model`, an fp32 copy of the target, when given).
    `progress` (EvalProgress) supplies finished questions and records new
    ones; once a question ends past `deadline` (time.monotonic()) no new one starts: the result may be partial.
    `agree` (a tensor-parallel target's ranks, TargetLayout.agree) makes that call the first rank's on all.
    `thinking`: the chat template's mode the prompts are rendered in (regen.thinking)."""
    model, tokenizer = target.model, target.tokenizer
    eos = set(stop_token_ids(tokenizer, model))
    done = progress.done if progress is not None else {}
    records = []
    questions = list(questions)
    bar = tqdm(total=sum(len(q.turns) for q in questions), desc="eval", unit="turn")
    for qi, q in enumerate(questions):
        if q.id in done:
            records.extend(done[q.id])
            bar.update(len(q.turns))
            continue
        with_baseline = cfg.baseline and (cfg.baseline_limit is None or qi < cfg.baseline_limit)
        q_records = _answer(model, tokenizer, drafter, q, qi, cfg, tree, eos, system_prompt, with_baseline, bar,
                            fp32_model, thinking=thinking, check=greedy_checked(cfg, qi, with_baseline))
        records.extend(q_records)
        if progress is not None:
            progress.append(q.id, q_records)
        if deadline is not None and (agree or bool)(time.monotonic() > deadline) and qi + 1 < len(questions):
            log.info("eval time budget spent after question %d of %d", qi + 1, len(questions))
            break
    bar.close()
    return records


def greedy_checked(cfg: EvalConfig, qi: int, with_baseline: bool) -> bool:
    """T=0: question `qi`'s answers are followed with the target's one-token forwards (follow_greedy) when it has a
    baseline (the check is its baseline: the same forwards) or is among the first `cfg.greedy_check`."""
    return cfg.temperature <= 0 and (with_baseline or cfg.greedy_check is None or qi < cfg.greedy_check)


def system_messages(q: Question) -> list[dict]:
    """The chat a question's first turn starts from: its own system prompt, if it has one."""
    return [{"role": "system", "content": q.system}] if q.system else []


def _answer(model, tokenizer, drafter, q: Question, qi: int, cfg: EvalConfig, tree: TreeSpec, eos: set[int],
            system_prompt: Optional[str], with_baseline: bool, bar, fp32_model=None,
            thinking=ThinkingMode.template, check: bool = False) -> list[TurnRecord]:
    """All turns of one question; later turns see the speculative answers as history. `check` (T=0): each
    answer is held to the target's greedy choice at every step (follow_greedy); a parting above the precision's
    tie bound raises GreedyPathError."""
    messages = system_messages(q)
    records = []
    for ti, user in enumerate(q.turns):
        messages.append({"role": "user", "content": user})
        prompt = torch.tensor(render_prompt(tokenizer, messages, system_prompt=system_prompt, thinking=thinking))
        # One seed per (question, turn): sampling runs are reproducible and independent of order.
        seed = cfg.seed * 1_000_003 + qi * 101 + ti
        spec = generate(model, drafter, prompt, cfg.max_new_tokens, temperature=cfg.temperature,
                        tree=tree, eos_token_ids=eos, seed=seed)
        rec = _record(q, ti, prompt, spec, tokenizer)
        if check:  # (T=0) the target's own one-token forwards over the answer: greedy decoding of it, timed
            base, partings = follow_greedy(model, prompt, spec.tokens)
            for p in partings:
                p.verify_gap = spec.gaps[p.step] if p.step < len(spec.gaps) else None
            rec.partings, rec.matches_baseline = [p.as_dict() for p in partings], not partings
            if cfg.greedy_check != 0 and (bad := next((p for p in partings if not p.tie), None)) is not None:
                raise GreedyPathError(off_greedy_path(q, ti, bad, tokenizer, model.dtype))
        if with_baseline:
            if not check:  # sampling: plain decoding at the same temperature
                base = vanilla_generate(model, prompt, cfg.max_new_tokens, temperature=cfg.temperature,
                                        eos_token_ids=eos, seed=seed)
            rec.baseline_wall_s, rec.baseline_new_tokens = base.wall_time, len(base.tokens)
            if fp32_model is not None:
                base32 = vanilla_generate(fp32_model, prompt, cfg.max_new_tokens, temperature=cfg.temperature,
                                          eos_token_ids=eos, seed=seed)
                rec.fp32_baseline_wall_s, rec.fp32_baseline_new_tokens = base32.wall_time, len(base32.tokens)
        records.append(rec)
        messages.append({"role": "assistant", "content": rec.answer})
        bar.update(1)
        bar.set_postfix(tau=f"{rec.tau:.2f}")
    return records


def off_greedy_path(q: Question, turn: int, p: Parting, tokenizer, dtype: torch.dtype) -> str:
    """The one line a parting above the tie bound fails the eval with."""
    verify = f"; the verification forward's top-2 gap there {p.verify_gap:.4g}" if p.verify_gap is not None else ""
    return (f"question {q.id} turn {turn + 1}, step {p.step}: the speculative decoder emitted token {p.emitted} "
            f"({tokenizer.decode([p.emitted])!r}) where the target's one-token forward ranks {p.greedy} "
            f"({tokenizer.decode([p.greedy])!r}) first by {p.margin:.4g} logits, above the {str(dtype).split('.')[-1]} "
            f"tie bound {p.bound:.4g}{verify}: the output is not the target's greedy output (a decoding bug; "
            f"eval.greedy_check=0 turns the check off)")


def repeat_share(tokens: list[int], n: int = 4) -> float:
    """The share of the n-grams of `tokens` that already occurred earlier in it: ~0 for prose, towards 1 for an
    answer that loops (a loop is easy to draft and inflates tau)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    seen, repeated = set(), 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / len(grams) if grams else 0.0


def _record(q: Question, turn: int, prompt: torch.Tensor, res: GenerationResult, tokenizer) -> TurnRecord:
    return TurnRecord(
        question_id=q.id, category=q.category, turn=turn, prompt_tokens=int(prompt.numel()),
        new_tokens=len(res.tokens), target_forwards=res.n_target_forwards,
        accept_lengths=list(res.accept_lengths), wall_s=res.wall_time, target_s=res.target_time,
        draft_s=res.draft_time, other_s=res.other_time,
        answer=tokenizer.decode(res.tokens, skip_special_tokens=True).strip(),
        repeat_share=round(repeat_share(list(res.tokens)), 4))


def record_dict(rec: TurnRecord) -> dict:
    d = asdict(rec)
    d["tau"] = rec.tau
    return d
