"""Tree speculative decoding (EAGLE-2 style, batch size 1) on any HF causal LM with a DynamicCache, and the
plain KV-cached decoding baseline it is measured against.

One step: the drafter proposes a tree rooted at the last emitted token; one target forward verifies all of
it (the tree's tokens appended after the cached prefix, a 4D ancestor mask, positions prefix + depth); the
accepted path's KV entries are moved into place and the rest cropped, so nothing is recomputed; the
drafter receives the target states of the accepted positions from that same forward.
"""
from __future__ import annotations

import functools
import inspect
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch
import transformers
from transformers import DynamicCache

from pipeline.families import attention_layer_types, family_of

from .drafter import Drafter
from .ties import UNIT_ROUNDOFF, Parting, parting_at
from .tree import DEFAULT_TREE, TreeSpec
from .verify import logits_to_probs, sample, verify_greedy, verify_sampling


def mean_accepted_tokens(accept_lengths: Sequence[int]) -> float:
    """tau, as the official EAGLE code defines it: tokens emitted per verification forward (accepted drafts
    plus the target's bonus token), averaged over forwards; nan when there were none."""
    if not accept_lengths:
        return float("nan")
    return sum(a + 1 for a in accept_lengths) / len(accept_lengths)


def acceptance_rates(accept_lengths: Sequence[int], max_draft_len: Optional[int] = None) -> list[float]:
    """n-alpha: alpha_d = P(draft d accepted | drafts 1..d-1 accepted) for d = 1..max_draft_len (default:
    the deepest accepted draft); nan where no forward accepted d-1 drafts."""
    depth = max(accept_lengths, default=0) if max_draft_len is None else max_draft_len
    reached = [len(accept_lengths)] + [sum(a >= d for a in accept_lengths) for d in range(1, depth + 1)]
    return [reached[d] / reached[d - 1] if reached[d - 1] else float("nan") for d in range(1, depth + 1)]


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (prompt excluded), truncated at EOS (kept) or max_new_tokens
    accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per verification forward
    n_target_forwards: int = 0  # prefill excluded
    target_time: float = 0.0  # seconds in target forwards
    draft_time: float = 0.0  # seconds in the drafter
    other_time: float = 0.0  # everything else: tree masks, acceptance, KV bookkeeping
    # Greedy speculative decoding: per emitted token, the top-1 minus top-2 logit of the verification row it was
    # chosen from (the first token: the prefill's); what a parting from plain greedy decoding is read against.
    gaps: list[float] = field(default_factory=list)

    @property
    def wall_time(self) -> float:
        return self.target_time + self.draft_time + self.other_time

    @property
    def tau(self) -> float:
        return mean_accepted_tokens(self.accept_lengths)

    def acceptance_by_depth(self) -> list[float]:
        return acceptance_rates(self.accept_lengths)


class _Clock:
    """Wall time per phase; synchronizes CUDA so asynchronous kernels are charged to the right phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def __call__(self, phase: str):
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.totals[phase] += time.perf_counter() - t0


def _eos_set(model: torch.nn.Module, eos_token_ids: Optional[Iterable[int]]) -> set[int]:
    """None: the model's own generation config; an empty iterable disables stopping at EOS."""
    if eos_token_ids is None:
        cfg = getattr(model, "generation_config", None) or model.config
        eos_token_ids = cfg.eos_token_id
        if eos_token_ids is None:
            return set()
    if isinstance(eos_token_ids, int):
        return {eos_token_ids}
    return set(eos_token_ids)


