"""Prompt formatting as in the paper (§5, App. D) and the token cost of one call.

With ``template=True`` the user text goes through the model's chat template with the model's
default system prompt (no system message is passed, so the template inserts its own) and
``enable_thinking=False`` (ignored by templates without a reasoning switch). A model that ships
no chat template falls back to raw prompts with a one-line warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

log = logging.getLogger(__name__)


@dataclass
class PromptFormat:
    """Turns user strings into the exact token ids a deployed API would run."""

    tokenizer: object
    template: bool = True

    def __post_init__(self):
        if self.template and not getattr(self.tokenizer, "chat_template", None):
            log.warning("model ships no chat template: using raw prompts")
            self.template = False

    def text(self, user: str) -> str:
        """The full prompt text sent to the model for user input ``user``."""
        if not self.template:
            return user
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )

    def ids(self, user: str) -> list[int]:
        """Token ids of the full prompt (system prompt + template + input)."""
        return self.tokenizer(self.text(user), add_special_tokens=not self.template)["input_ids"]

    def prompt_tokens(self, user: str) -> int:
        """System prompt + template + input tokens of one call (§5 cost metric, no caching)."""
        return len(self.ids(user))

    @cached_property
    def shared_prefix(self) -> tuple[int, ...]:
        """Token ids every formatted prompt starts with (system prompt + template head)."""
        a, b = self.ids("A"), self.ids("中")
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return tuple(a[:k])
