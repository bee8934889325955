"""`gguf`: the EAGLE-3 head as a GGUF that llama.cpp's server drafts with (`--spec-type draft-eagle3`) beside the
target's own GGUF.

The folder holds the SGLang-dialect export (config.json + model.safetensors: what llama.cpp's converter reads, and
what eaglet loads back and verifies) and `draft.gguf`, written by the converter of the llama.cpp that eaglet builds
(`make llama-server`: the llama.cpp vendored by the pinned llama-cpp-python, one llama.cpp version in the project),
called, not copied. What the converter is told, and why:
  - the target's folder (`--target-model-dir`): its tokenizer and vocabulary size go into the draft;
  - the aux layers, always, as `eagle_aux_hidden_state_layer_ids` at the top of its input config: without them it
    takes [2, L//2, L-3], and it ignores SGLang's `eagle_config` (whose numbering differs). llama.cpp numbers them
    as eaglet does: id i is the input of layer i (`extract_layer_inputs` stores each layer's input).
Then the GGUF is read back with gguf-py and held to the head: architecture, the target layers and hidden size, the
layer's dimensions, rope theta, context length, vocabulary sizes, every tensor's name and shape, and every value
(q/k rows in llama.cpp's rope order), d2t exactly (as target ids: llama.cpp stores
draft id + d2t[draft id]). llama.cpp drafts a chain (top-1 at each step, up to
`--spec-draft-n-max` tokens, stopping early below `--spec-draft-p-min`), not a tree: the command below sets the
chain's length to the tree's depth.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

from pipeline.files import default_cache_root
from pipeline.heads.config import DraftHeadConfig

from .base import DTYPE_NAMES, ExportContext, ExportError, register_format
from .sglang import SGLangEagle3

GGUF_FILE = "draft.gguf"
CONVERTER = "convert_hf_to_gguf.py"
OUTTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}

# eaglet's SGLang-dialect name -> the GGUF name the converter gives it (LLM_ARCH_EAGLE3's tensors).
GGUF_NAMES = {
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "d2t": "d2t",
    # t2d is not stored: llama.cpp maps draft ids with d2t alone.
}


def llama_cpp_source() -> Path:
    """The llama.cpp tree eaglet builds its server from ($EAGLET_LLAMA_CPP_SRC, else the one `make llama-server`
    unpacks into eaglet's cache)."""
    if env := os.environ.get("EAGLET_LLAMA_CPP_SRC"):
        return Path(env)
    found = sorted(glob.glob(str(default_cache_root() / "llama.cpp" / "src" / "llama_cpp_python-*" / "vendor"
                                 / "llama.cpp")))
    if not found:
        raise ExportError(f"export.format=gguf needs llama.cpp's converter: none under {default_cache_root()}/"
                          f"llama.cpp/src; run `make llama-server` (or set EAGLET_LLAMA_CPP_SRC)")
    return Path(found[-1])


def _rope_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows as llama.cpp keeps them: within each head, HF's two rotary halves interleaved pairwise
    ([h, 2, d/2] -> [h, d/2, 2]), the layout its rope kernel reads."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _hf_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_rope_order`: llama.cpp's q/k rows back in HF's rotate-half layout."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _as_torch(tensor) -> torch.Tensor:
    """A gguf-py tensor's data as torch, in the GGUF's own type (bf16 is stored as raw 16-bit words)."""
    import numpy as np

    data = np.array(tensor.data)
    if tensor.tensor_type.name == "BF16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy())


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def gguf_problems(path: Path, c: DraftHeadConfig, state: dict[str, torch.Tensor]) -> list[str]:
    """What in the GGUF at `path` differs from the head `c` whose SGLang-dialect tensors are `state`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "eagle3":
        return [f"general.architecture {arch!r}, expected 'eagle3' (llama.cpp would not load it as an EAGLE-3 "
                f"draft)"]
    expect = {"target_layers": sorted(c.aux_layer_ids), "target_hidden_size": c.target_hidden_size,
              "block_count": 1, "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
              "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
              "attention.key_length": c.head_dim, "context_length": c.max_position_embeddings,
              "vocab_size": c.vocab_size, "rope.freq_base": float(c.rope_theta)}
    problems = []
    # The converter copies these RedHat/NVIDIA variants from the config; llama.cpp's draft then normalizes the
    # residual or the fused features, which eaglet's head does not.
    problems += [f"eagle3.{key} = true, expected false (llama.cpp would apply a norm the head was not trained with)"
                 for key in ("norm_before_residual", "norm_before_fc") if _field(reader, f"eagle3.{key}")]
    for key, want in expect.items():
        got = _field(reader, f"eagle3.{key}")
        if isinstance(want, float) and got is not None:
            got = float(got)
        if got != want:
            problems.append(f"eagle3.{key} = {got}, expected {want}")
    tensors = {t.name: t for t in reader.tensors}
    expected = {GGUF_NAMES[n]: n for n in state if n in GGUF_NAMES}
    problems += [f"missing tensor {g} (from {n})" for g, n in expected.items() if g not in tensors]
    problems += [f"unexpected tensor {g}" for g in tensors if g not in expected]
    for g, n in expected.items():
        if g not in tensors:
            continue
        got = _as_torch(tensors[g])
        want = state[n]
        if n.endswith("q_proj.weight"):
            want = _rope_order(want, c.num_attention_heads)
        elif n.endswith("k_proj.weight"):
            want = _rope_order(want, c.num_key_value_heads)
        elif n == "d2t":  # llama.cpp keeps each draft id's target id, not eaglet's offset
            want = want + torch.arange(want.numel(), dtype=want.dtype)
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{g}: shape {list(got.shape)}, expected {list(want.shape)} (from {n})")
        elif not torch.equal(got.to(torch.float64) if got.is_floating_point() else got,
                             want.to(torch.float64) if want.is_floating_point() else want):
            problems.append(f"{g}: values differ from {n}")
    return problems


def read_gguf_head(path: Path) -> tuple[DraftHeadConfig, dict[str, torch.Tensor]]:
    """What llama.cpp reads of a draft GGUF, as an eaglet head: the DraftHeadConfig of its `eagle3.*` metadata and
    its tensors under the sglang dialect's names (the inverse of the conversion `gguf_problems` checks: q/k rows
    back in HF's order, d2t back from target ids to offsets, t2d rebuilt from d2t, which llama.cpp does not
    store)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "eagle3":
        raise ExportError(f"{path}: general.architecture {arch!r}, not an EAGLE-3 draft")

    def meta(key: str):
        value = _field(reader, f"eagle3.{key}")
        if value is None:
            raise ExportError(f"{path}: no eagle3.{key}")
        return value

    names = {g: n for n, g in GGUF_NAMES.items()}
    state = {names[t.name]: _as_torch(t) for t in reader.tensors if t.name in names}
    heads, kv = int(meta("attention.head_count")), int(meta("attention.head_count_kv"))
    for name, count in (("midlayer.self_attn.q_proj.weight", heads), ("midlayer.self_attn.k_proj.weight", kv)):
        if name in state:
            state[name] = _hf_order(state[name], count)
    vocab = int(meta("vocab_size"))
    if "d2t" in state:
        target_ids = state["d2t"].long()
        state["d2t"] = target_ids - torch.arange(target_ids.numel())
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        state["t2d"][target_ids.clamp(0, vocab - 1)] = True
    draft_vocab = state["lm_head.weight"].shape[0] if "lm_head.weight" in state else vocab
    config = DraftHeadConfig(
        kind="eagle3", hidden_size=int(meta("embedding_length")), intermediate_size=int(meta("feed_forward_length")),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=int(meta("attention.key_length")),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")), rope_theta=float(meta("rope.freq_base")),
        max_position_embeddings=int(meta("context_length")), vocab_size=vocab, draft_vocab_size=draft_vocab,
        target_hidden_size=int(meta("target_hidden_size")), aux_layer_ids=[int(i) for i in meta("target_layers")])
    return config, state


