"""The export doctor: the silent mismatches that make a draft head load and then serve at tau ~1, looked for in an
eaglet export of any format, plus one sample run through the training forward and through every loader path
available here, compared layer by layer. `python -m pipeline.doctor <export dir>` (pipeline/doctor.py) is its
command line; docs/export.md#doctor lists what it checks and shows a report.

The failures it looks for are the ones seen in the field, each in one line naming the file, the key or tensor and
the reason:
  - a missing lm_head left at random init by the loader (sglang PR #27908), or an lm_head that *is* a fresh
    initialisation (an untrained head exported): `fresh_init_evidence`;
  - d2t/t2d dropped, zeroed or offset (vLLM PR #18909: vLLM then maps draft id i to target id i), or not the
    trained ones;
  - aux layers in the wrong numbering for the loader that reads them (eaglet's id i is the input of layer i;
    SGLang historically reads layer outputs): `ExportFormat.loader_aux_layers`;
  - RoPE other than trained, and a max_position_embeddings below the target's (the draft's RoPE cache ends there:
    vLLM issue #48894, SGLang PR #10787);
  - the embedding: tied lm_head, an embedding stored with Gemma's sqrt(hidden_size) scale baked in (ModelOpt's
    acceptance-1.004 failure), a stored embedding other than the target's (vLLM uses the draft's own since
    PR #27737);
  - EAGLE-3.1's fc_norm / norm_output keys dropped, misplaced, or written for a loader that ignores them;
  - dtypes against `torch_dtype`.
`check_export` (exporter.py) already holds an export to its format; the doctor reports its findings line by line
(`export_problems`), adds the reason a server would fail silently, and adds what needs the training checkpoint or
the target: the trained tensors and settings (the export's manifest names the train stage it read), the target's
vocabulary, positions and embedding, and the sample.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from pipeline.families import family_of
from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig
from pipeline.manifest import MANIFEST, ExportManifest, ManifestError, check_fingerprint, file_problem
from pipeline.precision import parse_dtype
from pipeline.target import TargetParts

from .exporter import CONFIG, WEIGHTS, export_problems, export_state, load_export, read_config, recorded_convention
from .formats import SAFETENSORS_DTYPES, ExportError, ExportFormat
from .formats.gguf import GGUF_FILE
from .formats.sglang import SGLANG_RULES

PROBLEM, WARNING = "problem", "warning"
SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts a few tokens with a small "
               "head, and the target model verifies all of them in one forward pass.")
MAX_SAMPLE_TOKENS = 48
# Relative activation difference a reloaded export may show against the training forward: bf16 weights round
# each value to 8 bits of mantissa (a relative 2^-9), a few matmuls deep that stays well under 3e-2; fp32 exports
# are bit-exact up to summation order.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}
# Fraction of the sample's top-1 draft tokens (as target ids) a reloaded export must share with the training
# forward: bf16 rounding may flip near-ties.
TOKEN_AGREEMENT = {torch.bfloat16: 0.8, torch.float32: 1.0}
# The module outputs compared, in forward order (names of the heads' modules; absent ones are skipped).
STAGES = ("embed_tokens", "fc", "midlayer", "layers.0", "norm", "lm_head")
STAGE_LABELS = {"embed_tokens": "embed", "lm_head": "logits"}

# Why a tensor the format's loaders read, missing from the file or unknown to them, fails silently.
MISSING_WHY = {
    "lm_head.weight": "SGLang and vLLM leave a missing lm_head at its random initialisation and draft at tau ~1 "
                      "(sglang PR #27908)",
    "d2t": "without d2t SGLang (its hot_token_id) and vLLM (PR #18909) take draft id i for target id i: every "
           "drafted token is another one",
    "t2d": "SGLang and vLLM read d2t only, but eaglet's loader and checks hold the draft vocabulary to t2d",
}
MISSING_DEFAULT = "the loaders leave a missing tensor at its initialisation, without an error"
UNEXPECTED_WHY = {"fc_norm": "config.json does not set fc_norm: true, so every loader skips these norms without an "
                             "error and drafts as a plain EAGLE-3"}
UNEXPECTED_DEFAULT = "the loaders skip tensor names they do not know, without an error"
# What reads EAGLE-3.1's keys in each format's loaders (docs/export.md#eagle-31-options-headfc_norm-headnorm_output).
EAGLE31_READERS = {
    "sglang": "SGLang reads fc_norm / norm_output only where its llama_eagle3 has EAGLE-3.1 (see docs/export.md); "
              "an older SGLang skips fc_norm.* and ignores the keys without an error",
    "vllm": "vLLM reads fc_norm in its EAGLE-3.1 llama_eagle3, and norm_output through the speculators format only "
            "with vLLM PR #46488; an older vLLM skips fc_norm.* and ignores the keys without an error",
}


@dataclass(frozen=True)
class Finding:
    severity: str  # PROBLEM (the export will not serve as trained) or WARNING (it depends on the server)
    file: str  # config.json, model.safetensors, draft.gguf, manifest.json, or "sample" (the forward comparison)
    key: str  # the config key or tensor
    reason: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.file}: {self.key}: {self.reason}"


@dataclass
class StageDiff:
    stage: str  # STAGE_LABELS name
    norm_ratio: float  # ||loaded|| / ||reference||
    rel_diff: float  # ||loaded - reference|| / ||reference||


@dataclass
class LoaderRun:
    """One loader path's pass over the sample, against the reference forward."""
    name: str
    tolerance: float = 0.0
    stages: list[StageDiff] = field(default_factory=list)
    top1: Optional[tuple[int, int]] = None  # (agreeing tokens, tokens)
    refused: Optional[str] = None  # why the loader refused the export
    first_divergence: Optional[str] = None