def _as_ids(input_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError("the decoder runs batch size 1")
        ids = ids[0]
    if ids.numel() == 0:
        raise ValueError("empty prompt")
    return ids


def _generator(seed: Optional[int]) -> torch.Generator:
    gen = torch.Generator()  # CPU: every random draw is taken on CPU (verify.py), whatever the device
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _new_cache(model: torch.nn.Module) -> DynamicCache:
    """A cache keeping every position in every layer, sliding-window layers too: verification compacts it in
    place (keep_accepted_kv), and the window is applied by the masks instead, HF's own in one-token decoding
    (vanilla_generate uses this cache as well) and `tree_attention_mask` in tree forwards. Past the window that
    costs memory, not exactness."""
    attention_layer_types(model.config)
    return DynamicCache()


def tree_attention_mask(model: torch.nn.Module, tree, prefix_len: int, dtype: torch.dtype, device):
    """The tree's attention mask as the target's forward takes it: one 4D mask (windowed when every layer
    slides), or one per layer kind for a family mixing full and sliding layers (HF's `causal_mask_mapping`)."""
    kinds = set(attention_layer_types(model.config))
    window = getattr(model.config, "sliding_window", None)
    masks = {kind: tree.attention_mask(prefix_len, dtype, device, window if kind == "sliding_attention" else None)
             for kind in kinds}
    return masks if len(masks) > 1 else masks.popitem()[1]


class RowLogits:
    """Logits of a tree forward, computed one node at a time (`logits[node]` -> [V]) from the final-norm
    states [N,H]: verification reads only the accepted path and its stop node, so a 60-node tree pays for
    a handful of lm_head rows instead of 60 (lm_head is ~1/5 of a SmolLM2 forward's FLOPs)."""

    def __init__(self, lm_head: torch.nn.Module, final: torch.Tensor):
        self.lm_head, self.final, self.rows = lm_head, final, {}

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            self.rows[node] = self.lm_head(self.final[node : node + 1])[0]
        return self.rows[node]

    def __len__(self) -> int:
        return self.final.shape[0]


def supports_row_logits(model: torch.nn.Module) -> bool:
    return family_of(model.config).plain_logits and isinstance(model.get_output_embeddings(), torch.nn.Linear)


# transformers >= 5.24 (the version constraints.txt pins) captures only the hidden states listed in
# `output_hidden_states`, indexed like the full tuple; older 5.x (5.17 on the GPU kit's machine) reads a list
# differently, so there every state is captured (the same tuple, `True`) and the listed ones picked.
SELECTIVE_HIDDEN_STATES = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward's name for the KV cache: `cache` in transformers >= 5.2x (which still accepts the older
    `past_key_values`, deprecated), `past_key_values` before (5.17 on the GPU kit's machine ignores `cache`)."""
    return _cache_kwarg_of(type(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(model_class: type) -> str:
    # Once per model class: target_forward runs every verification step, a signature lookup need not.
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def target_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    feature_layers: Sequence[int] = (),
    position_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor | dict] = None,  # 4D, or one per layer kind (tree_attention_mask)
    logits_to_keep: int = 0,
    row_logits: bool = False,
) -> tuple[torch.Tensor | RowLogits, Optional[torch.Tensor]]:
    """input_ids [1, T] appended after `cache` -> (logits [T or logits_to_keep, V], states [T, F] or None).

    states concatenates HF `hidden_states[i]` for i in feature_layers (i = residual stream entering layer i;
    -1 = the last entry, which HF ties to the output of the final norm). Only those are captured.
    row_logits=True (plain-lm_head models only) skips lm_head in the forward and returns RowLogits."""
    captured = list(feature_layers) + ([-1] if row_logits and -1 not in feature_layers else [])
    kwargs = {"output_hidden_states": captured if SELECTIVE_HIDDEN_STATES else True} if captured else {}
    if row_logits:  # an empty index selects no rows: the forward stops at the final norm
        logits_to_keep = torch.empty(0, dtype=torch.long, device=input_ids.device)
    kwargs[cache_kwarg(model)] = cache
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
                logits_to_keep=logits_to_keep, **kwargs)
    states = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1)[0] if feature_layers else None
    if row_logits:
        return RowLogits(model.get_output_embeddings(), out.hidden_states[-1][0]), states
    return out.logits[0], states


