"""Stage manifests: every stage ends by writing `manifest.json`; the next stage loads its input's
manifest and refuses a mismatch with a message naming both sides."""
from __future__ import annotations

import dataclasses
import enum
import errno
import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar, Iterable, Optional

from pipeline.files import atomic_write_text, sha256_file, stale_tmp_siblings
from pipeline.redact import redact

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
STALE_TMP_S = 600  # a manifest write takes milliseconds: a temporary this old was left by a killed run


class ManifestError(RuntimeError):
    pass


class DiskFull(RuntimeError):
    pass


# What writers that hide errno (safetensors, torch.save, pyarrow) say about a full disk or quota.
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def disk_full(e: BaseException) -> Optional[BaseException]:
    """The exception in `e`'s chain that reports a full disk (ENOSPC, EDQUOT), else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if any(text in str(e) for text in _DISK_FULL_TEXT):
            return e
        e = e.__cause__ or e.__context__
    return None


def code_version() -> str:
    """git describe of the eaglet checkout (with -dirty), or the package version when not in git."""
    here = Path(__file__).resolve().parent
    try:
        # --no-optional-locks: `--dirty` refreshes the index, which takes .git/index.lock; a stage killed at
        # that moment (the fault campaign did it) would leave the lock behind and break the user's git.
        out = subprocess.run(["git", "--no-optional-locks", "describe", "--always", "--dirty", "--abbrev=12"], cwd=here,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"eaglet-{version('eaglet')}"
    except PackageNotFoundError:
        return "unknown"


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, enum.Enum):  # config choices: recorded as their plain value, as before they were enums
        return obj.value
    return obj


def file_problem(path: Path, size: Optional[int], sha256: Optional[str]) -> Optional[str]:
    """What is wrong with a file against its recorded size and sha256 (None: not checked): missing,
    truncated/extended, or corrupt. None when it matches."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    if size is not None and path.stat().st_size != size:
        return f"{path.stat().st_size} bytes, recorded {size} (truncated?)"
    if sha256 is not None and (sha := sha256_file(path)) != sha256:
        return f"sha256 {sha[:16]}... but recorded {sha256[:16]}... (corrupt)"
    return None


def file_digests(directory: Path, names: Optional[Iterable[str]] = None) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of `names` in `directory`, or of every file below it (relative paths);
    what `check_files` holds a directory to when it is loaded again."""
    directory = Path(directory)
    if names is None:
        names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    return {n: {"bytes": (directory / n).stat().st_size, "sha256": sha256_file(directory / n)} for n in names}


def check_files(directory: Path, recorded: dict, what: str, repair: str) -> None:
    """Refuses a directory whose files differ from `file_digests` as recorded, naming every bad file."""
    problems = [f"{name}: {p}" for name, rec in sorted(recorded.items())
                if (p := file_problem(Path(directory) / name, rec["bytes"], rec["sha256"]))]
    if problems:
        raise ManifestError(f"{what} {directory}: " + "; ".join(problems) + f"; {repair}")


def peak_rss_mb() -> Optional[float]:
    """This process's peak resident memory so far in MiB (Linux's VmHWM: since the program's exec, so a fork's
    inherited peak does not count), recorded in every manifest's timings; None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kib / 1024, 1)