@dataclass
class Diagnosis:
    export_dir: Path
    context: list[str]  # what was looked at: format, target, reference, layers, rope
    findings: list[Finding]
    runs: list[LoaderRun]
    reference: str  # what the runs are compared with
    sample_tokens: int = 0

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == PROBLEM]

    @property
    def healthy(self) -> bool:
        return not self.problems

    def report(self) -> str:
        lines = [f"eaglet doctor: {self.export_dir}", *(f"  {c}" for c in self.context)]
        if self.sample_tokens and self.runs:
            lines += ["", f"one sample ({self.sample_tokens} tokens) through {self.reference} and through each "
                          f"loader: ||loaded|| / ||reference|| (relative difference)"]
            lines += _run_table(self.runs)
        elif self.sample_tokens:
            lines += ["", f"one sample ({self.sample_tokens} tokens) through {self.reference}: no other loader here "
                          f"to compare it with"]
        else:
            lines += ["", "no sample run: " + ("nothing loads the export to compare with" if self.runs else
                                               "the target's parts only (static checks)")]
            lines += [f"  {r.name} refused the export: {r.refused}" for r in self.runs if r.refused]
        lines += [""] + [str(f) for f in self.findings]
        n_problems, n_warnings = len(self.problems), len(self.findings) - len(self.problems)
        verdict = "healthy" if self.healthy else "NOT healthy"
        lines.append(f"{verdict}: {n_problems} problem{'s' * (n_problems != 1)}, "
                     f"{n_warnings} warning{'s' * (n_warnings != 1)}")
        return "\n".join(lines)


@dataclass
class Reference:
    """The head as trained: its config (from the training checkpoint, else the export's manifest) and, where the
    training checkpoint is here, the head itself."""
    config: Optional[DraftHeadConfig] = None
    head: Optional[nn.Module] = None
    source: str = "none"


# ---------------------------------------------------------------------------------------------------------
# the doctor


def diagnose(export_dir: Path, target, train_dir: Optional[Path] = None, run_sample: bool = True,
             sglang_aux_convention: Optional[str] = None, text: str = SAMPLE_TEXT) -> Diagnosis:
    """Lints `export_dir` (any eaglet format) against `target` (a pipeline.target.Target: the full model to run
    the sample, or its parts with `run_sample=False`) and the head as trained (`train_dir`; None: the train stage
    the export's manifest names, if it is still there)."""
    export_dir = Path(export_dir)
    findings: list[Finding] = []
    model = target.model
    tconfig = getattr(model.config, "get_text_config", lambda: model.config)()
    manifest = _export_manifest(export_dir, findings)
    if manifest is not None:
        findings += _file_findings(export_dir, manifest)
        findings += _fingerprint_findings(manifest, target)
    convention = str(sglang_aux_convention or recorded_convention(manifest))
    reference = _reference(manifest, train_dir, target, findings)

    try:
        cfg = read_config(export_dir)
        form, _, problems = export_problems(export_dir)
    except (ExportError, ValueError, OSError) as e:  # no config.json or weights, or an unknown format
        findings.append(Finding(PROBLEM, CONFIG, "architectures", str(e)))
        return Diagnosis(export_dir, [], findings, [], reference.source)
    findings += _export_findings(problems)
    from safetensors.torch import load_file

    state = load_file(str(export_dir / WEIGHTS))
    gguf = export_dir / GGUF_FILE
    num_layers = tconfig.num_hidden_layers
    try:
        written = form.read_config(cfg, num_layers, fc_bias="fc.bias" in state, sglang_convention=convention)
    except (KeyError, TypeError, ValueError) as e:
        written = None
        findings.append(Finding(PROBLEM, CONFIG, "config", f"{form.name} format's loader cannot read it: {e!r}"))
    export_dtype = _export_dtype(cfg, form)
    context = [f"format {form.name}{' + draft.gguf' if gguf.is_file() else ''} "
               f"({(cfg.get('architectures') or ['?'])[0]}), "
               f"{form.kind} head, {cfg.get('torch_dtype')}"
               + (f", draft_vocab_size {written.draft_vocab_size} of vocab_size {written.vocab_size}"
                  if written is not None else ""),
               f"target: {tconfig.model_type}, {num_layers} layers, hidden_size {tconfig.hidden_size}, vocab_size "
               f"{tconfig.vocab_size}, max_position_embeddings {tconfig.max_position_embeddings}",
               f"reference: {reference.source}"]

    findings += _finite_findings(state)
    findings += _zero_findings(state)
    fresh = _fresh_init_findings(state, form, written) if written is not None else []
    findings += fresh
    if written is not None:
        findings += _vocab_findings(written, tconfig)
        findings += _rope_findings(cfg, form, written, reference.config, tconfig, context)
        findings += _eagle31_findings(cfg, form, reference.config, gguf.is_file())
    findings += _aux_findings(cfg, form, reference.config, num_layers, context)
    findings += _embedding_findings(state, form, model, tconfig)
    findings += _dtype_findings(cfg, form)
    if reference.head is not None:
        findings += _reference_tensor_findings(state, reference.head, form, skip={f.key for f in fresh})
    if gguf.is_file():
        findings += _gguf_findings(gguf, written, reference, form, state)

    runs, tokens, reference_label = [], 0, reference.source
    if run_sample and not isinstance(model, TargetParts):  # the sample needs the target's layers
        conventions = [convention]
        primary = {tuple(ids) for _, ids, first in form.loader_aux_layers(cfg, num_layers) if first}
        if form.name == "sglang" and len(primary) > 1:  # the two SGLang rules read these ids differently
            conventions = list(SGLANG_RULES)
        runs, tokens, reference_label = _run_sample(export_dir, target, reference, gguf, conventions, export_dtype,
                                                    text)
        findings += _sample_findings(runs, reference_label)
        if not any(f.severity == PROBLEM for f in findings):
            findings += [Finding(PROBLEM, "sample", r.name, f"refused the export: {r.refused}") for r in runs
                         if r.refused]
    return Diagnosis(export_dir, context, _collapse(findings), runs, reference_label, tokens)