def keep_accepted_kv(cache: DynamicCache, prefix_len: int, path: list[int]) -> None:
    """After a tree forward the cache holds prefix + all N tree nodes; keep prefix + the accepted path's
    nodes, moved into consecutive slots (the path is increasing, so the copy never overwrites a source
    before reading it; the gather makes a copy anyway)."""
    end = prefix_len + len(path)
    in_place = path == list(range(len(path)))  # root, first child, its first child, ...: nothing to move
    src = prefix_len + torch.tensor(path)
    for layer in cache.layers:
        if not in_place:
            src = src.to(layer.keys.device)
            layer.keys[..., prefix_len:end, :] = layer.keys[..., src, :]
            layer.values[..., prefix_len:end, :] = layer.values[..., src, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]


def _next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return sample(logits_to_probs(logits, temperature, top_p), generator)


def _emit(out: list[int], new_tokens: Sequence[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Append tokens up to EOS (inclusive) or the length limit; True when generation is finished."""
    for t in new_tokens:
        out.append(t)
        if t in eos or len(out) >= max_new_tokens:
            return True
    return False


@torch.no_grad()
def generate(
    target: torch.nn.Module,
    drafter: Drafter,
    input_ids,
    max_new_tokens: int,
    temperature: float = 0.0,
    tree: TreeSpec = DEFAULT_TREE,
    eos_token_ids: Optional[Iterable[int]] = None,
    seed: Optional[int] = None,
    top_p: float = 1.0,
) -> GenerationResult:
    """Speculative decoding of `input_ids` ([n] or [1, n]) with `drafter`, drafting trees of shape `tree`.
    Greedy at temperature 0, else lossless sampling from softmax(logits / T) (top_p filtered).
    eos_token_ids=None takes the target's generation config; () never stops early."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device, dtype = target.device, target.dtype
    ids = _as_ids(input_ids, device)
    spec = tree
    eos, gen, clock = _eos_set(target, eos_token_ids), _generator(seed), _Clock(device)
    layers = tuple(drafter.feature_layers)
    row_logits = supports_row_logits(target)
    cache = _new_cache(target)
    t_start = time.perf_counter()

    with clock("target"):
        logits, states = target_forward(target, ids[None], cache, layers, logits_to_keep=1)
    token = _next_token(logits[-1], temperature, top_p, gen)
    out: list[int] = []
    accept_lengths: list[int] = []
    gaps: list[torch.Tensor] = [] if temperature > 0 else [top2_gap(logits[-1])]
    done = _emit(out, [token], max_new_tokens, eos)
    if not done:
        with clock("draft"):
            drafter.start(ids, states, token)
    while not done:
        with clock("draft"):
            tree = drafter.draft(spec, temperature, gen)
        prefix = cache.get_seq_length()
        mask = tree_attention_mask(target, tree, prefix, dtype, device)
        with clock("target"):
            logits, states = target_forward(target, tree.tokens[None].to(device), cache, layers,
                                            tree.position_ids(prefix, device), mask, row_logits=row_logits)
        if temperature <= 0:
            path, bonus = verify_greedy(tree, logits)
        else:
            path, bonus = verify_sampling(tree, logits, temperature, gen, top_p)
        keep_accepted_kv(cache, prefix, path)
        new_tokens = [tree.token_list[i] for i in path[1:]] + [bonus]
        emitted_before = len(out)
        done = _emit(out, new_tokens, max_new_tokens, eos)
        # Count what was emitted: at EOS or max_new_tokens the tail of an accepted path is dropped, and
        # counting it would inflate tau on those last steps.
        accept_lengths.append(min(len(path), len(out) - emitted_before) - 1)
        if temperature <= 0:  # the rows of the path's nodes chose the emitted tokens (cached: read by verify_greedy)
            gaps += [top2_gap(logits[node]) for node in path[:len(out) - emitted_before]]
        if not done:
            accepted_states = None if states is None else states[torch.tensor(path, device=device)]
            with clock("draft"):
                drafter.accept(accepted_states, torch.tensor(new_tokens, device=device))

    wall = time.perf_counter() - t_start
    return GenerationResult(
        tokens=out, accept_lengths=accept_lengths, n_target_forwards=len(accept_lengths),
        target_time=clock.totals["target"], draft_time=clock.totals["draft"],
        other_time=wall - clock.totals["target"] - clock.totals["draft"],
        gaps=torch.stack(gaps).tolist() if gaps else [])  # read once, after the clock: no sync per token


def top2_gap(row: torch.Tensor) -> torch.Tensor:
    """The top-1 minus top-2 logit of a row, on its device (0-d)."""
    top = torch.topk(row.float(), 2).values
    return top[0] - top[1]


@torch.no_grad()
def vanilla_generate(
    target: torch.nn.Module,
    input_ids,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: Optional[Iterable[int]] = None,
    seed: Optional[int] = None,
    top_p: float = 1.0,
) -> GenerationResult:
    """The baseline: one KV-cached target forward per token, same sampling and stopping rules."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = target.device
    ids = _as_ids(input_ids, device)
    eos, gen, clock = _eos_set(target, eos_token_ids), _generator(seed), _Clock(device)
    cache = _new_cache(target)
    t_start = time.perf_counter()
    with clock("target"):
        logits, _ = target_forward(target, ids[None], cache, logits_to_keep=1)
    out: list[int] = []
    n_forwards = 0
    while not _emit(out, [_next_token(logits[-1], temperature, top_p, gen)], max_new_tokens, eos):
        with clock("target"):
            logits, _ = target_forward(target, torch.tensor([[out[-1]]], device=device), cache, logits_to_keep=1)
        n_forwards += 1
    wall = time.perf_counter() - t_start
    return GenerationResult(tokens=out, n_target_forwards=n_forwards, target_time=clock.totals["target"],
                            other_time=wall - clock.totals["target"])


@torch.no_grad()
def follow_greedy(target: torch.nn.Module, input_ids, tokens: Sequence[int]) -> tuple[GenerationResult, list[Parting]]:
    """The target's one-token forwards over `tokens` (an answer to `input_ids`), computed as `vanilla_generate` at
    T=0 computes them (the prompt in one forward, then one KV-cached token at a time), each step's first-ranked
    token held to the answer's (ties.py). No parting: `tokens` is exactly greedy decoding's output, and the run
    (its wall time) is greedy decoding of this answer. Each parting records its margin and the precision's tie
    bound; the check goes on from the answer's own token, so every step of it is checked."""
    device, dtype = target.device, target.dtype
    ids = _as_ids(input_ids, device)
    clock = _Clock(device)
    # The bound's rounding of h applies where logits = lm_head(h) in a rounded precision: only there is h captured
    # (fp32 is exact; the forwards are otherwise vanilla_generate's, and as fast: they time its baseline).
    with_h = supports_row_logits(target) and dtype in UNIT_ROUNDOFF
    weight = target.get_output_embeddings().weight if with_h else None
    if weight is not None and hasattr(weight, "full_tensor"):  # a tensor-parallel lm_head: the whole rows
        weight = weight.full_tensor()
    layers = (-1,) if with_h else ()
    cache = _new_cache(target)
    partings: list[Parting] = []
    t_start = time.perf_counter()
    with clock("target"):
        logits, h = target_forward(target, ids[None], cache, layers, logits_to_keep=1)
    for step, token in enumerate(tokens):
        parting = parting_at(step, logits[-1], h[-1] if with_h else None, weight, int(token), dtype)
        if parting is not None:
            partings.append(parting)
        if step + 1 < len(tokens):
            with clock("target"):
                logits, h = target_forward(target, torch.tensor([[int(token)]], device=device), cache, layers,
                                           logits_to_keep=1)
    wall = time.perf_counter() - t_start
    result = GenerationResult(tokens=list(tokens), n_target_forwards=max(len(tokens) - 1, 0),
                              target_time=clock.totals["target"], other_time=wall - clock.totals["target"])
    return result, partings
