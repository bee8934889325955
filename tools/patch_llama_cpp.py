"""Make llama.cpp's AMX kernels safe to build with GCC 12 (Debian 12), for `make llama-server`.

`ggml_tile_config_init` fills a tile configuration on the stack and loads it with the `_tile_loadconfig`
builtin. GCC 12 treats the stores that fill it as dead and drops them, so `ldtilecfg` loads an all-zero
configuration and the first tile instruction faults (SIGILL on the first multi-token prompt; the bug
described in upstream llama.cpp PR #26954). A compiler barrier that takes the configuration's address keeps
the stores. With it the AMX kernels work on AMX CPUs: prompt processing of the SmolLM2 GGUF measured 4.8x
faster than the build without them (llama-batched-bench, 2 cores).

    python -m tools.patch_llama_cpp <llama.cpp source dir>      # idempotent, from the repository root
"""
from __future__ import annotations

import sys
from pathlib import Path

FILE = Path("ggml/src/ggml-cpu/amx/mmq.cpp")
ANCHOR = "    _tile_loadconfig(&tc);\n"
BARRIER = ('    __asm__ __volatile__("" : : "r"(&tc) : "memory");  '
           "// eaglet: keep the stores above (GCC 12 drops them)\n")


def patch(root: Path) -> bool:
    """True when the file was changed; False when already patched. Raises if the code moved."""
    path = root / FILE
    text = path.read_text()
    if BARRIER in text:
        return False
    if text.count(ANCHOR) != 1:
        raise SystemExit(f"{path}: expected one `_tile_loadconfig(&tc);` line; llama.cpp changed, revisit the patch")
    path.write_text(text.replace(ANCHOR, BARRIER + ANCHOR))
    return True


if __name__ == "__main__":
    changed = patch(Path(sys.argv[1]))
    print(f"{FILE}: {'patched' if changed else 'already patched'}")