# ---------------------------------------------------------------------------------------------------------
# the manifest and the reference


def _export_manifest(export_dir: Path, findings: list[Finding]) -> Optional[ExportManifest]:
    if not (export_dir / MANIFEST).is_file():
        findings.append(Finding(WARNING, MANIFEST, "-", "none (a bare export): no recorded digests, target or "
                                                        "training input to hold it to"))
        return None
    try:
        return ExportManifest.load(export_dir)
    except ManifestError as e:
        findings.append(Finding(PROBLEM, MANIFEST, "-", str(e)))
        return None


def _file_findings(export_dir: Path, manifest: ExportManifest) -> list[Finding]:
    return [Finding(PROBLEM, name, "sha256", f"{problem}: changed since the export stage wrote it; rerun the export")
            for name, rec in sorted(manifest.files.items())
            if (problem := file_problem(export_dir / name, rec.get("bytes"), rec.get("sha256")))]


def _fingerprint_findings(manifest: ExportManifest, target) -> list[Finding]:
    if not manifest.target:
        return []
    try:
        check_fingerprint(target.fingerprint, manifest.target, Path(MANIFEST), "target")
    except ManifestError as e:
        first = str(e).splitlines()[0]
        return [Finding(PROBLEM, MANIFEST, "target", f"{first}: the export was made for another target than the "
                                                     f"one given")]
    return []


def train_input(manifest: Optional[ExportManifest]) -> Optional[Path]:
    """The train stage folder an export stage read (its manifest's first input), if it names one."""
    if manifest is None or not manifest.inputs:
        return None
    return Path(manifest.inputs[0]["path"])


def _reference(manifest: Optional[ExportManifest], train_dir: Optional[Path], target, findings: list[Finding]
               ) -> Reference:
    from pipeline.heads.io import FINAL, load_head

    named = train_dir is not None
    train_dir = Path(train_dir) if named else train_input(manifest)
    recorded = manifest.head_config if manifest is not None else {}
    if train_dir is not None and (train_dir / FINAL).is_dir():
        if not named and manifest is not None and (train_dir / MANIFEST).is_file():
            from pipeline.files import sha256_file

            if sha256_file(train_dir / MANIFEST) != manifest.inputs[0].get("manifest_sha256"):
                findings.append(Finding(WARNING, MANIFEST, "inputs", f"{train_dir} was trained again since this "
                                        f"export: it is compared with the head there now"))
        try:
            head = load_head(train_dir, target, device=torch.device("cpu"), dtype=torch.float32)
        except (ManifestError, RuntimeError, ValueError, OSError) as e:
            findings.append(Finding(PROBLEM if named else WARNING, MANIFEST, "inputs",
                                    f"the training checkpoint {train_dir} does not load: {e}"))
        else:
            return Reference(head.config, head, f"the training checkpoint {train_dir / FINAL}")
    elif train_dir is not None:
        findings.append(Finding(WARNING, MANIFEST, "inputs", f"the training checkpoint {train_dir / FINAL} is gone: "
                                                             f"the export is held to its manifest's head_config only"))
    if recorded:
        return Reference(DraftHeadConfig.from_dict(recorded), None, "the head_config of the export's manifest")
    return Reference()


# ---------------------------------------------------------------------------------------------------------
# the format's own checks, one line each


def _key_of(text: str) -> str:
    """The config key or tensor a check_export line is about: its first word that looks like a key."""
    words = text.split()
    if words and words[0] in ("d2t", "t2d"):
        return words[0]
    for w in words:
        w = w.rstrip(":,")
        if any(c in w for c in "_./"):
            return w
    return words[0].rstrip(":,") if words else "-"


def _export_findings(problems: list[tuple[str, str]]) -> list[Finding]:
    out = []
    for file, text in problems:
        if m := re.match(r"^(missing|unexpected) tensor (\S+) (\[.*\])$", text):
            kind, name, shape = m.groups()
            table, default = (MISSING_WHY, MISSING_DEFAULT) if kind == "missing" else (UNEXPECTED_WHY,
                                                                                       UNEXPECTED_DEFAULT)
            why = table.get(name) or table.get(name.split(".")[0]) or default
            out.append(Finding(PROBLEM, file, name, f"{kind} (shape {shape}): {why}"))
            continue
        key = _key_of(text)
        reason = text[len(key):].lstrip(": ") if text.startswith(key) else text
        out.append(Finding(PROBLEM, file, key, reason))
    return out


def _collapse(findings: list[Finding]) -> list[Finding]:
    """One line for what one cause says many times: fc_norm.{0,1,2}.weight, and every tensor of one wrong dtype."""
    out, seen = [], set()
    dtype_lines = [f for f in findings if re.match(r"^dtype \w+, expected \w+$", f.reason)]
    groups: dict[str, list[Finding]] = {}
    for f in dtype_lines:
        groups.setdefault(f.reason, []).append(f)
    for f in findings:
        if f in dtype_lines and len(groups[f.reason]) > 1:
            if f.reason not in seen:
                seen.add(f.reason)
                names = [g.key for g in groups[f.reason]]
                got, want = re.match(r"^dtype (\w+), expected (\w+)$", f.reason).groups()
                said = next((k for k, v in SAFETENSORS_DTYPES.items() if v == want), want)
                out.append(Finding(PROBLEM, f.file, "torch_dtype", f"{len(names)} tensors are {got} but config.json's "
                                   f"torch_dtype says {said} ({', '.join(names[:3])}{', ...' * (len(names) > 3)})"))
            continue
        if re.match(r"^fc_norm\.\d\.weight$", f.key):
            tag = ("fc_norm", f.severity, f.file, f.reason)
            if tag in seen:
                continue
            seen.add(tag)
            f = dataclasses.replace(f, key="fc_norm.{0,1,2}.weight")
        out.append(f)
    return out


