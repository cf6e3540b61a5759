"""A conversation over a Decoder: the history stays in the KV caches across turns.

Each turn renders the whole conversation with the model's chat template and loads it into the decoder,
which runs only the tokens past the longest prefix its caches already hold (normally just the new user
message), never the whole history again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from edge.chat_template import ChatTemplate
from edge.generate import Decoder, Step
from edge.protocols import Tokenizer

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]  # text, chat messages ({"role", "content"}), token ids


class ChatSession:
    def __init__(self, decoder: Decoder, template: ChatTemplate, tokenizer: Tokenizer, system: str | None = None):
        self.decoder = decoder
        self.template = template
        self.tokenizer = tokenizer
        self.system = system
        self.messages: list[dict[str, str]] = []

    def send(self, text: str, max_tokens: int, should_stop: Callable[[], bool] | None = None) -> Iterator[Step]:
        """Stream the reply to `text`; the exchange joins the history once the reply ends (even cut short)."""
        conversation = [*self._system_messages(), *self.messages, {"role": "user", "content": text}]
        tokens = prompt_tokens(self.tokenizer, self.template.render(conversation), self.template.bos_token)
        reply = []
        for step in self.decoder.reply(tokens, max_tokens, should_stop):  # a prompt that cannot fit raises first
            reply.append(step.text)
            yield step
        if len(self.decoder.context) >= len(tokens):  # not stopped while the prompt was being read
            self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "".join(reply)}]

    def clear(self) -> None:
        self.messages = []
        self.decoder.reset()

    def _system_messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []


def prompt_tokens(tokenizer: Tokenizer, rendered: str, bos_text: str) -> list[int]:
    """Tokenize a rendered chat: special tokens parsed, BOS added only if the template did not write it."""
    has_bos = bool(bos_text) and rendered.startswith(bos_text)
    return tokenizer.tokenize(rendered, add_special=not has_bos, parse_special=True)
