"""Tokenizer: a `tokenizers.Tokenizer` plus special ids and a chat template, and incremental detokenization."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """Encodes prompts, decodes tokens, renders chat messages with the model's template."""

    def __init__(self, tok: HFTokenizer, *, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None, add_bos: bool, bos_token: str | None = None,
                 eos_token: str | None = None):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled_template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it): a long prompt tokenized on another
        # thread does not stop the server's event loop.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """Render `messages` ([{"role", "content"}]) to the prompt text the model was trained on; `variables` are
        more names the template may read (vLLM's chat_template_kwargs)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt")
        if self._compiled_template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise ValueError(f"chat template: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template.render({
            "bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **variables,
            "messages": messages, "add_generation_prompt": add_generation_prompt})

    @classmethod
    def from_hf_dir(cls, path: Path, bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> "Tokenizer | None":
        """tokenizer.json (+ tokenizer_config.json for the chat template and BOS policy); None if absent."""
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            return None
        tok = HFTokenizer.from_file(str(tok_file))
        cfg = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.exists():
            cfg = json.loads(cfg_file.read_text())

        def token_text(v):
            return v.get("content") if isinstance(v, dict) else v

        bos_token = token_text(cfg.get("bos_token"))
        eos_token = token_text(cfg.get("eos_token"))
        if bos_token_id is None and bos_token is not None:
            bos_token_id = tok.token_to_id(bos_token)
        if not eos_token_ids and eos_token is not None and tok.token_to_id(eos_token) is not None:
            eos_token_ids = (tok.token_to_id(eos_token),)
        return cls(tok, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
                   chat_template=cfg.get("chat_template"), add_bos=bool(cfg.get("add_bos_token", False)),
                   bos_token=bos_token, eos_token=eos_token)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # A few prompt tokens give the decoder context (leading spaces, byte merges) without re-decoding it all.
        self._ids: list[int] = list(prompt_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly readable text (possibly empty)."""
        self._ids.extend(new_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        full_text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""
