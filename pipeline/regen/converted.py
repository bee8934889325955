"""What the in-process engines of regen (OpenVINO GenAI, CTranslate2) share: the target as files, and a
conversion of it into the engine's own format made once and cached.

The engines load their own conversion of the target, not the HF model, so the target is described here from its
files (config, generation config, tokenizer, safetensors): its fingerprint is the one `load_target` computes
(the weights digest of the checkpoint the conversion came from), its stop tokens the ones hf generation uses.
A conversion is cached under `<eaglet cache>/engines/<engine>/models/<key>`, the key a digest of the target's
identity (weights, config and tokenizer digests) and of the conversion's settings (engine version, weight
format), so it is made once per target and redone when either changes. It is written under a temporary name
and renamed, under the first-writer lock, so concurrent ranks convert once and never read a partial one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from pipeline.files import replace_dir, tmp_sibling
from pipeline.lock import first_writer_lock
from pipeline.target import TargetConfig, cache_root

log = logging.getLogger(__name__)

DONE = "eaglet_conversion.json"  # written last into a finished conversion: its settings and timing


@dataclass
class TargetFiles:
    location: str  # the HF directory the conversion reads (the dequantized GGUF's cache for a GGUF target)
    source: str
    hf_config: object
    tokenizer: object
    fingerprint: dict
    stop_ids: list[int]
    max_positions: Optional[int]


def target_files(cfg: TargetConfig) -> TargetFiles:
    """The target from its files, without loading its weights into torch."""
    from transformers import AutoConfig, GenerationConfig

    import pipeline.target as t
    from pipeline.data.chat import stop_token_ids

    location, source = t.materialize(cfg)
    tokenizer = t.load_tokenizer(cfg)
    if tokenizer.pad_token_id is None:  # as load_target does, so the tokenizer digest is the same
        tokenizer.pad_token = tokenizer.eos_token
    with t.loading(location):
        directory = t.checkpoint_dir(location, cfg)
        hf_config = AutoConfig.from_pretrained(directory, revision=cfg.revision)
        digest = t.files_weights_digest(directory, hf_config)
        try:
            generation_config = GenerationConfig.from_pretrained(directory)
        except OSError:
            generation_config = None
    if digest is None:
        raise ValueError(f"{location}: no safetensors weights, so no weights digest for the converted model "
                         f"(convert the checkpoint to safetensors, or use regen.backend=hf)")
    fingerprint = t.compute_fingerprint(hf_config, tokenizer, cfg, source, digest[0], digest[1])
    stop_ids = stop_token_ids(tokenizer, SimpleNamespace(config=hf_config, generation_config=generation_config))
    return TargetFiles(directory, source, hf_config, tokenizer, fingerprint, stop_ids,
                       getattr(hf_config, "max_position_embeddings", None))


def conversion_dir(cfg: TargetConfig, engine: str, cache_dir: Optional[str], fingerprint: dict,
                   settings: dict) -> Path:
    """Where the conversion of this target with these settings lives."""
    identity = {k: fingerprint.get(k) for k in ("weights_digest", "config_digest", "tokenizer_digest")}
    key = hashlib.sha256(json.dumps({"target": identity, **settings}, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir else cache_root(cfg) / "engines" / engine / "models"
    return root / f"{cfg.name}-{key}"


def convert_once(out: Path, command: list[str], settings: dict, env: Optional[dict] = None,
                 timeout_s: float = 3600.0) -> float:
    """Runs `command` (with `{out}` standing for its output folder) unless `out` is already converted; returns
    the seconds spent converting now (0.0 when cached). Its output is kept in `out`.log."""
    if (out / DONE).is_file():
        return 0.0
    with first_writer_lock(out):
        if (out / DONE).is_file():  # another rank converted it while this one waited
            return 0.0
        tmp = tmp_sibling(out)
        shutil.rmtree(tmp, ignore_errors=True)
        log_path = out.with_name(out.name + ".log")
        argv = [a.replace("{out}", str(tmp)) for a in command]
        log.info("converting the target: %s", " ".join(argv))
        t0 = time.perf_counter()
        with open(log_path, "wb") as log_file:
            proc = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"conversion failed (exit {proc.returncode}): {' '.join(argv)}\n  "
                               + "\n  ".join(tail) + f"\n(full log: {log_path})")
        (tmp / DONE).write_text(json.dumps({**settings, "command": command, "convert_s": round(elapsed, 2)}))
        replace_dir(tmp, out)  # over a stale, unfinished one (no DONE marker)
        log.info("converted in %.1f s -> %s", elapsed, out)
        return elapsed


def default_threads() -> int:
    from pipeline.regen.llama_server import default_threads as threads

    return threads()
