"""Token-in, token-out chat: an episode's token ids grown one message at a time, never re-tokenized
(docs/design.md, "Episodes").

    chat = ChatTokens(tokenizer, env.reset(problem))      # prompt: the first messages + generation prompt
    prompt = chat.ids                                      # what the sampler continues
    chat.add_model_turn(sampled_ids)                       # the model's tokens, kept verbatim
    chat.add_observation([{"role": "tool", "content": ...}])   # only the new text is tokenized
    episode = chat.episode()                               # data.episodes.Episode for the layouts

A turn's prompt is the episode's ids so far plus the tokenized observation. The observation's ids
are the tokens of the text the chat template adds for the new messages (with the next turn's
generation prompt, and the glue the template puts after the model's turn, e.g. SmolLM2's "\\n"
after <|im_end|>): the template renders the whole conversation, and the text it has already
rendered, the ids so far, must be a prefix of the new rendering. A template that rewrites earlier
turns (e.g. one that drops an earlier assistant message's reasoning) breaks that prefix: it is
refused with a ValueError naming the template and the first message it renders differently,
because re-tokenizing the history would train the model on tokens it did not see when sampling.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from branch_replay_jax.data.episodes import MODEL, OBSERVATION, Episode
from branch_replay_jax.models.loading import encode_chat, stop_ids


class ChatTokens:
  """One episode's messages and token ids, appended to and never re-tokenized.

  Args:
    tokenizer: a Hugging Face tokenizer with a chat template (`models.loading.load_tokenizer`).
    messages: the environment's first messages ([{"role", "content"}, ...], `Environment.reset`).
    chat_template: a Jinja template in place of the tokenizer's own, or None.
    template_name: the template's name in errors; default the tokenizer's name_or_path.

  Attributes:
    ids: list of int, the episode's token ids so far (prompt, model turns, observations).
    messages: list of the conversation's messages so far (the model's turns as "assistant" messages
      whose content is the decoded sampled ids without their stop token).
    segments, roles: the ids after the prompt cut into model turns and observations (`Episode`).

  Raises:
    ValueError: no messages (naming the field).
  """

  def __init__(self, tokenizer, messages: Sequence[Mapping[str, str]], *, chat_template: str | None = None,
               template_name: str | None = None):
    if not messages:
      raise ValueError("ChatTokens: messages is empty; the environment's reset must return at least one message")
    self.tokenizer, self.chat_template = tokenizer, chat_template
    self.template_name = template_name or f"{getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}'s chat template"
    self.messages = [dict(m) for m in messages]
    self.ids = list(encode_chat(tokenizer, self.messages, chat_template))
    self.prompt_len = len(self.ids)
    self.segments, self.roles = [], []
    self._text = self._render(self.messages, True)   # the text the ids so far spell
    self._stops = set(stop_ids(tokenizer))

  def _render(self, messages, generation_prompt: bool) -> str:
    kw = {} if self.chat_template is None else {"chat_template": self.chat_template}
    return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                              **kw)

  def add_model_turn(self, sampled_ids: Sequence[int]) -> str:
    """Append the model's sampled ids verbatim (a model segment) and its message to the history.

    Returns:
      The turn's content: the ids decoded (special tokens kept) without a trailing stop id; what the
      environment reads (`Environment.step`).

    Raises:
      ValueError: no ids, or a model turn right after another one (an observation must come between).
    """
    sampled = [int(i) for i in sampled_ids]
    if not sampled:
      raise ValueError("ChatTokens.add_model_turn: sampled_ids is empty; a model turn has >= 1 token")
    if self.roles and self.roles[-1] == MODEL:
      raise ValueError("ChatTokens.add_model_turn: the previous segment is a model turn; add the observation first")
    body = sampled[:-1] if sampled[-1] in self._stops else sampled
    content = self.tokenizer.decode(body, skip_special_tokens=False)
    self.ids += sampled
    self.segments.append(np.asarray(sampled, np.int32))
    self.roles.append(MODEL)
    self._text += self.tokenizer.decode(sampled, skip_special_tokens=False)
    self.messages.append({"role": "assistant", "content": content})
    return content

  def add_observation(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Append the environment's messages: only the text the template adds for them is tokenized.

    Returns:
      The observation's ids (the template's glue after the model's turn, the messages, the next
      generation prompt): the next turn's prompt is `ids` after this call.

    Raises:
      ValueError: no messages; an observation not after a model turn; the template renders an earlier
        message differently once these are added (naming the template and that message's index), or
        adds no text.
    """
    if not messages:
      raise ValueError("ChatTokens.add_observation: messages is empty")
    if not self.roles or self.roles[-1] != MODEL:
      raise ValueError("ChatTokens.add_observation: an observation follows a model turn")
    new = self.messages + [dict(m) for m in messages]
    text = self._render(new, True)
    if not text.startswith(self._text):
      index = self._first_rewritten(new, text)
      raise ValueError(f"ChatTokens: {self.template_name} rewrites message {index} "
                       f"(role {new[index]['role']!r}) once messages {len(self.messages)}.. are added: the "
                       "history would be re-tokenized, so the tokens trained would not be the tokens sampled. "
                       "Use a template that renders earlier messages unchanged")
    delta = text[len(self._text):]
    ids = list(self.tokenizer.encode(delta, add_special_tokens=False))
    if not ids:
      raise ValueError(f"ChatTokens: {self.template_name} adds no text for messages {len(self.messages)}..")
    self.ids += ids
    self.segments.append(np.asarray(ids, np.int32))
    self.roles.append(OBSERVATION)
    self.messages, self._text = new, text
    return ids

  def _first_rewritten(self, new, text) -> int:
    """Index of the first message whose rendering (conversation up to it) is not a prefix of `text`,
    the new rendering; the model's turns are checked against what the episode holds."""
    for k in range(1, len(self.messages) + 1):
      if not text.startswith(self._render(new[:k], False)):
        return k - 1
    return len(self.messages) - 1   # the last model turn: its text plus the glue differ from the sampled ids

  def episode(self) -> Episode:
    """The episode as a `data.episodes.Episode` (prompt ids, model and observation segments). A last
    observation (an episode cut by a budget after it) is left out: no model token attends to it.

    Raises:
      ValueError: as `Episode` (no model turn yet).
    """
    n = len(self.roles) - (bool(self.roles) and self.roles[-1] == OBSERVATION)
    return Episode(np.asarray(self.ids[:self.prompt_len], np.int32), tuple(self.segments[:n]), tuple(self.roles[:n]))
