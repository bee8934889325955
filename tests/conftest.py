"""Shared fixtures: a seeded tiny random Llama with a real (trained) byte-level BPE tokenizer and a
ChatML chat template, for unit tests; the real SmolLM2 target for `slow` integration tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("EAGLET_TEST_THREADS", "2")))
# `auto` precision resolves to float32 in the suite on every machine (the exactness tests mean the same with
# and without fast bf16); tests of bf16 pick it explicitly. Subprocesses (pipeline.run, torchrun, Slurm
# jobs) inherit it.
os.environ["EAGLET_FAST_BF16"] = "0"

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small head and verifies them with the target model.",
    "def add(a, b):\n    return a + b\n",
    "What is 12 times 7? It is 84.",
    "Write a short poem about the sea, the wind and the stars.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "Hello! How can I help you today?",
]


def build_tiny_tokenizer(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos="<|im_start|>",
                         eos="<|im_end|>", template=CHATML_TEMPLATE):
    """A byte-level BPE tokenizer (exact round trip of any text) with the given special tokens (pad and unk
    first) and chat template: ChatML by default; tests/families.py gives other families' own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=specials[0],
        unk_token=specials[0],
    )
    fast.chat_template = template
    return fast


def build_tiny_llama(vocab_size: int, seed: int = 0, num_layers: int = 8):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    # Random init gives near-uniform logits; scale the head so greedy paths are decisive and stable.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


@pytest.fixture
def single_thread():
    """Batch-1 decoding is overhead-bound on CPU: a second thread only adds synchronization (and slows a
    neighbouring job). Modules opt in with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A local HF directory (config, safetensors, tokenizer with chat template) of the tiny Llama."""
    path = tmp_path_factory.mktemp("tiny_llama")
    model = build_tiny_llama(len(tiny_tokenizer))
    model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


# The device of the tiny fp32 model: cpu here; the GPU kit (tools/gpu) runs the lossless tests with cuda.
TEST_DEVICE = os.environ.get("EAGLET_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).to(TEST_DEVICE).eval()


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (cached dequantized SmolLM2-135M-Instruct)."""
    from pipeline.config import TargetConfig
    from pipeline.target import load_target

    return load_target(TargetConfig(dtype="float32"))


@pytest.fixture
def fresh_precision():
    """The capability decision recomputed inside the test (after it sets EAGLET_FAST_BF16) and after it."""
    from pipeline import precision

    precision.fast_bf16.cache_clear()
    yield precision
    precision.fast_bf16.cache_clear()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared datasets not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def server_binary():
    """llama.cpp's llama-server that `make llama-server` builds into eaglet's cache (make test builds it)."""
    from pipeline.regen.config import LlamaCppConfig
    from pipeline.regen.llama_server import binary_path, find_binary
    from pipeline.target import TargetConfig

    binary = find_binary(LlamaCppConfig(), TargetConfig())
    if binary is None:
        message = f"no llama-server at {binary_path(LlamaCppConfig(), TargetConfig())}: run `make llama-server`"
        if os.environ.get("CI"):
            pytest.fail(message)  # make test builds it; CI must not silently skip
        pytest.skip(message)
    return binary
