"""A target checkpoint as stored: its safetensors files read tensor by tensor, never as a model.

A draft head needs only a few of the target's tensors (embedding, lm_head, final norm) and the target's
identity (the fingerprint's weights digest). Both come from here without materializing the target: the
safetensors header of each file (or `model.safetensors.index.json` for a sharded checkpoint) says where each
tensor lies, a part is read alone (`safe_open(...).get_tensor`), and the digest reads a strided sample of
each tensor straight from the file's pages (`numpy.memmap`). A 70B checkpoint costs its embedding and
lm_head in memory (2 x 2 GB in bf16), not 140 GB.

    files = StoredCheckpoint.find(directory)      # None: no safetensors (a .bin checkpoint)
    files.tensor("model.embed_tokens.weight")     # one tensor, as stored
    files.weights_digest(names, load_dtype)       # = pipeline.target.weights_digest of the loaded model
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np
import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DIGEST_SAMPLES = 4096  # elements sampled per tensor (the same stride as weights_digest)

# safetensors dtype codes -> (torch dtype, numpy dtype of the same width to read the raw elements with)
_DTYPES = {
    "F64": (torch.float64, np.float64), "F32": (torch.float32, np.float32), "F16": (torch.float16, np.float16),
    "BF16": (torch.bfloat16, np.uint16), "I64": (torch.int64, np.int64), "I32": (torch.int32, np.int32),
    "I16": (torch.int16, np.int16), "I8": (torch.int8, np.int8), "U8": (torch.uint8, np.uint8),
    "BOOL": (torch.bool, np.bool_),
}


class CheckpointFileError(ValueError):
    """A stored checkpoint that cannot be read as such: the file and why, in one line."""


@dataclass(frozen=True)
class StoredTensor:
    name: str
    file: Path
    dtype: str  # safetensors code (F32, BF16, ...)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in `file`

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header only (8-byte length, JSON, then the data)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        if getattr(e, "errno", None) is not None:
            raise
        raise CheckpointFileError(f"{path}: not a safetensors file ({type(e).__name__}: {e})") from e
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise CheckpointFileError(f"{path}: tensor {name} has dtype {info['dtype']}, which eaglet cannot read")
        tensors[name] = StoredTensor(name, path, info["dtype"], tuple(info["shape"]), 8 + n + info["data_offsets"][0])
    return tensors


class StoredCheckpoint:
    """Every tensor of a safetensors checkpoint directory, by name, with where it is stored."""

    def __init__(self, directory: Path, tensors: Mapping[str, StoredTensor]):
        self.directory = directory
        self.tensors = dict(tensors)

    @classmethod
    def find(cls, directory) -> Optional["StoredCheckpoint"]:
        """The checkpoint in `directory` (sharded with an index, or one file); None when it has no safetensors."""
        directory = Path(directory)
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            tensors: dict[str, StoredTensor] = {}
            for file in sorted(set(weight_map.values())):
                tensors.update(read_header(directory / file))
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise CheckpointFileError(f"{directory / INDEX}: lists {missing[0]} (and {len(missing) - 1} more), "
                                          f"which its files do not hold")
            return cls(directory, tensors)
        if (directory / SINGLE).is_file():
            return cls(directory, read_header(directory / SINGLE))
        return None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read alone, in its stored dtype."""
        from safetensors import safe_open

        t = self.tensors[name]
        with safe_open(str(t.file), framework="pt") as f:
            return f.get_tensor(name)

    def resolve(self, model_name: str, base_prefix: str) -> Optional[str]:
        """The stored name of a model parameter: as named, or with/without the base model's prefix (checkpoints
        saved from the bare `LlamaModel`), or the only stored name with the same module path ending."""
        candidates = [model_name, model_name.removeprefix(f"{base_prefix}."), f"{base_prefix}.{model_name}"]
        for name in candidates:
            if name in self.tensors:
                return name
        tail = ".".join(model_name.split(".")[-2:])  # e.g. embed_tokens.weight
        matches = [n for n in self.tensors if n == tail or n.endswith(f".{tail}")]
        return matches[0] if len(matches) == 1 else None

    def sample(self, t: StoredTensor, samples: int = DIGEST_SAMPLES) -> torch.Tensor:
        """`flat[::step][:samples]` of a stored tensor (step = max(1, numel // samples)), read from the file's
        pages: at most `samples` elements touch the disk."""
        n = t.numel
        step = max(1, n // samples)
        idx = np.arange(0, n, step, dtype=np.int64)[:samples]
        np_dtype = _DTYPES[t.dtype][1]
        if n == 0:
            return torch.zeros(0, dtype=t.torch_dtype)
        mm = np.memmap(t.file, dtype=np_dtype, mode="r", offset=t.offset, shape=(n,))
        raw = np.ascontiguousarray(mm[idx])
        del mm
        out = torch.from_numpy(raw)
        return out.view(torch.bfloat16) if t.dtype == "BF16" else out

    def weights_digest(self, names: Mapping[str, str], load_dtype: Optional[torch.dtype]) -> str:
        """`pipeline.target.weights_digest` of the model transformers would load from these files, computed from
        the files: `names` maps each state-dict name to the stored tensor that holds it (a tied lm_head maps to
        the embedding), `load_dtype` is the floating dtype the load would give the weights (None: as stored).
        Same sorted order, same strided sample, same cast to fp32 before hashing."""
        h = hashlib.sha256()
        for name in sorted(names):
            t = self.tensors[names[name]]
            dtype = load_dtype if load_dtype is not None and t.torch_dtype.is_floating_point else t.torch_dtype
            sample = self.sample(t).to(dtype).to(torch.float32)
            h.update(f"{name}:{t.shape}:{dtype}".encode())
            h.update(sample.numpy().tobytes())
        return h.hexdigest()[:16]