# ---------------------------------------------------------------------------------------------------------
# weights


def _finite_findings(state: dict[str, torch.Tensor]) -> list[Finding]:
    return [Finding(PROBLEM, WEIGHTS, name, f"{int((~torch.isfinite(t)).sum())} of {t.numel()} values are NaN or "
                                            f"inf")
            for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def _zero_findings(state: dict[str, torch.Tensor]) -> list[Finding]:
    return [Finding(PROBLEM, WEIGHTS, name, "all zeros: the layer outputs nothing (a zeroed or never-written "
                                            "tensor)")
            for name, t in state.items() if t.is_floating_point() and t.numel() and not bool(t.any())]


KS_ALPHA = 1e-6  # false-alarm rate of the fresh-initialisation test on a truly trained matrix
KS_SAMPLES = 200_000


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov distance: the largest gap between the empirical CDFs of a and b."""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True).double() / a.numel()
    fb = torch.searchsorted(b, grid, right=True).double() / b.numel()
    return float((fa - fb).abs().max())


def fresh_init_evidence(weight: torch.Tensor, fresh: torch.Tensor) -> Optional[str]:
    """Why `weight` looks like an untrained draw of the same initialisation as `fresh` (a freshly initialised
    module of the head class, same shape), or None if it does not.

    The test compares distributions, not values, so it holds whatever seed made either matrix. A fresh
    nn.Linear draws every entry independently and uniformly from [-b, b], b = 1/sqrt(in_features). Both must hold:
      - the value distribution is the initialisation's: the two-sample Kolmogorov-Smirnov distance between
        (up to 200k sampled) entries of `weight` and of `fresh` is below its critical value at alpha = 1e-6,
        c(alpha) * sqrt((n + m) / (n m)) (0.012 at 200k entries, 0.048 for a 100 x 64 head);
      - no entry leaves the initialisation's range (max |w| <= max |fresh|, plus bf16 rounding).
    Training moves every entry (Adam's steps are per entry), spreading the distribution past the uniform's hard
    edge within a few steps, so a trained matrix fails both; a fresh draw passes both except with probability
    alpha. Correlation with the target's lm_head rows is not used: a trained draft lm_head reads the draft's own
    hidden space, so it is not correlated with the target's rows either; it is printed only as context."""
    n = weight.numel()
    gen = torch.Generator().manual_seed(0)

    def pick(t: torch.Tensor) -> torch.Tensor:
        flat = t.flatten()
        return flat[torch.randint(flat.numel(), (KS_SAMPLES,), generator=gen)] if flat.numel() > KS_SAMPLES else flat

    weight, fresh = weight.detach().float(), fresh.detach().float()
    w, f = pick(weight), pick(fresh)
    d = ks_distance(w, f)
    critical = math.sqrt(-math.log(KS_ALPHA / 2) / 2) * math.sqrt((w.numel() + f.numel()) / (w.numel() * f.numel()))
    bound = float(fresh.abs().max()) * (1 + 2 ** -7)
    top = float(weight.abs().max())
    if d < critical and top <= bound:
        return (f"distributed as a fresh initialisation of the head class (Kolmogorov-Smirnov distance {d:.3g} < "
                f"{critical:.3g}, max |w| {top:.3g} within the init bound {bound:.3g}, std {float(w.std()):.3g} vs "
                f"{float(f.std()):.3g}, {n} values): an untrained tensor")
    return None


def _fresh_init_findings(state: dict[str, torch.Tensor], form: ExportFormat, c: DraftHeadConfig) -> list[Finding]:
    """Every stored matrix of a trained nn.Linear, against a fresh one of the head class (built on the meta device,
    then only that module allocated and initialised as the class does)."""
    with torch.device("meta"):
        fresh_head = build_draft_head(c)
    out = []
    for name, module in fresh_head.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        stored = form.to_format(f"{name}.weight")
        weight = state.get(stored) if stored else None
        if weight is None or not module.weight.requires_grad or tuple(weight.shape) != tuple(module.weight.shape):
            continue
        module.to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module.reset_parameters()
        if why := fresh_init_evidence(weight, module.weight):
            tail = " (the draft would propose noise: tau ~1)" if name == "lm_head" else ""
            out.append(Finding(PROBLEM, WEIGHTS, stored, why + tail))
        module.to("meta")
    return out


def _reference_tensor_findings(state: dict[str, torch.Tensor], head: nn.Module, form: ExportFormat,
                               skip: set[str]) -> list[Finding]:
    """Each stored tensor against the trained head's, as the exporter writes it (`export_state`) in the stored
    tensor's dtype: anything else was changed after training. The stored embedding is held to the target's by
    `_embedding_findings`, and `skip` are tensors already explained (a fresh initialisation)."""
    want_dtype = next((t.dtype for n, t in state.items() if t.is_floating_point()), torch.float32)
    expected = export_state(head, form, want_dtype)
    out = []
    for name, want in expected.items():
        got = state.get(name)
        if got is None or got.shape != want.shape or name in skip or name == form.to_format("embed_tokens.weight"):
            continue
        want = want.to(got.dtype)
        if torch.equal(got, want):
            continue
        if name == "d2t":
            how = f"{int((got != want).sum())} of {got.numel()} draft ids map to other target ids than trained"
        elif name == "t2d":
            how = f"marks {int((got != want).sum())} target ids differently from the trained vocabulary"
        else:
            diff = float((got.float() - want.float()).abs().max())
            how = f"max |difference| {diff:.3g} (values up to {float(want.float().abs().max()):.3g})"
        out.append(Finding(PROBLEM, WEIGHTS, name, f"differs from the training checkpoint: {how}"))
    return out


# ---------------------------------------------------------------------------------------------------------
# config against the target and the head as trained


def _vocab_findings(c: DraftHeadConfig, tconfig) -> list[Finding]:
    if c.vocab_size != tconfig.vocab_size:
        return [Finding(PROBLEM, CONFIG, "vocab_size", f"{c.vocab_size}, the target's is {tconfig.vocab_size}: t2d "
                                                       f"and the draft's token ids index another vocabulary")]
    return []


def _target_rope(tconfig) -> tuple[Optional[float], Optional[dict]]:
    """The target's (theta, scaling or None), from transformers 5's rope_parameters or 4's rope_theta and
    rope_scaling; per-layer-kind parameters (Gemma 3) give the global layers'."""
    params = getattr(tconfig, "rope_parameters", None) or getattr(tconfig, "rope_scaling", None) or {}
    if "full_attention" in params:
        params = params["full_attention"]
    theta = params.get("rope_theta") or getattr(tconfig, "rope_theta", None)
    scaled = params.get("rope_type", params.get("type", "default")) != "default"
    return (float(theta) if theta is not None else None), (params if scaled else None)


def _rope_findings(cfg: dict, form: ExportFormat, c: DraftHeadConfig, trained: Optional[DraftHeadConfig], tconfig,
                   context: list[str]) -> list[Finding]:
    """The RoPE the loaders build: one theta in both transformers spellings, no scaling (eaglet's RotaryEmbedding
    has none), the theta the head was trained with, and room for every position of the target. The target's own
    theta is only context: eaglet's heads train with `head.rope_theta` (10000 by default, as the official EAGLE
    trainer), whatever the target uses, and the export must say what the head was trained with."""
    layer = form.layer_fields(cfg) or {}
    out = []
    params = layer.get("rope_parameters") or {}
    if layer.get("rope_theta") is not None and params.get("rope_theta") is not None \
            and float(layer["rope_theta"]) != float(params["rope_theta"]):
        out.append(Finding(PROBLEM, CONFIG, "rope_theta", f"{layer['rope_theta']}, but rope_parameters.rope_theta is "
                           f"{params['rope_theta']}: transformers 4 and 5 readers build different RoPE"))
    scaling = layer.get("rope_scaling")
    if scaling or params.get("rope_type", "default") != "default":
        out.append(Finding(PROBLEM, CONFIG, "rope_scaling", f"{scaling or params}: eaglet heads are trained without "
                           f"RoPE scaling; the loader would rescale the draft's positions"))
    if trained is not None and float(c.rope_theta) != float(trained.rope_theta):
        out.append(Finding(PROBLEM, CONFIG, "rope_theta", f"{c.rope_theta}, the head was trained with "
                           f"{trained.rope_theta}: the draft's attention sees other relative positions"))
    theta, target_scaling = _target_rope(tconfig)
    context.append(f"rope_theta {c.rope_theta} ({'as trained' if trained is not None else 'trained value unknown'}"
                   f"; the target's: {theta}{', scaled ' + json.dumps(target_scaling) if target_scaling else ''})")
    target_positions = getattr(tconfig, "max_position_embeddings", None)
    if target_positions and c.max_position_embeddings < target_positions:
        out.append(Finding(PROBLEM, CONFIG, "max_position_embeddings", f"{c.max_position_embeddings}, below the "
                           f"target's {target_positions}: servers size the draft's RoPE cache from it, and past it "
                           f"read out of range (vLLM issue #48894, SGLang PR #10787)"))
    return out


def _aux_findings(cfg: dict, form: ExportFormat, trained: Optional[DraftHeadConfig], num_layers: int,
                  context: list[str]) -> list[Finding]:
    """What each loader of the directory captures (`ExportFormat.loader_aux_layers`, in eaglet's numbering)
    against the layers the head was trained on. A miss by the loaders the format is written for is a problem when
    all of them miss (one of them is the export's documented trade-off: a warning); by another loader, a warning."""
    reads = form.loader_aux_layers(cfg, num_layers)
    if not reads:
        return []
    want = sorted(trained.aux_layer_ids) if trained is not None else None
    context.append("aux layers " + ", ".join(f"{loader} {ids}" for loader, ids, _ in reads)
                   + (f"; trained on {want}" if want else "; trained layers unknown"))
    key = ("eagle_config.eagle_aux_hidden_state_layer_ids" if "eagle_config" in cfg
           else "eagle_aux_hidden_state_layer_ids")
    if want is None:
        if len({tuple(ids) for _, ids, _ in reads}) > 1:
            return [Finding(WARNING, CONFIG, key, "the loaders capture different layers: " + "; ".join(
                f"{loader} {ids}" for loader, ids, _ in reads))]
        return []
    missed = [(loader, ids, primary) for loader, ids, primary in reads if ids != want]
    primaries = [r for r in reads if r[2]]
    out = []
    for loader, ids, primary in missed:
        shift = {g - w for g, w in zip(ids, want)}
        hint = (f" (every id off by {next(iter(shift)):+d}: written in another numbering than this loader reads; "
                f"eaglet's id i is the input of layer i, SGLang's historic ids are layer outputs, i - 1)"
                if len(shift) == 1 and len(ids) == len(want) else "")
        severity = PROBLEM if primary and len([m for m in missed if m[2]]) == len(primaries) else WARNING
        out.append(Finding(severity, CONFIG, key, f"{loader} captures the inputs of layers {ids}, the head was "
                                                  f"trained on {want}{hint}"))
    return out


def _embedding_findings(state: dict[str, torch.Tensor], form: ExportFormat, model, tconfig) -> list[Finding]:
    """The embedding a loader hands the draft. eaglet's heads embed with the target's raw embedding rows
    (`DraftHeadMixin.embed`), as SGLang's and vLLM's Llama drafts do with the weight they share; Gemma's
    sqrt(hidden_size) normalizer belongs to the target's forward. A stored embedding (vllm, eagle1) must be exactly
    the target's rows, which vLLM now uses as the draft's own (PR #27737). A full-vocabulary EAGLE-3 lm_head may be
    replaced by the target's where an engine shares it."""
    out = []
    family = family_of(model.config)
    h = tconfig.hidden_size
    stored_name = form.to_format("embed_tokens.weight")  # None: the loader shares the target's
    stored = state.get(stored_name) if stored_name else None
    rows = model.get_input_embeddings().weight.detach().to("cpu")
    if stored is not None and stored.shape == rows.shape and not torch.equal(stored, rows.to(stored.dtype)):
        s, r = stored.double(), rows.double()
        scale = float((s * r).sum() / (r * r).sum().clamp_min(1e-30))
        if abs(scale - math.sqrt(h)) <= 1e-2 * math.sqrt(h):
            reason = (f"the target's embedding times sqrt(hidden_size) = {math.sqrt(h):.4g} (Gemma's embedding "
                      f"scale baked in): the head was trained on the unscaled rows and would embed "
                      f"{math.sqrt(h):.3g}x too large")
        else:
            reason = (f"differs from the target's input embedding (max |difference| "
                      f"{float((s - r).abs().max()):.3g}, scale {scale:.3g}): vLLM uses a draft's own embedding "
                      f"(PR #27737), and the head was trained on the target's")
        out.append(Finding(PROBLEM, WEIGHTS, "embed_tokens.weight", reason))
    if family.embed_scale:
        out.append(Finding(WARNING, CONFIG, "embed_scale", f"the target ({tconfig.model_type}) scales its embeddings "
                           f"by sqrt(hidden_size) = {math.sqrt(h):.4g} in its forward; the head was trained on the "
                           f"unscaled rows (the shared weight, as a Llama draft reads it): a server that hands the "
                           f"draft the target's scaled embedding instead (an embedding module that scales inside its "
                           f"forward, as SGLang's Gemma 3 one does) feeds it {math.sqrt(h):.3g}x larger inputs; check "
                           f"that yours shares the weight"))
    lm_head = state.get("lm_head.weight")
    if form.kind == "eagle3" and lm_head is not None and lm_head.shape[0] == tconfig.vocab_size:
        target_head = model.get_output_embeddings().weight.detach().to("cpu")
        if lm_head.shape == target_head.shape and not torch.equal(lm_head, target_head.to(lm_head.dtype)):
            out.append(Finding(WARNING, WEIGHTS, "lm_head.weight", "a full-vocabulary draft with its own lm_head: "
                               "engines that share the target's lm_head with such drafts (vLLM before PR #27737) "
                               "serve the target's instead"))
    return out


def _eagle31_findings(cfg: dict, form: ExportFormat, trained: Optional[DraftHeadConfig], has_gguf: bool
                      ) -> list[Finding]:
    """EAGLE-3.1's keys where the loaders read them (the top level of config.json), as trained, and for a loader
    that reads them."""
    keys = ("fc_norm", "norm_output")
    out = []
    nested = {"transformer_layer_config": form.layer_fields(cfg) if form.layer_fields(cfg) is not cfg else None,
              "eagle_config": cfg.get("eagle_config")}
    for key in keys:
        for where, section in nested.items():
            if isinstance(section, dict) and key in section and key not in cfg:
                out.append(Finding(PROBLEM, CONFIG, f"{where}.{key}", f"the loaders read {key} at the top level of "
                                                                     f"config.json, not in {where}"))
        if trained is not None and bool(cfg.get(key, False)) != bool(getattr(trained, key)):
            said = "true" if cfg.get(key) else "absent or false"
            out.append(Finding(PROBLEM, CONFIG, key, f"{said}, the head was trained with {key}="
                               f"{str(getattr(trained, key)).lower()}: the loaders build another network"))
    on = [k for k in keys if cfg.get(k)]
    if on and has_gguf:
        out.append(Finding(PROBLEM, GGUF_FILE, ", ".join(on), "llama.cpp's EAGLE-3 draft has no EAGLE-3.1 norms: it "
                                                              "drafts as a plain EAGLE-3 head"))
    elif on and form.name in EAGLE31_READERS:
        out.append(Finding(WARNING, CONFIG, ", ".join(on), EAGLE31_READERS[form.name]))
    return out


def _dtype_findings(cfg: dict, form: ExportFormat) -> list[Finding]:
    layer = form.layer_fields(cfg)
    if isinstance(layer, dict) and layer is not cfg and layer.get("torch_dtype") and cfg.get("torch_dtype") \
            and layer["torch_dtype"] != cfg["torch_dtype"]:
        return [Finding(PROBLEM, CONFIG, "torch_dtype", f"{cfg['torch_dtype']} at the top level, "
                        f"{layer['torch_dtype']} in transformer_layer_config: loaders read one or the other")]
    return []


def _export_dtype(cfg: dict, form: ExportFormat) -> torch.dtype:
    name = (form.layer_fields(cfg) or {}).get("torch_dtype") or cfg.get("torch_dtype") or "float32"
    try:
        return parse_dtype(name, "torch_dtype")
    except ValueError:
        return torch.float32


def _gguf_findings(path: Path, written: Optional[DraftHeadConfig], reference: Reference, form: ExportFormat,
                   state: dict[str, torch.Tensor]) -> list[Finding]:
    """The GGUF llama.cpp loads, read back with gguf-py and held to the head as trained (or, with no training
    checkpoint, to the export's own config and tensors, as the export stage holds it)."""
    try:
        from pipeline.export.formats.gguf import gguf_problems
    except ImportError:  # pragma: no cover - gguf is a dependency
        return [Finding(WARNING, GGUF_FILE, "-", "gguf-py is not installed: not read back")]
    if reference.head is not None:
        config = dataclasses.replace(reference.config, aux_layer_ids=sorted(reference.config.aux_layer_ids))
        want = {n: t for n, t in export_state(reference.head, form, next(
            t.dtype for t in state.values() if t.is_floating_point())).items()}
    elif written is not None:
        config, want = written, state
    else:
        return []
    out = []
    for line in gguf_problems(path, config, want):
        key = _key_of(line)
        reason = line[len(key):].lstrip(": =") if line.startswith(key) else line
        out.append(Finding(PROBLEM, GGUF_FILE, key, reason))
    return out


# ---------------------------------------------------------------------------------------------------------
# the sample


def sample_ids(tokenizer, vocab_size: int, text: str = SAMPLE_TEXT) -> torch.Tensor:
    """The sample's token ids [T]: `text` through the target's tokenizer (random ids without one)."""
    if tokenizer is not None:
        ids = torch.tensor(tokenizer(text).input_ids[:MAX_SAMPLE_TOKENS], dtype=torch.long)
        if ids.numel() >= 4:
            return ids
    return torch.randint(0, vocab_size, (MAX_SAMPLE_TOKENS,), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def trace(head: nn.Module, states: dict[int, torch.Tensor], ids: torch.Tensor, rounds: int = 2
          ) -> dict[str, torch.Tensor]:
    """The sample through `head` as training runs it: EAGLE-3 heads through the TTT unroll (heads/ttt.py), `rounds`
    rounds, so that the state fed back to the next draft step is compared too; EAGLE-1 heads through one forward.
    `states` maps each layer id (-1: the final state) to [T, H_target]; `ids` [T]. Returns the module outputs of
    STAGES in forward order, each round after the first suffixed ", step 2" etc. (the embedding once), and "top1":
    the first round's argmax draft tokens as target ids."""
    calls: dict[str, list[torch.Tensor]] = {n: [] for n in STAGES}
    modules = dict(head.named_modules())
    hooks = [modules[n].register_forward_hook(lambda m, i, o, n=n: calls[n].append(o.detach().float().cpu()))
             for n in STAGES if n in modules]
    param = next(head.parameters())
    fused = torch.cat([states[i] for i in list(head.config.aux_layer_ids) or [-1]], dim=-1)
    fused = fused[None].to(device=param.device, dtype=param.dtype)
    ids = ids[None].to(param.device)
    try:
        if hasattr(head, "layer"):  # unrolled by TTT in training (EAGLE-3)
            from pipeline.heads.losses import align_batch
            from pipeline.heads.ttt import ttt_forward

            batch = align_batch(ids, torch.ones_like(ids, dtype=torch.bool), fused, fused)
            logits = [head.logits(out) for out in ttt_forward(head, batch, rounds)]
        else:
            _, first = head(head.fuse(fused[:, :-1]), ids[:, 1:], torch.arange(ids.shape[1] - 1)[None])
            logits = [first]
    finally:
        for h in hooks:
            h.remove()
    acts = {}
    for r in range(rounds):
        for name in STAGES:
            if r < len(calls[name]) and not (name in ("embed_tokens", "fc") and r > 0):
                acts[STAGE_LABELS.get(name, name) + (f", step {r + 1}" if r else "")] = calls[name][r]
    acts["top1"] = head.draft_to_target(logits[0].argmax(-1)).cpu()
    return acts


def compare(name: str, ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], dtype: torch.dtype) -> LoaderRun:
    """`got` against `ref` stage by stage; the first stage past the dtype's tolerance is the divergence."""
    run = LoaderRun(name, TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16]))
    for stage, b in ref.items():
        if stage == "top1" or stage not in got:
            continue
        a = got[stage]
        if a.shape != b.shape:
            run.stages.append(StageDiff(stage, float("nan"), float("inf")))
        else:
            norm = float(b.norm()) or 1.0
            run.stages.append(StageDiff(stage, float(a.norm()) / norm, float((a - b).norm()) / norm))
        if run.first_divergence is None and not run.stages[-1].rel_diff <= run.tolerance:
            run.first_divergence = stage
    if got["top1"].shape == ref["top1"].shape:
        run.top1 = (int((got["top1"] == ref["top1"]).sum()), ref["top1"].numel())
        if run.first_divergence is None and run.top1[0] < TOKEN_AGREEMENT.get(dtype, 0.8) * run.top1[1]:
            run.first_divergence = "top-1"
    return run


