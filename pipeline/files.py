"""Files on the ground floor: how every stage writes a file or a folder so that a reader never sees a torn
one, how it digests one, and which configured names may become folders. Every write-then-rename, every file
hash and every check of a name that becomes a path goes through here.

A temporary is a hidden sibling named after this process (`.name.<pid>.tmp`), in the same folder so the
rename is atomic; a writer that fails or is interrupted removes its temporary (a full disk is not left
fuller by it), and a temporary of a killed writer is recognisable by its name (`stale_tmp_siblings`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import IO, Iterator


def default_cache_root() -> Path:
    """eaglet's cache ($EAGLET_CACHE or ~/.cache/eaglet): dequantized targets, llama-server, precision."""
    return Path(os.environ.get("EAGLET_CACHE") or "~/.cache/eaglet").expanduser()


# A configured name (the experiment's `name`, `head.name`, `eval.run_name`, ...) becomes one folder under
# output_root, and stages delete folders under their output: a name must not be able to point anywhere else
# (`/etc/cron.d`, `..`, `a/../../b`), nor be one a shell or another filesystem mangles.
MAX_NAME = 200  # under the 255 bytes of a file name, with room for a temporary sibling's `.<name>.<pid>.tmp`
NAME_RULE = (f"a name must be one folder name of letters, digits and . _ + -, starting with a letter or digit, "
             f"at most {MAX_NAME} characters (no '/', no '..')")
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._+-]{{0,{MAX_NAME - 1}}}")


def check_name(value, key: str) -> str:
    """`value` if it is a valid name (NAME_RULE), else ValueError naming `key`, the value and the rule."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"{key}={value!r} is not a valid name; {NAME_RULE}")
    return value


def safe_name(text: str, max_len: int = MAX_NAME) -> str:
    """`text` made a valid name (for names eaglet derives, e.g. from a file's stem): every run of other
    characters becomes `_`, leading punctuation goes, and it is cut to `max_len` ("unnamed" if nothing is left)."""
    name = re.sub(r"[^A-Za-z0-9._+-]+", "_", text).lstrip("._+-")[:max_len]
    return name or "unnamed"


def folder_name(path) -> str:
    """The name an eval of a head folder (eval.head_dir) files its runs under: the folder's own, made valid."""
    return safe_name(Path(os.path.abspath(path)).name, 64)


def check_inside(path: Path, root: Path, key: str) -> Path:
    """`path` if it lies inside `root`, else ValueError. Both are made absolute and normalized lexically (`..`
    folded): a name cannot climb out, while a symlink the user placed under `root` stays the user's choice."""
    absolute, top = os.path.abspath(path), os.path.abspath(root)
    if os.path.commonpath([absolute, top]) != top or absolute == top:
        raise ValueError(f"{key}: {path} is not inside output_root={root}; every stage writes under output_root")
    return Path(path)


def text_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text, split at '\n' only: eaglet writes JSON with ensure_ascii=False, so a string
    may hold U+2028, U+0085 or \x1c..\x1e, at which str.splitlines would cut a record in two. The empty tail
    after the last newline is not a line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """The file's sha256, read in chunks (a dump shard or a target's weights need not fit in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tmp_sibling(path: Path) -> Path:
    """This process's temporary for `path`: beside it, hidden, named after the pid."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def stale_tmp_siblings(path: Path) -> list[Path]:
    """Temporaries for `path` of any process (a killed writer's among them)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def fsync_file(path: Path) -> None:
    """Makes a file's bytes durable whoever wrote it (a library, another process) and however; of a folder,
    its entries (a rename inside it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Makes a rename inside `directory` durable (its entry is on disk, not only the file's bytes)."""
    fsync_file(directory)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """Open `path` for writing so that readers see the old file or the whole new one, never a torn one: the
    body writes a per-process temporary in the same folder, which is fsynced and then renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(path)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as f:
        f.write(text)


def replace_dir(tmp: Path, final: Path) -> None:
    """Publish a finished folder: `tmp` takes `final`'s place (an older `final` is removed first; a folder
    cannot be renamed over a non-empty one), and the rename is made durable."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """A folder that appears whole or not at all: the body fills a fresh temporary folder, which then
    replaces `final`. Temporaries of killed writers are removed first (one writer per folder: pipeline/lock.py),
    and the temporary goes if the body fails."""
    final = Path(final)
    for stale in stale_tmp_siblings(final):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tmp_sibling(final)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
