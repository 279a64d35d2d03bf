"""Token-in, token-out chat: an episode's token ids grown one message at a time, never re-tokenized
(docs/design.md, "Episodes").

    chat = ChatTokens(tokenizer, env.reset(problem))      # prompt: the first messages + generation prompt
    prompt = chat.ids                                      # what the sampler continues
    chat.add_model_turn(sampled_ids)                       # the model's tokens, kept verbatim
    chat.add_observation([{"role": "tool", "content": ...}])   # only the new text is tokenized
    episode = chat.episode()                               # data.episodes.Episode for the layouts

A turn's prompt is the episode's ids so far plus the tokenized observation. The observation's ids
are the tokens of the text the chat template writes after the model's turn: its close of the
assistant message (SmolLM2's `<|im_end|>\n`), the new messages and the next generation prompt.
That text is read off a rendering of the conversation in which the last assistant message's
content is a placeholder, so the template's treatment of the sampled text (Llama 3's `| trim`,
Qwen3 dropping an earlier turn's `<think>`) never matters: the history is never re-rendered into
the ids, and no template stops an episode. A turn that ended on a stop id whose text opens the
template's close (`<|im_end|>`) stands for it; a turn that ended on another stop id (Qwen2.5's
`<|endoftext|>`) gets the template's whole close after it, as the template would have closed the turn.

With history="template" the model sees what the template renders instead (Qwen3's earlier turns
without their `<think>`): after each observation the whole conversation is rendered again. Where
that rendering extends the ids so far, only its new part is appended, as above. Where it does not
(the template rewrote an earlier turn), the ids so far are closed as one row and the rendering
opens the next row. An episode is then a list of rows (`rows()`), each an `Episode` whose prompt is
the context the model was given and whose model segments are the turns sampled from it. Every
sampled token lies in exactly one row; a row's re-rendered earlier turns are observation tokens
there (attended, never trained). The rows of a problem's episodes form one trie
(`algorithms.groups.build_episodes`), so what they still share is computed once.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from branch_replay_jax.data.episodes import MODEL, OBSERVATION, Episode
from branch_replay_jax.models.loading import TURN as _TURN
from branch_replay_jax.models.loading import encode_chat, encode_rendered, render_chat, stop_ids

HISTORIES = ("tokens", "template")   # rollout.episodes.history (docs/design.md, "Episodes")


class ChatTokens:
  """One episode's messages and token ids, appended to and never re-tokenized.

  Args:
    tokenizer: a Hugging Face tokenizer with a chat template (`models.loading.load_tokenizer`).
    messages: the environment's first messages ([{"role", "content"}, ...], `Environment.reset`).
    chat_template: a Jinja template in place of the tokenizer's own, or None.
    template_name: the template's name in errors; default the tokenizer's name_or_path.
    history: "tokens" (the sampled ids kept; the default) or "template" (the template's rendering of the
      whole conversation after each observation; a rewritten history opens a new row).

  Attributes:
    ids: list of int, the current row's token ids so far (prompt, model turns, observations); with
      history "tokens" the episode has one row.
    prompt_len: tokens of the current row's context (its prompt).
    messages: list of the conversation's messages so far (the model's turns as "assistant" messages
      whose content is the decoded sampled ids without their stop token).
    segments, roles: the ids after the prompt cut into model turns and observations (`Episode`).

  Raises:
    ValueError: no messages (naming the field), a history not in HISTORIES.
  """

  def __init__(self, tokenizer, messages: Sequence[Mapping[str, str]], *, chat_template: str | None = None,
               template_name: str | None = None, history: str = "tokens"):
    if not messages:
      raise ValueError("ChatTokens: messages is empty; the environment's reset must return at least one message")
    if history not in HISTORIES:
      raise ValueError(f"ChatTokens: history={history!r} is not one of {HISTORIES}")
    self.history, self._closed = history, []
    self.tokenizer, self.chat_template = tokenizer, chat_template
    self.template_name = template_name or f"{getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}'s chat template"
    self.messages = [dict(m) for m in messages]
    self.ids = list(encode_chat(tokenizer, self.messages, chat_template))
    self.prompt_len = len(self.ids)
    self.segments, self.roles = [], []
    self._stops = {i: tokenizer.decode([i], skip_special_tokens=False) for i in stop_ids(tokenizer)}

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
    self.messages.append({"role": "assistant", "content": content})
    return content

  def add_observation(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Append the environment's messages: only the text the template adds for them is tokenized.

    Returns:
      The observation's ids (the template's close of the model's turn, the messages, the next
      generation prompt): the next turn's prompt is `ids` after this call.

    Raises:
      ValueError: no messages; an observation not after a model turn; a template that does not
        write an assistant message's content exactly once (naming the template).
    """
    if not messages:
      raise ValueError("ChatTokens.add_observation: messages is empty")
    if not self.roles or self.roles[-1] != MODEL:
      raise ValueError("ChatTokens.add_observation: an observation follows a model turn")
    new = [dict(m) for m in messages]
    if self.history == "template":
      return self._rendered(new)
    text, contents = render_chat(self.tokenizer, self.messages[:-1] + [{"role": "assistant", "content": _TURN}] + new,
                                 self.chat_template, generation_prompt=True)
    if text.count(_TURN) != 1:
      raise ValueError(f"ChatTokens: {self.template_name} writes an assistant message's content {text.count(_TURN)} "
                       "times, not once: the text it adds after a model turn cannot be told apart")
    tail = text[text.index(_TURN) + len(_TURN):]
    stop = self._stops.get(int(self.segments[-1][-1]))
    if stop and tail.startswith(stop):   # the sampled stop token is the template's close
      tail = tail[len(stop):]
    ids = encode_rendered(self.tokenizer, tail, contents)
    if not ids:
      raise ValueError(f"ChatTokens: {self.template_name} adds no text for messages {len(self.messages)}..")
    self.ids += ids
    self.segments.append(np.asarray(ids, np.int32))
    self.roles.append(OBSERVATION)
    self.messages += new
    return ids

  def _rendered(self, new: list[dict]) -> list[int]:
    """history "template": the whole conversation rendered; its new part appended where it extends
    the ids, else the current row closed and the rendering opened as the next row (module docstring)."""
    full = encode_chat(self.tokenizer, self.messages + new, self.chat_template)
    if full == self.ids:
      raise ValueError(f"ChatTokens: {self.template_name} adds no text for messages {len(self.messages)}..")
    if len(full) > len(self.ids) and full[:len(self.ids)] == self.ids:
      ids = full[len(self.ids):]
      self.ids += ids
      self.segments.append(np.asarray(ids, np.int32))
      self.roles.append(OBSERVATION)
    else:
      self._closed.append(self.episode())
      ids, self.ids, self.prompt_len, self.segments, self.roles = full, list(full), len(full), [], []
    self.messages += new
    return ids

  def episode(self) -> Episode:
    """The current row as a `data.episodes.Episode` (prompt ids, model and observation segments); with
    history "tokens", the episode. A last observation (an episode cut by a budget after it) is left
    out: no model token attends to it.

    Raises:
      ValueError: as `Episode` (no model turn yet).
    """
    n = len(self.roles) - (bool(self.roles) and self.roles[-1] == OBSERVATION)
    return Episode(np.asarray(self.ids[:self.prompt_len], np.int32), tuple(self.segments[:n]), tuple(self.roles[:n]))

  def rows(self) -> tuple[Episode, ...]:
    """The episode's rows in order: the closed ones and the current one (left out while it has no
    model turn: a row opened by the last observation of an episode a budget cut). One row with
    history "tokens".

    Raises:
      ValueError: as `Episode` (no model turn in the episode).
    """
    current = () if MODEL not in self.roles and self._closed else (self.episode(),)
    return tuple(self._closed) + current
