"""Write a trained head in a serving format, check a written export tensor by tensor, and load any export back
into an eaglet head (so eaglet's own decoder can verify what SGLang/vLLM will load)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from pipeline.decoding.tree import DEFAULT_TREE, TreeSpec
from pipeline.files import atomic_dir
from pipeline.heads import build_draft_head, head_spec
from pipeline.heads.io import check_finite
from pipeline.manifest import MANIFEST, ExportManifest, check_files, check_target, load_manifest
from pipeline.target import Target

from .formats import ExportContext, ExportError, ExportFormat, detect_format, format_for_head
from .formats.base import DTYPE_NAMES, INDEX_DTYPES, SAFETENSORS_DTYPES, aux_order, check_aux_layers

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: BF16, F32, I64, BOOL


# ---------------------------------------------------------------------------------------------------------
# export


def export_head(
    head: nn.Module,
    out_dir: Path,
    fmt: Optional[str],
    dtype: torch.dtype = torch.bfloat16,
    *,
    num_target_layers: int,
    verifier: Optional[str] = None,
    verifier_architectures: Sequence[str] = (),
    speculative_tokens: int = 3,
    sglang_aux_convention: str = "output",
    tree: TreeSpec = DEFAULT_TREE,
    target_dir: Optional[str] = None,
    target_gguf: Optional[str] = None,
) -> Path:
    """Writes `out_dir/{config.json, model.safetensors}` in format `fmt` (None: the head kind's default),
    replacing a previous export there, and checks the result with `check_export` before it becomes visible.
    `verifier` (vllm format) is the target's hub id or path as the serving machine will see it."""
    config = head.config
    form = format_for_head(fmt, config.kind)
    if dtype not in DTYPE_NAMES:
        raise ExportError(f"dtype {dtype}: export bfloat16 or float32")
    ctx = ExportContext(num_target_layers, verifier, tuple(verifier_architectures), speculative_tokens,
                        str(sglang_aux_convention), tree, target_dir, target_gguf)
    state = export_state(head, form, dtype)
    if head_spec(config.kind).fuses_target_layers:
        check_aux_layers(config.aux_layer_ids, num_target_layers)
        config = dataclasses.replace(config, aux_layer_ids=sorted(config.aux_layer_ids))
    return _write_atomically(Path(out_dir), form.write_config(config, dtype, ctx), state,
                             lambda tmp: form.finish(tmp, config, dtype, ctx))


def model_architectures(model: nn.Module) -> list[str]:
    """The verifier's architectures for the vllm config; GGUF-converted configs carry none, so the class that
    loads it names itself (`TargetParts.hf_class_name` where only the target's parts were read)."""
    return list(getattr(model.config, "architectures", None) or [getattr(model, "hf_class_name", type(model).__name__)])


def export_state(head: nn.Module, form: ExportFormat, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors under the format's names; floating tensors in `dtype`, the vocabulary maps as they
    are (int64 d2t, bool t2d). The fc column blocks of a head fusing target layers (and EAGLE-3.1's per-state
    norms) are put in ascending layer order."""
    state = {}
    for name, tensor in head.state_dict().items():
        out_name = form.to_format(name)
        if out_name is None:
            continue
        tensor = tensor.detach().to("cpu")
        if name == "fc.weight" and head.config.aux_layer_ids:
            tensor = _fc_in_layer_order(tensor, head.config.aux_layer_ids)
        if name.startswith("fc_norm."):  # EAGLE-3.1: norm k goes with fused state k, wherever its block moves
            k = int(name.split(".")[1])
            out_name = form.to_format(f"fc_norm.{aux_order(head.config.aux_layer_ids).index(k)}.weight")
        state[out_name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    return state


def _fc_in_layer_order(weight: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    order = aux_order(layer_ids)
    if order == list(range(len(layer_ids))):
        return weight
    h, n = weight.shape[0], len(layer_ids)
    return weight.view(h, n, -1)[:, order].reshape(h, -1)  # [H, n, Ht] -> blocks reordered -> [H, n*Ht]


def _write_atomically(out_dir: Path, doc: dict, state: dict[str, torch.Tensor], finish) -> Path:
    from safetensors.torch import save_file

    # A killed export's temporary goes first, a failed one's (a full disk) at once; a wrong export never
    # replaces a good one.
    with atomic_dir(out_dir) as tmp:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
        check_export(tmp)
        finish(tmp)  # the format's own files (a GGUF), made from and checked against the two above
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# check


def check_export_files(export_dir: Path) -> None:
    """An export eaglet wrote carries its files' digests in its manifest: refuse it if they changed since. A
    bare export (config.json + weights copied elsewhere) is checked by `check_export` only."""
    path = Path(export_dir) / MANIFEST
    if path.is_file():
        recorded = load_manifest(export_dir, expect_stage="export").get("files")
        if recorded:
            check_files(export_dir, recorded, "export", "rerun the export stage to rewrite it")


def read_config(export_dir: Path) -> dict:
    path = Path(export_dir) / CONFIG
    if not path.is_file():
        raise ExportError(f"{path}: missing")
    return json.loads(path.read_text())


def tensor_infos(export_dir: Path) -> list[TensorInfo]:
    """Names, shapes and dtypes from the safetensors header (no tensor data read)."""
    from safetensors import safe_open

    path = Path(export_dir) / WEIGHTS
    if not path.is_file():
        raise ExportError(f"{path}: missing")
    with safe_open(str(path), framework="pt") as f:
        slices = {name: f.get_slice(name) for name in f.keys()}
        return [TensorInfo(name, tuple(s.get_shape()), s.get_dtype()) for name, s in sorted(slices.items())]


def check_export(export_dir: Path) -> list[TensorInfo]:
    """Checks an export against its format: config fields the loaders read; exactly the format's tensor names
    (any extra or missing tensor fails), their shapes from the config, one floating dtype matching
    `torch_dtype`, and a consistent draft vocabulary. Returns the tensors (sorted by name)."""
    form, infos, problems = export_problems(export_dir)
    if problems:
        raise ExportError(f"{export_dir} ({form.name} format):\n  " + "\n  ".join(text for _, text in problems))
    return infos


def export_problems(export_dir: Path) -> tuple[ExportFormat, list[TensorInfo], list[tuple[str, str]]]:
    """`check_export`'s findings without raising: (the format, the tensors, [(file, problem)]), the file being
    config.json or model.safetensors (the doctor names it on each line). A config the format refuses is not
    read further (its tensor shapes would be guesses)."""
    cfg = read_config(export_dir)
    form = detect_format(cfg)
    infos = tensor_infos(export_dir)
    found = {t.name: t for t in infos}
    problems = [(CONFIG, p) for p in form.config_problems(cfg)]
    if not problems:
        # Tensor shapes do not depend on which target layers are fused: any valid layer count will do here.
        expected = form.expected_tensors(form.read_config(cfg, num_target_layers=64, fc_bias="fc.bias" in found))
        tensors = [f"missing tensor {n} {list(s)}" for n, s in expected.items() if n not in found]
        tensors += [f"unexpected tensor {n} {list(found[n].shape)}" for n in found if n not in expected]
        tensors += [f"{n}: shape {list(found[n].shape)}, expected {list(s)}"
                    for n, s in expected.items() if n in found and found[n].shape != s]
        tensors += _dtype_problems(infos, form.layer_fields(cfg).get("torch_dtype") or cfg.get("torch_dtype"))
        if not tensors and "d2t" in found:
            tensors += _vocab_problems(export_dir, cfg["draft_vocab_size"])
        problems += [(WEIGHTS, p) for p in tensors]
    return form, infos, problems


def _dtype_problems(infos: list[TensorInfo], torch_dtype: Optional[str]) -> list[str]:
    want = SAFETENSORS_DTYPES.get(torch_dtype or "")
    if want is None:
        return [f"torch_dtype {torch_dtype!r}: expected bfloat16 or float32"]
    return [f"{t.name}: dtype {t.dtype}, expected {INDEX_DTYPES.get(t.name, want)}"
            for t in infos if t.dtype != INDEX_DTYPES.get(t.name, want)]


def _vocab_problems(export_dir: Path, draft_vocab_size: int) -> list[str]:
    """d2t must send the draft ids to distinct target ids, exactly the ones t2d marks (target id = draft id +
    d2t[draft id]); each rule broken is one line."""
    from safetensors import safe_open

    with safe_open(str(Path(export_dir) / WEIGHTS), framework="pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    target_ids = torch.arange(draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= t2d.numel():
        return [f"d2t maps draft ids outside the target vocabulary (target ids {int(target_ids.min())}.."
                f"{int(target_ids.max())}, vocab_size {t2d.numel()})"]
    problems = []
    if (marked := int(t2d.sum())) != draft_vocab_size:
        problems.append(f"t2d marks {marked} target ids, draft_vocab_size is {draft_vocab_size}")
    if (distinct := target_ids.unique().numel()) != draft_vocab_size:
        problems.append(f"d2t sends the {draft_vocab_size} draft ids to only {distinct} distinct target ids")
    if (off := int((~t2d[target_ids]).sum())):
        problems.append(f"d2t and t2d disagree (t2d must mark exactly the draft vocabulary's target ids): {off} of "
                        f"{draft_vocab_size} draft ids land on target ids t2d does not mark")
    return problems


def tensor_table(infos: Sequence[TensorInfo]) -> str:
    rows = [("tensor", "shape", "dtype")] + [(t.name, "x".join(map(str, t.shape)), t.dtype) for t in infos]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# load back


def load_export(export_dir: Path, target, device: Optional[torch.device] = None,
                dtype: Optional[torch.dtype] = None, sglang_aux_convention: str = "output") -> nn.Module:
    """An eaglet head from an export of any format, in eval mode. `target` (a pipeline.target.Target or an HF
    causal LM) provides what the format leaves to the serving framework (`from_target`: the embedding for
    sglang, the lm_head for eagle1). Device/dtype default to the target's, so bf16 weights load into an fp32
    head exactly rounded."""
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    check_export_files(export_dir)
    check_export(export_dir)
    cfg = read_config(export_dir)
    form = detect_format(cfg)
    raw = load_file(str(export_dir / WEIGHTS))
    check_finite(raw, export_dir / WEIGHTS)
    state = {form.from_format(k): v for k, v in raw.items()}
    model = target.model if isinstance(target, Target) else target
    config = form.read_config(cfg, model.config.num_hidden_layers, fc_bias="fc.bias" in state,
                              sglang_convention=str(sglang_aux_convention))
    head = build_draft_head(config)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if set(missing) != set(form.from_target) or unexpected:
        raise ExportError(f"{export_dir}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    with torch.no_grad():
        form.fill_from_target(head, model)
    param = next(model.parameters())
    return head.to(device=device or param.device, dtype=dtype or param.dtype).eval()


def recorded_convention(manifest: Optional[ExportManifest]) -> str:
    """The aux-layer numbering an export's SGLang config was written in (its manifest's export.sglang section)."""
    export = (manifest.config.get("export") or {}) if manifest is not None else {}
    return (export.get("sglang") or {}).get("aux_convention") or "output"


def load_shipped_head(export_dir: Path, target, allow_template_mismatch: bool = False
                      ) -> tuple[nn.Module, ExportManifest]:
    """The head of an export folder as shipped (a committed head, a downloaded one: no training folder), held to
    its manifest first: its files as recorded, made for this target (fingerprint, as a train manifest is held;
    `allow_template_mismatch`: but for the chat template)."""
    export_dir = Path(export_dir)
    manifest = ExportManifest.load(export_dir)
    check_files(export_dir, manifest.files, "exported head", "copy the export's files and its manifest.json again")
    check_target(target.fingerprint, manifest, export_dir / MANIFEST, what="exported head's target",
                 allow_template_mismatch=allow_template_mismatch)
    return load_export(export_dir, target, sglang_aux_convention=recorded_convention(manifest)), manifest


@torch.no_grad()
def max_logit_diff(head_a: nn.Module, head_b: nn.Module, tokens: int = 16, seed: int = 0) -> float:
    """max |logits_a - logits_b| over one random sequence, each head fed the same target states in its own
    aux-layer order (an export may reorder them)."""
    gen = torch.Generator().manual_seed(seed)
    c = head_a.config
    layers = list(c.aux_layer_ids) or [-1]
    states = {i: torch.randn(1, tokens, c.target_hidden_size, generator=gen) for i in layers}
    ids = torch.randint(0, c.vocab_size, (1, tokens), generator=gen)
    positions = torch.arange(tokens)[None]

    def run(head: nn.Module) -> torch.Tensor:
        param = next(head.parameters())
        fused = torch.cat([states[i] for i in list(head.config.aux_layer_ids) or [-1]], dim=-1)
        hidden = head.fuse(fused.to(param.device))
        _, logits = head(hidden, ids.to(param.device), positions.to(param.device))
        return logits.float().cpu()

    return float((run(head_a) - run(head_b)).abs().max())
