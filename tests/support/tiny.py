"""The tests' tiny target: a seeded tiny random Llama and a real (trained) byte-level BPE tokenizer with a
ChatML chat template. Fixtures (tests/conftest.py), test families (families.py), benches and the GPU kit's
checks build from here."""
from __future__ import annotations

import torch

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
    first) and chat template: ChatML by default; families.py gives other families' own."""
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
