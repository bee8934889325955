"""Files of the GPU kit: the device tool's limits, wheels repacked from this environment, files split into
parts and joined again with a checksum, and the small readers device.py uses for its results. Standard
library only, so it runs on the device before anything is installed."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

MiB = 1 << 20
# The device tool's limits (its README): what travels per call, what comes back, how long a call may run.
TREE_BYTES = 64 * MiB  # working tree + carried paths, per call
BACK_FILES, BACK_FILE_BYTES, BACK_TOTAL_BYTES, BACK_DEPTH = 8, 16 * MiB, 64 * MiB, 2
BACK_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
# The kit's own split of a 15-minute lease (start-up and transfers aside). Campaign mode gives call 2 the time
# (call 1 only stashes; call 3 sends back what did not fit call 2's return).
CALL_LIMIT_S = {1: 180, 2: 420}
CAMPAIGN_CALL_LIMIT_S = {1: 60, 2: 540, 3: 60}
# Call 0, a stash call: only where the working tree leaves calls 1 and 2 too little room for their GGUF parts
# (committed heads or carries), each carries one more part and copies it into the stash; it runs no phase.
STASH_CALL_LIMIT_S = 10
PARTS_SLACK_BYTES = 64 << 10  # a call's parts index and rounding, kept free under TREE_BYTES


def call_limit_s(call: int, campaign: bool) -> int:
    if call == 0:
        return STASH_CALL_LIMIT_S
    return (CAMPAIGN_CALL_LIMIT_S if campaign else CALL_LIMIT_S)[call]
PART_BYTES = 15 * MiB  # one file back, with room under 16 MiB


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MiB):
            h.update(block)
    return h.hexdigest()


def atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


# -- parts ---------------------------------------------------------------------------------------------------


def split_file(src: Path, out: Path, n_parts: int | None = None, part_bytes: int = PART_BYTES,
               name: str | None = None) -> dict:
    """src -> out/<name>.partK files and out/<name>.index.json (name, bytes, sha256, parts)."""
    name = name or src.name
    size = src.stat().st_size
    if n_parts:
        part_bytes = -(-size // n_parts)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(src, "rb") as f:
        k = 0
        while block := f.read(part_bytes):
            part = out / f"{name}.part{k}"
            part.write_bytes(block)
            parts.append(part.name)
            k += 1
    index = {"name": name, "bytes": size, "sha256": sha256(src), "parts": parts}
    atomic_json(out / f"{name}.index.json", index)
    return index


def join_parts(*dirs: Path) -> Path:
    """Find <name>.index.json and its parts among dirs[:-1], write dirs[-1]/<name>, check size and sha256."""
    *sources, dest = dirs
    indexes = [p for d in sources if d.is_dir() for p in d.glob("*.index.json")]
    if not indexes:
        raise FileNotFoundError(f"no parts index in {[str(d) for d in sources]}")
    index = json.loads(indexes[0].read_text())
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / index["name"]
    if out.is_file() and out.stat().st_size == index["bytes"] and sha256(out) == index["sha256"]:
        return out
    found = {p.name: p for d in sources if d.is_dir() for p in d.glob(f"{index['name']}.part*")}
    missing = [p for p in index["parts"] if p not in found]
    if missing:
        raise FileNotFoundError(f"{index['name']}: parts {missing} missing (every call before the last stashes its "
                                f"part; if the machine went cold between the calls, run all the calls again)")
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "wb") as f:
        for p in index["parts"]:
            f.write(found[p].read_bytes())
    if tmp.stat().st_size != index["bytes"] or sha256(tmp) != index["sha256"]:
        tmp.unlink()
        raise ValueError(f"{index['name']}: the joined parts do not match the index's size and sha256")
    os.replace(tmp, out)
    return out


def stash_parts(src: Path, dst: Path) -> None:
    if not src.is_dir():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        shutil.copy2(p, dst / p.name)


def split_dir(src: Path, out: Path, part_bytes: int = PART_BYTES) -> dict:
    """A folder (an export) as one tar in parts that each fit a file back; join_dir restores it."""
    out.mkdir(parents=True, exist_ok=True)
    tar = out.parent / f".{src.name}.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname=src.name)
    index = split_file(tar, out, part_bytes=part_bytes, name=f"{src.name}.tar")
    tar.unlink()
    return {"parts": len(index["parts"]), "bytes": index["bytes"], "sha256": index["sha256"]}


def join_dir(parts: Path | list[Path], dest: Path) -> Path:
    """The folder `split_dir` cut, from its parts in one folder or several (campaign calls 2 and 3), under dest."""
    tar = join_parts(*(parts if isinstance(parts, list) else [parts]), dest)
    top = extract_tar(tar, dest)
    tar.unlink()
    return dest / top


def extract_tar(tar: Path, dest: Path) -> str:
    """Extract (plain files and folders inside dest only); returns the tar's top folder name."""
    with tarfile.open(tar) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(dest, filter="data")
        else:  # Python before 3.11.4 / 3.12 (Debian 12's 3.11.2): the same refusals, by hand
            for m in t.getmembers():
                if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in Path(m.name).parts:
                    raise ValueError(f"{tar}: refusing to extract {m.name!r}")
            t.extractall(dest)
        return t.getnames()[0].split("/")[0]


