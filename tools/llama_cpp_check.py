"""Does the installed llama-cpp-python really serve this machine? Used by `make install-llama-cpp` after
(re)building it, and by tests/test_regen_openai.py's server fixture as its readiness probe's reference.

A build can import, load the GGUF and answer a one-token prompt, and still die on the first multi-token
prompt: llama.cpp's AMX kernels compiled by GCC 12 load an empty tile configuration (the stores that fill it
are dead-store-eliminated before `ldtilecfg`), and the first tile instruction raises SIGILL. So the check is
a real multi-token chat completion at temperature 0, in a child process, reporting how the child died.

    python -m tools.llama_cpp_check        # exit 0: works; 1: not installed, dies, or answers nothing
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

PROBE = """
import llama_cpp, llama_cpp.server.app  # the [server] extra's HTTP stack imports too
from pipeline.target import TargetConfig, packaged_gguf
cfg = TargetConfig()
llm = llama_cpp.Llama(model_path=str(packaged_gguf(cfg.gguf_package, cfg.gguf_file)), n_ctx=256, n_threads=2,
                      verbose=False)
out = llm.create_chat_completion(messages=[{"role": "user", "content": "Why do cats purr? Answer in a sentence."}],
                                 max_tokens=8, temperature=0.0)
text = out["choices"][0]["message"]["content"]
assert text and text.strip(), f"empty answer: {out!r}"
print(f"llama-cpp-python {llama_cpp.__version__}: multi-token chat completion ok ({text.strip()[:40]!r})")
"""


def describe_exit(returncode: int) -> str:
    """'exit code 1' or 'killed by SIGILL (illegal instruction)' for a child's returncode."""
    if returncode >= 0:
        return f"exit code {returncode}"
    sig = signal.Signals(-returncode)
    return f"killed by {sig.name} ({signal.strsignal(sig)})"


def main() -> int:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode == 0:
        print(proc.stdout.strip())
        return 0
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
    print(f"llama-cpp-python check failed: {describe_exit(proc.returncode)}\n{tail}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