class GgufEagle3(SGLangEagle3):
    name = "gguf"
    default = False
    extra_files = (GGUF_FILE,)

    def detects(self, cfg: dict) -> bool:
        return False  # its config.json is the sglang format's: loaded back as that

    def finish(self, out_dir: Path, c: DraftHeadConfig, dtype: torch.dtype, ctx: ExportContext) -> None:
        if c.fc_norm or c.norm_output:
            raise ExportError("export.format=gguf: llama.cpp's EAGLE-3 draft has no EAGLE-3.1 norms (fc_norm, "
                              "norm_output); export this head as sglang or vllm")
        if not ctx.target_dir or not (Path(ctx.target_dir) / "config.json").is_file():
            raise ExportError(f"export.format=gguf needs the target's local folder (config.json, tokenizer) for "
                              f"llama.cpp's converter; got {ctx.target_dir!r}")
        if importlib.util.find_spec("sentencepiece") is None:
            raise ExportError("export.format=gguf: llama.cpp's converter imports sentencepiece; pip install "
                              "-c constraints.txt sentencepiece (make install does)")
        from safetensors.torch import load_file

        converter = llama_cpp_source() / CONVERTER
        work = out_dir / ".convert"  # the converter's input: the SGLang dialect plus the layer ids it reads
        work.mkdir()
        try:
            cfg = json.loads((out_dir / "config.json").read_text())
            cfg.pop("eagle_config", None)
            cfg["eagle_aux_hidden_state_layer_ids"] = sorted(c.aux_layer_ids)  # llama.cpp = eaglet numbering
            (work / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            os.link(out_dir / "model.safetensors", work / "model.safetensors")
            cmd = [sys.executable, str(converter), str(work), "--target-model-dir", str(ctx.target_dir),
                   "--outfile", str(out_dir / GGUF_FILE), "--outtype", OUTTYPES[dtype]]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
                raise ExportError(f"llama.cpp's converter ({converter}) failed with exit code {done.returncode}:\n"
                                  f"{tail}")
        finally:
            for p in work.iterdir():
                p.unlink()
            work.rmdir()
        state = load_file(str(out_dir / "model.safetensors"))
        if problems := gguf_problems(out_dir / GGUF_FILE, c, state):
            raise ExportError(f"{out_dir / GGUF_FILE} ({DTYPE_NAMES[dtype]}) differs from the head:\n  "
                              + "\n  ".join(problems))

    def serve_commands(self, path: str, layer_ids: Sequence[int], ctx: ExportContext) -> list[str]:
        import shlex

        target = shlex.quote(ctx.target_gguf) if ctx.target_gguf else "<the target's GGUF>"
        draft = shlex.quote(str(Path(path) / GGUF_FILE))
        return [f"serve with llama.cpp: llama-server -m {target} -md {draft} --spec-type draft-eagle3 "
                f"--spec-draft-n-max {ctx.tree.depth} (a chain of up to {ctx.tree.depth} drafted tokens)",
                *super().serve_commands(path, layer_ids, ctx)]


register_format(GgufEagle3())
