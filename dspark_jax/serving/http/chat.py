"""Chat messages to prompt token ids for ``/v1/chat/completions``: text-only content, the roles
the chat template renders, and no message dropped silently.

A chat template is Jinja code: one that renders only some roles, or a role only at some
position (a system message only first), would drop the other messages from the prompt without a
word. :class:`ChatRenderer` therefore renders every conversation twice: once with each message's
content replaced by a marker, to check that every message reaches the prompt (a missing one is
a 400 naming it), then for real. ``developer`` (OpenAI's system-level role) is given to the
template as ``system`` when the template renders no ``developer`` message, as vLLM and SGLang
map it; decided once per template by rendering a probe conversation.
"""

from __future__ import annotations

import secrets

from dspark_jax.errors import DSparkInputError
from dspark_jax.serving.http.protocol import APIError, ChatCompletionRequest, ServerConfig, check_prompt_ids

__all__ = ["ROLE_FALLBACKS", "ChatRenderer", "chat_prompt"]

# OpenAI roles a template may not know, and the role they are given to the template as instead
ROLE_FALLBACKS = {"developer": "system"}


def _messages(req: ChatCompletionRequest) -> list[dict]:
    """``[{role, content}]`` with text-only content (parts joined)."""
    if not req.messages:
        raise APIError(400, "messages must not be empty", "messages")
    msgs = []
    for i, m in enumerate(req.messages):
        c = m.content
        if isinstance(c, list):
            parts = []
            for part in c:
                if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise APIError(
                        400, f"messages[{i}].content: only text parts are supported", f"messages.{i}.content"
                    )
                parts.append(part["text"])
            c = "".join(parts)
        msgs.append({"role": m.role, "content": c or ""})
    if not any(m["content"].strip() for m in msgs):
        raise APIError(400, "the messages are empty", "messages")
    return msgs


class ChatRenderer:
    """Renders chat messages with ``template`` (else the tokenizer's own), mapping the roles the
    template does not render (:data:`ROLE_FALLBACKS`) and refusing any message the template
    drops. Safe to call from several threads (the role probe may run twice; same result).

    Args:
      tokenizer: a :class:`dspark_jax.models.tokenizer.Tokenizer`.
      template: a Jinja chat template overriding the tokenizer's (``--chat-template``), or None.
    """

    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer, self.template = tokenizer, template
        self._marker = f"dspark{secrets.token_hex(4)}m"  # + index + "x": never inside another one
        self._roles: dict[str, str] | None = None

    def render(self, msgs: list[dict], add_generation_prompt: bool) -> str:
        """The template's text of ``msgs`` as given (no mapping, no check).

        Raises:
          DSparkInputError: no chat template, or the template refused or failed to render them.
        """
        if self.template is None and not getattr(self.tokenizer, "has_chat_template", True):
            raise DSparkInputError(
                f"{type(self.tokenizer).__name__} has no chat template: send a plain prompt to /v1/completions, "
                "or start the server with --chat-template FILE"
            )
        try:
            if self.template is not None:
                from dspark_jax.models.tokenizer import render_chat_template

                tok = self.tokenizer

                def piece(i):
                    return "" if i is None else tok.id_to_piece(i)

                return render_chat_template(
                    self.template,
                    msgs,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=piece(tok.bos_id),
                    eos_token=piece(tok.eos_ids[0] if tok.eos_ids else None),
                )
            return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        except DSparkInputError:
            raise
        except Exception as e:  # a template's own error (jinja2.TemplateError, a type error in its code)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DSparkInputError(f"chat template error: {msg}") from None

    def _dropped(self, msgs: list[dict], add_generation_prompt: bool) -> list[int]:
        """Indices of the messages of ``msgs`` whose content the template leaves out of the prompt
        (each content replaced by a marker, so templates that trim or cut a content still show it)."""
        probe = [dict(m, content=f"{self._marker}{i}x") for i, m in enumerate(msgs)]
        text = self.render(probe, add_generation_prompt)
        return [i for i in range(len(msgs)) if f"{self._marker}{i}x" not in text]

    def role_map(self) -> dict[str, str]:
        """``{role: role given to the template}`` for the roles of :data:`ROLE_FALLBACKS` that the
        template renders no message of (probed once: that role's message before a user message)."""
        if self._roles is None:
            roles = {}
            for role, fallback in ROLE_FALLBACKS.items():
                try:
                    known = not self._dropped([{"role": role}, {"role": "user"}], True)
                except DSparkInputError:  # a template that raises on roles it does not know
                    known = False
                if not known:
                    roles[role] = fallback
            self._roles = roles
        return self._roles

    def prompt_text(self, msgs: list[dict], add_generation_prompt: bool) -> str:
        """The rendered prompt of ``msgs``, roles mapped (:meth:`role_map`).

        Raises:
          APIError: 400 when the template drops a message (its role, or its role at that
            position, is not one it renders), refuses the messages or fails.
        """
        roles = self.role_map()
        mapped = [dict(m, role=roles.get(m["role"], m["role"])) for m in msgs]
        try:
            dropped = self._dropped(mapped, add_generation_prompt)
            if dropped:
                i = dropped[0]
                given = msgs[i]["role"]
                if mapped[i]["role"] != given:
                    given += f" (given to the template as {mapped[i]['role']})"
                raise APIError(
                    400,
                    f"messages[{i}]: the chat template does not render this {given} message (not a role it knows, "
                    "or not at this position): refused rather than answered without it",
                    f"messages.{i}.role",
                )
            return self.render(mapped, add_generation_prompt)
        except DSparkInputError as e:
            raise APIError(400, str(e), "messages") from None


def chat_prompt(req: ChatCompletionRequest, renderer: ChatRenderer, cfg: ServerConfig) -> list[int]:
    """The prompt token ids of a chat request: its messages rendered by ``renderer``, encoded
    without BOS. CPU-bound on long messages: the server calls it in a worker thread.

    Raises:
      APIError: 400 for empty messages, non-text content parts, a message the template drops, a
        template error or ids outside the vocabulary.
    """
    text = renderer.prompt_text(_messages(req), req.add_generation_prompt)
    return check_prompt_ids(renderer.tokenizer.encode(text, add_bos=False), cfg, "messages")