def _loaders(export_dir: Path, model: nn.Module, gguf: Path, conventions: Sequence[str]
             ) -> tuple[dict[str, nn.Module], list[LoaderRun]]:
    """The export as each loader path here rebuilds it: eaglet's load_export (once per SGLang numbering rule
    where the two read the layer ids differently), and draft.gguf read back with gguf-py. Refusals are runs too."""
    loaded, refused = {}, []
    for convention in conventions:
        name = "load_export" if len(conventions) == 1 else f"load_export ({SGLANG_RULES[convention]})"
        try:
            loaded[name] = load_export(export_dir, model, device=torch.device("cpu"), dtype=torch.float32,
                                       sglang_aux_convention=convention)
        except (ExportError, ManifestError, RuntimeError, KeyError, ValueError) as e:
            refused.append(LoaderRun(name, refused=_first_line(e)))
    if gguf.is_file():
        name = "draft.gguf (gguf-py)"
        try:
            loaded[name] = gguf_head(gguf, model)
        except ImportError:
            refused.append(LoaderRun(name, refused="gguf-py is not installed"))
        except (ExportError, RuntimeError, KeyError, ValueError) as e:
            refused.append(LoaderRun(name, refused=_first_line(e)))
    return loaded, refused


def _first_line(error: BaseException) -> str:
    """An error's first problem (check_export lists one per line under a heading), and how many more."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    found = lines[1:] if len(lines) > 1 and lines[0].endswith(":") else lines
    return f"{found[0]}{f' (and {len(found) - 1} more)' if len(found) > 1 else ''}" if found else repr(error)


def _run_sample(export_dir: Path, target, reference: Reference, gguf: Path, conventions: Sequence[str],
                export_dtype: torch.dtype, text: str) -> tuple[list[LoaderRun], int, str]:
    """The sample through the reference (the training checkpoint's head, else eaglet's own load_export) and
    through each loader path."""
    from transformers import DynamicCache

    from pipeline.decoding.decoder import target_forward

    model = target.model
    loaded, refused = _loaders(export_dir, model, gguf, conventions)
    if reference.head is not None:
        ref_head, ref_name = reference.head, "the training forward"
    elif loaded and next(iter(loaded)).startswith("load_export"):
        ref_head, ref_name = loaded.pop(next(iter(loaded))), "eaglet's load_export (no training checkpoint)"
    else:
        return refused, 0, "nothing"
    heads = [ref_head, *loaded.values()]
    layers = sorted({i for h in heads for i in (list(h.config.aux_layer_ids) or [-1])})
    ids = sample_ids(target.tokenizer, model.config.vocab_size, text)
    param = next(model.parameters())
    with torch.no_grad():
        _, states = target_forward(model, ids[None].to(param.device), DynamicCache(config=model.config), layers)
    width = states.shape[-1] // len(layers)
    by_layer = {i: states[:, k * width:(k + 1) * width].float().cpu() for k, i in enumerate(layers)}
    ref = trace(ref_head, by_layer, ids)
    runs = [compare(name, ref, trace(head, by_layer, ids), export_dtype) for name, head in loaded.items()]
    return runs + refused, ids.numel(), ref_name


def gguf_head(path: Path, model: nn.Module) -> nn.Module:
    """An eaglet head holding what llama.cpp reads of `path` (metadata and tensors, via gguf-py), with the target's
    embedding as llama.cpp gives its draft."""
    from pipeline.export.formats.gguf import read_gguf_head

    config, state = read_gguf_head(path)
    head = build_draft_head(config)
    missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                for k, v in state.items()}, strict=False)
    if set(missing) - {"embed_tokens.weight"} or unexpected:
        raise ExportError(f"{path}: missing {sorted(set(missing) - {'embed_tokens.weight'})}, unexpected "
                          f"{sorted(unexpected)}")
    head.copy_from_target(model)
    return head.to(device="cpu", dtype=torch.float32).eval()


def _sample_findings(runs: Sequence[LoaderRun], reference: str) -> list[Finding]:
    """A divergence is a problem, except where another reading of the same loader (the other SGLang numbering
    rule) follows the training forward: then it is that rule's trade-off, a warning (as the static check says)."""
    readings = [r for r in runs if r.name.startswith("load_export") and not r.refused]
    out = []
    for r in runs:
        if not r.first_divergence:
            continue
        alone = r in readings and any(not other.first_divergence for other in readings)
        out.append(Finding(WARNING if alone else PROBLEM, "sample", r.first_divergence,
                           f"{r.name} diverges from {reference} at {r.first_divergence}{_divergence_detail(r)}"))
    return out


