"""A verifiers 0.4.0 taskset for the learning run on an environment that is not the loop's own
(docs/results/verifiers-arith): reasoning-gym's basic_arithmetic with a second attempt.

Task i is problem i of `rollout.tasks.make_task("basic_arithmetic", seed=config.seed)`, its prompt the
task's chat messages with `config.few_shot` solved examples (the `:learn` experiment's prompt: they teach
the <answer> tags, and the untrained model copies their numbers). verifiers' Env runs the episode:
the model answers; a wrong or missing answer gets the user reply RETRY and one more turn. Reward
(verifiers' trace, `record_reward`): 1 for the right answer at the first turn, SECOND_TRY_REWARD at
the second, else 0. An answer is the last non-blank <answer></answer> tag's content (strict extraction),
right when reasoning-gym's scorer gives it 1.0.

verifiers imports a taskset by its module name, so this directory goes on the path:

  PYTHONPATH=experiments/tasksets python -m branch_replay_jax.main \
      --config=experiments/grpo_smollm2_calc.py:vf_arith
"""

import functools

import verifiers.v1 as vf

from branch_replay_jax.rollout.tasks import make_task

RETRY = "That is not right. Try again: give only the final answer, inside <answer></answer> tags."
SECOND_TRY_REWARD = 0.5


class ArithData(vf.TaskData):
  index: int


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
  pass


class ArithTasksetConfig(vf.TasksetConfig):
  seed: int = 0             # reasoning-gym generator seed of the tasks
  size: int = 100_000       # problems the generator holds (a VerifiersEnv takes its first num_tasks)
  few_shot: int = 4         # solved examples before each question (generator seed 2,000,000, as make_task)


def arith_task(config: ArithTasksetConfig):
  """The reasoning-gym task behind the tasks (strict answers: only a closed tag counts)."""
  return _task(config.seed, config.size, config.few_shot)


@functools.lru_cache(maxsize=4)
def _task(seed: int, size: int, few_shot: int):
  return make_task("basic_arithmetic", seed=seed, size=size, strict_answer=True, few_shot=few_shot)


class ArithEnvConfig(vf.EnvConfig):
  player: vf.AgentConfig = vf.AgentConfig()


class ArithEnv(vf.Env[ArithEnvConfig]):
  async def run(self, task, agents):
    source = arith_task(self.taskset.config)
    problem, reward = source[task.data.index], 0.0
    async with agents.player.interaction(task) as interaction:
      segment = await interaction.turn()
      if source.score(segment.last_reply, problem).correct:
        reward = 1.0
      else:
        segment = await interaction.turn(RETRY)
        reward = SECOND_TRY_REWARD if source.score(segment.last_reply, problem).correct else 0.0
    interaction.trace.record_reward("solved", reward, 1.0)


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
  INFINITE = True

  def load(self):
    source = arith_task(self.config)
    for i in range(len(source)):
      yield ArithTask(ArithData(prompt=source.messages(source[i]), index=i), self.config.task)


__all__ = ["ArithEnv", "ArithTaskset"]