def write_manifest(out_dir: Path, stage: str, config: Any, counts: dict, timings: dict,
                   inputs: Iterable[Path] = (), **extra: Any) -> Path:
    """Atomically writes out_dir/manifest.json. `inputs` are the input stage directories whose manifests
    this stage consumed; their digests pin exactly which version was read. Secrets (a base URL's password or
    key, a secret-named setting) are redacted from everything it records (pipeline/redact.py)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = redact({
        "schema_version": SCHEMA_VERSION,
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "code_version": code_version(),
        "config": to_plain(config),
        "inputs": [{"path": str(p), "manifest_sha256": sha256_file(Path(p) / MANIFEST)} for p in inputs],
        "counts": to_plain(counts),
        "timings": to_plain({**timings, "peak_rss_mb": peak_rss_mb()}),
        **to_plain(extra),
    })
    if stage in MANIFESTS and (unknown := sorted(set(doc) - MANIFESTS[stage].fields())):
        raise TypeError(f"{stage} manifest: {unknown} are not fields of {MANIFESTS[stage].__name__} "
                        f"(pipeline/manifest.py): declare them there")
    path = out_dir / MANIFEST
    # A run killed inside this write left its temporary (named by its pid). Ranks of one job may write the
    # manifest at nearly the same moment (the dump's last rank), so only a temporary older than any write
    # takes is removed.
    for stale in stale_tmp_siblings(path):
        try:
            if time.time() - stale.stat().st_mtime > STALE_TMP_S:
                stale.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
    atomic_write_text(path, json.dumps(doc, indent=2, sort_keys=False, ensure_ascii=False) + "\n")
    return path


def load_manifest(stage_dir: Path, expect_stage: Optional[str] = None) -> dict:
    path = Path(stage_dir) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{path}: no manifest; run the {expect_stage or 'previous'} stage first "
                            f"(a stage writes its manifest only when it completes)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from e
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ManifestError(f"{path}: schema_version {doc.get('schema_version')} but this eaglet reads "
                            f"{SCHEMA_VERSION}; rerun that stage with this version")
    if expect_stage and doc.get("stage") != expect_stage:
        raise ManifestError(f"{path}: written by stage {doc.get('stage')!r}, expected {expect_stage!r}")
    return doc


# ---------------------------------------------------------------------------------------------
# Typed manifests: one dataclass per stage, the contract between a stage and the next. Written through
# `write_manifest` (which refuses a field its stage's class does not declare), read with `<Stage>Manifest.load`:
# a manifest of an older eaglet lacks later fields and reads as their defaults; a field this eaglet does not
# know (a newer writer's) is kept in `extra`.


@dataclasses.dataclass
class StageManifest:
    STAGE: ClassVar[str] = ""
    schema_version: int = SCHEMA_VERSION
    stage: str = ""
    created: str = ""
    code_version: str = ""
    config: dict = dataclasses.field(default_factory=dict)
    inputs: list = dataclasses.field(default_factory=list)  # [{"path", "manifest_sha256"}] of consumed stages
    counts: dict = dataclasses.field(default_factory=dict)
    timings: dict = dataclasses.field(default_factory=dict)
    target: dict = dataclasses.field(default_factory=dict)  # the target's fingerprint (check_target)
    extra: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def fields(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    @classmethod
    def from_dict(cls, doc: dict) -> "StageManifest":
        known = cls.fields()
        return cls(**{k: v for k, v in doc.items() if k in known},
                   extra={k: v for k, v in doc.items() if k not in known})

    @classmethod
    def load(cls, stage_dir: Path) -> "StageManifest":
        return cls.from_dict(load_manifest(stage_dir, expect_stage=cls.STAGE))


@dataclasses.dataclass
class RegenManifest(StageManifest):
    STAGE: ClassVar[str] = "regen"
    generation: dict = dataclasses.field(default_factory=dict)  # backend, sampling, thinking, precision
    format: str = "sharegpt"
    plan: dict = dataclasses.field(default_factory=dict)  # digest, batches, shards, conversations
    complete: bool = True  # False: regen.finalize_partial wrote it with shards missing
    shards_missing: int = 0
    shards: list = dataclasses.field(default_factory=list)  # [{"path", "conversations", "sha256", "rank"}]
    errors: list = dataclasses.field(default_factory=list)
    bad_records: dict = dataclasses.field(default_factory=dict)

    @property
    def thinking(self) -> Optional[str]:
        return self.generation.get("thinking")


@dataclasses.dataclass
class DumpManifest(StageManifest):
    STAGE: ClassVar[str] = "dump"
    format: dict = dataclasses.field(default_factory=dict)  # {"name", "version"} of the shard format
    precision: Optional[str] = None  # the target's compute dtype (`dtype` is the storage)
    tokenizer_digest: Optional[str] = None
    layers: dict = dataclasses.field(default_factory=dict)  # ids, convention, final, num_target_layers
    hidden_size: int = 0
    dtype: str = "bfloat16"
    plan: dict = dataclasses.field(default_factory=dict)
    shards: list = dataclasses.field(default_factory=list)  # [{"file", "rows", "tokens", "bytes", "sha256"}]
    totals: dict = dataclasses.field(default_factory=dict)
    bad_records: dict = dataclasses.field(default_factory=dict)
    thinking: Optional[str] = None
    tensor_parallel: int = 1  # ranks per target copy that wrote it


@dataclasses.dataclass
class TrainManifest(StageManifest):
    STAGE: ClassVar[str] = "train"
    source: str = "dump"
    precision: Optional[str] = None
    head_config: dict = dataclasses.field(default_factory=dict)
    thinking: Optional[str] = None
    final_metrics: dict = dataclasses.field(default_factory=dict)
    head_files: Optional[dict] = None  # None: a head trained before the digests were recorded (loads unchecked)
    selected: Optional[dict] = None  # train.select=tau: the step and tau of the head final/ holds
    # train.on_schedule_change=apply: [{step, from, to}] each resume that changed the lr schedule (from: null for
    # a checkpoint that did not record its own)
    schedule_changes: list = dataclasses.field(default_factory=list)
    machine: Optional[str] = None  # the device it trained on (pipeline.precision.machine_description)
    # [{step, carry, carry_sha256}] each carry (pipeline/train/carry.py) the run continued from on another machine:
    # bf16 weights and fresh optimizer moments there, so not the uninterrupted run
    carries: list = dataclasses.field(default_factory=list)


def rebuilt_from(train_manifest: dict) -> Optional[dict]:
    """The complete carry a train run's head was rebuilt from on a fresh machine, where it trained no step itself (the
    manifest's last `carries` entry, complete and at the run's last step), else None."""
    last = (train_manifest.get("carries") or [{}])[-1]
    return last if last.get("complete") and last.get("step") == train_manifest["counts"]["steps"] else None


@dataclasses.dataclass
class EvalManifest(StageManifest):
    STAGE: ClassVar[str] = "eval"
    precision: Optional[str] = None
    tau: Optional[float] = None
    speedup: Optional[float] = None


@dataclasses.dataclass
class ExportManifest(StageManifest):
    STAGE: ClassVar[str] = "export"
    format: Optional[str] = None
    head_config: dict = dataclasses.field(default_factory=dict)
    files: dict = dataclasses.field(default_factory=dict)
    serve_commands: list = dataclasses.field(default_factory=list)  # the export folder as EXPORT_DIR


MANIFESTS: dict[str, type[StageManifest]] = {
    m.STAGE: m for m in (RegenManifest, DumpManifest, TrainManifest, EvalManifest, ExportManifest)}


def check_equal(what: str, ours: Any, theirs: Any, ours_label: str, theirs_label: str) -> None:
    """Refuses a mismatch with a message that names both sides."""
    if ours != theirs:
        raise ManifestError(
            f"{what} mismatch:\n  {ours_label}: {json.dumps(to_plain(ours), sort_keys=True)}\n"
            f"  {theirs_label}: {json.dumps(to_plain(theirs), sort_keys=True)}")


FINGERPRINT_KEYS = ("config_digest", "tokenizer_digest", "weights_digest")


def check_target(fingerprint: dict, manifest: StageManifest, manifest_path: Path, what: str = "target",
                 allow_template_mismatch: bool = False) -> None:
    """The input (its typed manifest) was made with the same target (architecture, tokenizer + chat template,
    weights)."""
    check_fingerprint(fingerprint, manifest.target, manifest_path, what, allow_template_mismatch)


def check_fingerprint(fingerprint: dict, theirs: dict, manifest_path: Path, what: str = "target",
                      allow_template_mismatch: bool = False) -> None:
    """`fingerprint` (the current target's) against `theirs` (a manifest's record of its target).
    `allow_template_mismatch`: the chat template may differ (the template experiment, docs/results/analyses.md); the
    vocabulary and special tokens must not (`vocab_digest`), and the difference is logged."""
    theirs = theirs or {}
    keys = FINGERPRINT_KEYS
    if "weights_digest" in theirs and theirs["weights_digest"] is None:
        # Made through a server (regen's openai backend): its weights are unknown to eaglet, so only the
        # architecture and the tokenizer + chat template can be held to account.
        keys = tuple(k for k in FINGERPRINT_KEYS if k != "weights_digest")
    elif fingerprint.get("weights_digest_names") == "stored" and "weights_digest_names" not in theirs:
        # Made before the digest was read from the files, of a checkpoint that transformers renames at load
        # (pipeline.target.stored_names): the two digests hash other names, so they cannot be compared.
        log.warning("%s: %s was made before eaglet digested the weights from the stored files (this checkpoint's "
                    "tensors are renamed at load); its weights digest is not compared", what, manifest_path)
        keys = tuple(k for k in FINGERPRINT_KEYS if k != "weights_digest")
    if allow_template_mismatch and fingerprint.get("tokenizer_digest") != theirs.get("tokenizer_digest"):
        if "vocab_digest" not in theirs:
            raise ManifestError(f"{manifest_path}: made before eaglet recorded the vocabulary apart from the chat "
                                f"template (vocab_digest), so a template change cannot be allowed for it")
        log.warning("%s: chat template differs on purpose (allow_template_mismatch): current %s, %s %s", what,
                    fingerprint.get("chat_template") or "the tokenizer's own", manifest_path,
                    theirs.get("chat_template") or "the tokenizer's own")
        keys = tuple("vocab_digest" if k == "tokenizer_digest" else k for k in keys)
    for key in keys:
        check_equal(f"{what} {key.replace('_', ' ')}", fingerprint.get(key), theirs.get(key),
                    f"current target {fingerprint.get('name')} ({fingerprint.get('source')})",
                    f"{manifest_path} (target {theirs.get('name')}, {theirs.get('source')})")
