"""In-process batched generation with the target (`regen.backend=hf`).

Prompts of a wave are left-padded into one batch; `generate` derives position ids from the attention mask,
so a padded row sees the same positions and keys as when it runs alone (at temperature 0 its answer does not
depend on its batch-mates, up to floating-point near-ties; the plan fixes batch composition, so reruns are
exact either way). Generation stops per row at EOS or the chat template's end-of-turn token.
"""
from __future__ import annotations

import logging
from typing import Union

import torch

from pipeline.data.chat import ThinkingMode, stop_token_ids
from pipeline.regen.batching import derive_seed
from pipeline.regen.config import HFGenerateConfig
from pipeline.regen.in_process import TokenBackend
from pipeline.regen.waves import Answer, Failure, Request
from pipeline.target import Target

log = logging.getLogger(__name__)


def compile_config(device: torch.device):
    from transformers import CompileConfig

    if device.type == "cuda":
        return CompileConfig()  # HF's default there: reduce-overhead (CUDA graphs)
    # Elsewhere generate compiles only when this private flag is set (transformers 5.x), and CUDA graphs do
    # not exist: plain inductor, static shapes.
    config = CompileConfig(mode="default", dynamic=False)
    config._compile_all_devices = True
    return config


class HFBackend(TokenBackend):
    name = "hf"
    concurrency = 0  # one padded batch per wave (waves.py)

    def __init__(self, target: Target, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 options: HFGenerateConfig | None = None, thinking=ThinkingMode.template):
        if max_new_tokens < 1:
            raise ValueError(f"regen.max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model, self.tokenizer, self.device = target.model, target.tokenizer, target.device
        self.set_thinking(thinking)
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_token_ids(self.tokenizer, self.model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        self.generate_kwargs = dict(
            max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            do_sample=temperature > 0, repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1)
        if temperature > 0:
            # top_k=0: no top-k cut; otherwise the model's or HF's default (50) would silently apply.
            self.generate_kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        options = options or HFGenerateConfig()
        self.pad_to = options.pad_to_multiple if options.cache == "static" else 1
        if options.cache == "static":
            self.generate_kwargs["cache_implementation"] = "static"
        if options.compile:
            self.generate_kwargs["compile_config"] = compile_config(self.device)
        else:
            self.generate_kwargs["disable_compile"] = True  # HF would otherwise compile a static cache on GPU

    def generate(self, requests: list[Request]) -> list[Union[Answer, Failure]]:
        prompts = [self.prompt_ids(r.messages) for r in requests]
        results, runnable = self.split_runnable(prompts)
        if runnable:
            seed = derive_seed(*(requests[i].seed for i in runnable))
            rows = self._generate_ids([prompts[i] for i in runnable], seed)
            for i, row in zip(runnable, rows):
                results[i] = self.answer(row)
        return results

    @torch.inference_mode()
    def _generate_ids(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        width = -(-width // self.pad_to) * self.pad_to  # static cache: fewer distinct shapes to compile
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):  # left padding: every row's last prompt token is at column width-1
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # seeded per wave without touching the caller's RNG
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=input_ids.to(self.device),
                                      attention_mask=attention_mask.to(self.device), **self.generate_kwargs)
        return out[:, width:].tolist()  # [B, new]: generated ids, pad after a row stopped


# -- registry entry (pipeline/regen/backends.py) ------------------------------------------------------------

def unavailable(cfg) -> str | None:
    return None  # any target transformers loads, on any device


def version() -> str | None:
    import transformers

    return transformers.__version__


def make(cfg, info):
    """(backend, target fingerprint, generation parameters): the whole target on this rank."""
    import dataclasses

    from pipeline.dist import rank_target_config
    from pipeline.target import load_target

    rcfg = cfg.regen
    target_cfg = rank_target_config(cfg.target, info)
    if target_cfg.tensor_parallel > 1:  # the ranks generate different batches: a whole target each
        log.warning("regen.backend=hf loads a whole target per rank; target.tensor_parallel=%d applies to dump, "
                    "online training and eval (a target too large for one device regenerates through a "
                    "tensor-parallel server: regen.backend=openai)", target_cfg.tensor_parallel)
        target_cfg = dataclasses.replace(target_cfg, tensor_parallel=1)
    target = load_target(target_cfg)
    backend = HFBackend(target, rcfg.max_new_tokens, rcfg.temperature, rcfg.top_p, rcfg.hf, thinking=rcfg.thinking)
    generation = {"stop_token_ids": backend.stop_ids}
    if rcfg.hf != HFGenerateConfig():  # recorded only when set, so runs started before these options resume
        generation["hf"] = dataclasses.asdict(rcfg.hf)
    generation["precision"] = target.precision
    return backend, target.fingerprint, generation
