"""Conversations rendered with the user's tokenizer's own chat template, and which of their
tokens are targets (data.format=chat; prompt_response with data.pairs_as_chat).

    chat = ChatTemplate.load(data.tokenizer, tok)   # a ConfigError where there is no template
    [(ids, target)] = chat.encode([doc])            # ids (n,) int32, target (n,) bool

The conversation is rendered whole (`apply_chat_template`, no generation prompt) and encoded
as the token store encodes (the tokenizer.json, no added special tokens: the template writes
its own). Targets are the assistant turns: for assistant turn i, the tokens after
render(turns[:i], generation prompt) up to render(turns[:i+1]) are its span, and the span is a
target up to and including its end-of-turn token (the tokenizer's eos where the span has it,
e.g. ChatML's <|im_end|>; else its last special token; else the whole span), not after it (the
template's separator, e.g. the "\\n" after <|im_end|>). System, user and tool turns, the role
headers and the generation prompt ("<|im_start|>assistant\\n") are not targets.

This needs the prefix property: each such render, encoded, is a prefix of the whole
conversation's ids. A template that rewrites earlier turns (drops old reasoning, adds a system
prompt only when the conversation is longer) breaks it: that is an error naming the
conversation, never masks at the wrong place.
"""

from __future__ import annotations

import hashlib

import numpy as np

from core.config import ConfigError
from preinfer.data.corpus import CorpusError, Document
from preinfer.data.tokenization import hf_tokenizer_dir, load_hf_tokenizer
from preinfer.model.modeling import resolve_package_path


class ChatTemplate:
    """The chat template of data.tokenizer, with `tok` (the store's tokenizers.Tokenizer) to
    encode what it renders."""

    def __init__(self, hf, tok, spec: str):
        self.hf, self.tok, self.spec = hf, tok, spec
        self.template: str = hf.chat_template
        eos = hf.eos_token
        self.eos: int | None = tok.token_to_id(str(eos)) if eos is not None else None
        self.special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def load(cls, spec: str, tok) -> ChatTemplate:
        hf_dir = hf_tokenizer_dir(spec)
        if hf_dir is None:
            p = resolve_package_path(spec, "data.tokenizer")
            raise ConfigError(
                f"data.tokenizer {p} is not a Hugging Face tokenizer directory (no "
                "tokenizer_config.json), so it has no chat template; give the chat model's "
                "directory (as save_pretrained writes it), or use data.format=prompt_response"
            )
        hf = load_hf_tokenizer(hf_dir)
        if not isinstance(hf.chat_template, str) or not hf.chat_template.strip():
            raise ConfigError(
                f"data.tokenizer {hf_dir} has no chat template (no chat_template.jinja, nor "
                "chat_template in tokenizer_config.json); data.format=chat and "
                "data.pairs_as_chat render conversations with it: use a chat model's "
                "tokenizer, or data.format=prompt_response without pairs_as_chat"
            )
        return cls(hf, tok, spec)

    def describe(self) -> dict:
        """What the token store's fingerprint records of the rendering."""
        return {
            "template_sha256": hashlib.sha256(self.template.encode()).hexdigest(),
            "eos": None if self.eos is None else self.tok.id_to_token(self.eos),
            "targets": "assistant turns through their end-of-turn token",
        }

    def _render(self, turns: list[dict], gen: bool, doc: Document) -> str:
        try:
            return self.hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # jinja2's TemplateError, or a template's raise_exception
            raise CorpusError(
                f"data.source: the chat template of data.tokenizer refuses conversation "
                f"{doc.doc_id} ({type(e).__name__}: {e}); fix or drop that row"
            ) from None

    def _end_of_turn(self, span: list[int]) -> int:
        """How many of an assistant span's ids are targets (through its end-of-turn token)."""
        if self.eos is not None and self.eos in span:
            return span.index(self.eos) + 1
        last = [j for j, t in enumerate(span) if t in self.special]
        return last[-1] + 1 if last else len(span)

    def encode(self, docs: list[Document]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids (n,) int32, target (n,) bool) of each conversation (see the module docstring)."""
        texts, plan = [], []
        for doc in docs:
            turns = doc.turns()
            at = len(texts)
            texts.append(self._render(turns, False, doc))
            marks = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
            for i in marks:
                texts.append(self._render(turns[:i], True, doc))
                texts.append(self._render(turns[: i + 1], False, doc))
            plan.append((doc, at, marks))
        enc = [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]
        out = []
        for doc, at, marks in plan:
            ids = enc[at]
            target = np.zeros(len(ids), dtype=bool)
            for k, i in enumerate(marks):
                start, end = enc[at + 1 + 2 * k], enc[at + 2 + 2 * k]
                if ids[: len(end)] != end or end[: len(start)] != start:
                    raise CorpusError(
                        f"data.tokenizer {self.spec}: its chat template does not render "
                        f"conversation {doc.doc_id} up to assistant turn {i} as a prefix of the "
                        "whole conversation, so the assistant's tokens cannot be told apart; "
                        "data.format=chat needs a template that renders a conversation turn by "
                        "turn (one that rewrites earlier turns cannot be masked)"
                    )
                span = end[len(start) :]
                n = self._end_of_turn(span)
                target[len(start) : len(start) + n] = True
            out.append((np.asarray(ids, dtype=np.int32), target))
        return out
