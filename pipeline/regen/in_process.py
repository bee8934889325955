"""What every in-process backend shares (hf, ctranslate2, openvino): prompts rendered by eaglet itself (so the
answers follow `target.chat_template` and `regen.thinking`), a prompt too long for the context refused for
good, and an answer cut at the first stop token."""
from __future__ import annotations

from typing import Optional, Union

from pipeline.data.chat import ThinkingMode, check_thinking_template, render_prompt
from pipeline.regen.batching import RegenItem
from pipeline.regen.waves import Answer, Failure


class TokenBackend:
    """Set by the subclass: tokenizer, stop_ids, max_new_tokens, max_positions (None: no limit)."""

    tokenizer = None
    stop_ids: list[int]
    max_new_tokens: int
    max_positions: Optional[int] = None

    def set_thinking(self, thinking) -> None:
        self.thinking = ThinkingMode.parse(thinking, "regen.thinking")
        check_thinking_template(self.tokenizer, self.thinking)  # on/off need a template with the switch

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return render_prompt(self.tokenizer, messages, thinking=self.thinking)

    def prompt_length(self, item: RegenItem) -> int:
        return len(self.prompt_ids(item.first_prompt()))

    def too_long(self, ids: list[int]) -> Optional[Failure]:
        """A failure for good when the prompt and max_new_tokens exceed the model's context."""
        if self.max_positions and len(ids) + self.max_new_tokens > self.max_positions:
            return Failure("prompt_too_long", f"{len(ids)} prompt tokens + max_new_tokens {self.max_new_tokens} "
                                              f"> max_position_embeddings {self.max_positions}")
        return None

    def split_runnable(self, prompts: list[list[int]]) -> tuple[list[Union[Answer, Failure, None]], list[int]]:
        """(results with the too-long prompts' failures filled in, indices of the prompts to generate)."""
        results: list[Union[Answer, Failure, None]] = [self.too_long(ids) for ids in prompts]
        return results, [i for i, r in enumerate(results) if r is None]

    def answer(self, new_ids: list[int]) -> Answer:
        """The answer in generated ids: up to the first stop token (counted), else cut at max_new_tokens."""
        stop = next((t for t, tok in enumerate(new_ids) if tok in self.stop_ids), None)
        if stop is None:
            content, n_tokens, finish = new_ids[:self.max_new_tokens], min(len(new_ids), self.max_new_tokens), "length"
        else:
            content, n_tokens, finish = new_ids[:stop], stop + 1, "stop"
        return Answer(text=self.tokenizer.decode(content, skip_special_tokens=True), n_tokens=n_tokens,
                      finish_reason=finish)
