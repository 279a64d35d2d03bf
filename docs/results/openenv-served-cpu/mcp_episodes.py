"""Seconds per episode of tests/oe_guess.py's number game with MCP tools (SubmitGuessEnvironment: `compare` hints,
`submit` ends it) in process (OpenEnvEnv) and served by OpenEnv's own server on a local port (ServedOpenEnv, the
server hosting it with OpenEnv's base Action), the same scripted turns through run_episode (two hints, then the
submission: three turns, three tool calls), side by side in one process. Prints one JSON line per layout.

    cd REPO && taskset -c 0 .venv/bin/python docs/results/openenv-served-cpu/mcp_episodes.py [EPISODES]
"""

import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

from episodes import serve  # noqa: E402
from openenv.core.env_server.types import Action  # noqa: E402
from oe_guess import GuessObservation, SubmitGuessEnvironment  # noqa: E402

from branch_replay_jax.models.loading import load_tokenizer, stop_ids  # noqa: E402
from branch_replay_jax.rollout.environments import run_episode  # noqa: E402
from branch_replay_jax.rollout.openenv_env import OpenEnvEnv  # noqa: E402
from branch_replay_jax.rollout.openenv_served import ServedOpenEnv  # noqa: E402

CALL = '<tool_call>{{"name": "{}", "arguments": {{"number": {}}}}}</tool_call>'


def main(episodes: int) -> None:
  url, server = serve(SubmitGuessEnvironment, Action, GuessObservation)
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  stop = stop_ids(tokenizer)[0]
  texts = (CALL.format("compare", 5), CALL.format("compare", 8), CALL.format("submit", 3))
  turns = [tokenizer.encode(t, add_special_tokens=False) + [stop] for t in texts]
  envs = {"in_process": OpenEnvEnv(SubmitGuessEnvironment()),
          "served": ServedOpenEnv(url)}
  for name, env in envs.items():
    rewards, calls, cpu, wall = [], 0, resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for seed in range(episodes):
      script = iter(turns)
      result = run_episode(env, seed, seed, tokenizer, lambda ids, budget: next(script), max_turns=3,
                           max_turn_tokens=32, max_context=2048)
      rewards.append(result.reward)
      calls += result.tool_calls
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime   # both threads: client and server
    print(json.dumps({"layout": name, "episodes": episodes, "turns_per_episode": 3, "tool_messages": calls,
                      "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                      "ms_per_episode": round(1e3 * wall / episodes, 2), "reward_sum": round(sum(rewards), 6)}))
    env.close()
  server.should_exit = True


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
