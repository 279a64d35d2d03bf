"""A verifiers 0.4.0 taskset for tests/test_verifiers.py: guess a number in 1..8 in at most four
guesses, the environment answering "higher" or "lower" as the user; reward 1 for the number, else 0.
Task i hides SECRETS[i]; task 4 (secret 0) is a game that breaks after the first guess (its Env
raises), for the error path. Imported by verifiers as the taskset id "vf_guess" (tests/ is on sys.path)."""

import re

import verifiers.v1 as vf

SECRETS = (5, 2, 7, 3, 0)
MAX_GUESSES = 4


class GuessData(vf.TaskData):
  secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
  pass


class GuessEnvConfig(vf.EnvConfig):
  player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
  async def run(self, task, agents):
    secret, reward = task.data.secret, 0.0
    async with agents.player.interaction(task) as interaction:
      segment = await interaction.turn()
      for guess_number in range(1, MAX_GUESSES + 1):
        if secret == 0:
          raise RuntimeError("the game broke")
        found = re.findall(r"\d+", segment.last_reply)
        guess = int(found[-1]) if found else None
        if guess == secret:
          reward = 1.0
          break
        if guess_number == MAX_GUESSES:
          break
        hint = "no number" if guess is None else ("higher" if secret > guess else "lower")
        segment = await interaction.turn(f"{hint}. Guess again.")
    interaction.trace.record_reward("guessed", reward, 1.0)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
  def load(self):
    for secret in SECRETS:
      yield GuessTask(GuessData(prompt="I think of a number from 1 to 8. Guess it.",
                                system_prompt="Answer with a number.", secret=secret), self.config.task)


__all__ = ["GuessEnv", "GuessTaskset"]