def send_parts(parts: Path, out: Path, sent: list[str], results: str) -> list[str]:
    """Copy as many of the parts in `parts` not in `sent` as the files already in `out` leave room for
    (BACK_FILES files, BACK_TOTAL_BYTES in all) into out/<parts' name>/ with their index; nothing when not one
    fits. Returns the part names sent now. `results`: the call's results file, rewritten after this: room is
    kept for it."""
    index = next(parts.glob("*.index.json"))
    names = [n for n in json.loads(index.read_text())["parts"] if n not in sent]
    here = [p for p in out.rglob("*") if p.is_file()] if out.is_dir() else []
    files_left = BACK_FILES - len(here) - (not (out / results).exists()) - 1  # - 1: the index
    bytes_left = BACK_TOTAL_BYTES - sum(p.stat().st_size for p in here) - MiB - index.stat().st_size
    now = []
    for name in names:
        size = (parts / name).stat().st_size
        if files_left < 1 or size > bytes_left:
            break  # in order: a run's parts go back first to last
        now.append(name)
        files_left, bytes_left = files_left - 1, bytes_left - size
    if now:
        dest = out / parts.name
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(index, dest / index.name)
        for name in now:
            shutil.copy2(parts / name, dest / name)
    return now


# -- wheels from the installed environment -------------------------------------------------------------------


def wheel_from_installed(dist_name: str, out: Path) -> Path:
    """Repack an installed pure-Python distribution as a wheel (its files per RECORD, a fresh RECORD), so
    the kit is built from what `make install` verified, offline, without asking a registry."""
    from importlib.metadata import distribution

    dist = distribution(dist_name)
    root = Path(dist.locate_file(""))
    info = next(p for p in dist.files if p.parts[0].endswith(".dist-info"))
    wheel_meta = (root / info.parts[0] / "WHEEL")
    if wheel_meta.is_file() and "Root-Is-Purelib: true" not in wheel_meta.read_text():
        raise ValueError(f"{dist_name} is not pure Python: carry a wheel built for the device instead")
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    whl = out / f"{name}-{dist.version}-py3-none-any.whl"
    out.mkdir(parents=True, exist_ok=True)
    record, dist_info = [], f"{name}-{dist.version}.dist-info"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(dist.files, key=str):
            if f.parts[0].startswith("..") or "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            if f.parts[0].endswith(".dist-info"):
                if f.name in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
                    continue
                arc = f"{dist_info}/{'/'.join(f.parts[1:])}"
            else:
                arc = str(f)
            data = (root / f).read_bytes()
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append((arc, f"sha256={digest}", str(len(data))))
        if not any(a.endswith(f"{dist_info}/WHEEL") for a, *_ in record):
            wheel = "Wheel-Version: 1.0\nGenerator: eaglet-kit\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            z.writestr(f"{dist_info}/WHEEL", wheel)
            record.append((f"{dist_info}/WHEEL", "", ""))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(record + [(f"{dist_info}/RECORD", "", "")])
        z.writestr(f"{dist_info}/RECORD", buf.getvalue())
    return whl


# -- limits ----------------------------------------------------------------------------------------------------


def working_tree_bytes(repo: Path) -> int:
    """What every call sends: tracked and untracked-not-ignored files (the device tool's rule)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True,
                           check=True).stdout.decode().split("\0")
    return sum((repo / n).stat().st_size for n in names if n and (repo / n).is_file())


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def back_violations(out: Path) -> list[str]:
    """What in `out` would not come back from the device."""
    files = [p for p in out.rglob("*") if p.is_file()]
    problems = []
    if len(files) > BACK_FILES:
        problems.append(f"{len(files)} files back, at most {BACK_FILES}: {[str(p.relative_to(out)) for p in files]}")
    total = sum(p.stat().st_size for p in files)
    if total > BACK_TOTAL_BYTES:
        problems.append(f"{total} bytes back, at most {BACK_TOTAL_BYTES}")
    for p in files:
        rel = p.relative_to(out)
        if p.stat().st_size > BACK_FILE_BYTES:
            problems.append(f"{rel}: {p.stat().st_size} bytes, at most {BACK_FILE_BYTES}")
        if len(rel.parts) - 1 > BACK_DEPTH:
            problems.append(f"{rel}: more than {BACK_DEPTH} folders down")
        if not all(BACK_NAME.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name with characters other than letters, digits, '.', '_' and '-'")
    return problems


# -- results ---------------------------------------------------------------------------------------------------


def junit_counts(xml: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not xml.is_file():
        return {}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def first_json(root: Path, pattern: str) -> dict:
    found = sorted(root.rglob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no {pattern} under {root}")
    return json.loads(found[-1].read_text())


def pick_summary(summary: dict) -> dict:
    keys = ("tau", "turns", "new_tokens", "spec_tokens_per_s", "baseline_tokens_per_s", "speedup",
            "greedy_matches_baseline", "greedy_check", "tau_per_turn", "looping", "acceptance_by_depth",
            "questions_done", "questions")
    return {k: summary[k] for k in keys if k in summary}


def counts(manifest: Path) -> dict:
    m = json.loads(manifest.read_text())
    return {"counts": m.get("counts", {}), "complete": m.get("complete", True), "timings": m.get("timings", {})}


def train_figures(train_dir: Path) -> dict:
    m = json.loads((train_dir / "manifest.json").read_text())
    return {"counts": m.get("counts", {}), "timings": m.get("timings", {}),
            "final_metrics": {k: v for k, v in m.get("final_metrics", {}).items()
                              if k.startswith(("val/", "eval/")) or "tokens_per_s" in k}}