def _divergence_detail(run: LoaderRun) -> str:
    if run.first_divergence == "top-1" and run.top1:
        return f" (only {run.top1[0]} of {run.top1[1]} top-1 draft tokens agree)"
    stage = next((s for s in run.stages if s.stage == run.first_divergence), None)
    if stage is None:
        return ""
    return (f" (relative difference {stage.rel_diff:.3g} > {run.tolerance:g}, norm ratio {stage.norm_ratio:.3g}); "
            f"what feeds it is the first suspect")


def _run_table(runs: Sequence[LoaderRun]) -> list[str]:
    """One row per stage, one column per loader: norm ratio (relative difference)."""
    stages = []
    for r in runs:
        stages += [s.stage for s in r.stages if s.stage not in stages]
    rows = [["stage", *(r.name for r in runs)]]
    cells = {r.name: {s.stage: (f"{s.norm_ratio:.3f} ({s.rel_diff:.1e})" if math.isfinite(s.rel_diff) else "shape")
                      for s in r.stages} for r in runs}
    for stage in stages:
        rows.append([stage, *(cells[r.name].get(stage, "-") for r in runs)])
    rows.append(["top-1 agreeing", *(f"{r.top1[0]}/{r.top1[1]}" if r.top1 else "-" for r in runs)])
    rows.append(["first divergence", *("refused" if r.refused else r.first_divergence or "none" for r in runs)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return lines + [f"  {r.name} refused the export: {r.refused}" for r in runs if r.refused]
