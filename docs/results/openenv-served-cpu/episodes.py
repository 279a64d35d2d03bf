"""Seconds per episode of tests/oe_guess.py's number game in process (OpenEnvEnv) and served by OpenEnv's own
server on a local port (ServedOpenEnv: a WebSocket session per episode), the same scripted turns through
run_episode, side by side in one process. Prints one JSON line per layout.

    cd REPO && taskset -c 0 .venv/bin/python docs/results/openenv-served-cpu/episodes.py [EPISODES]
"""

import json
import os
import resource
import socket
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import uvicorn  # noqa: E402
from openenv.core.env_server.http_server import create_app  # noqa: E402
from oe_guess import GuessAction, GuessNumberEnvironment, GuessObservation  # noqa: E402

from branch_replay_jax.models.loading import load_tokenizer, stop_ids  # noqa: E402
from branch_replay_jax.rollout.environments import run_episode  # noqa: E402
from branch_replay_jax.rollout.openenv_env import OpenEnvEnv  # noqa: E402
from branch_replay_jax.rollout.openenv_served import ServedOpenEnv  # noqa: E402


def serve(environment, action, observation):
  """(URL, uvicorn server) of `environment` behind OpenEnv's own server (`create_app`) on a free local port."""
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(uvicorn.Config(create_app(environment, action, observation), log_level="critical"))
  threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
  while not server.started:
    time.sleep(0.05)
  return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def main(episodes: int) -> None:
  url, server = serve(GuessNumberEnvironment, GuessAction, GuessObservation)
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  stop = stop_ids(tokenizer)[0]
  turns = [tokenizer.encode(t, add_special_tokens=False) + [stop] for t in ("no idea", "5", "11")]
  envs = {"in_process": OpenEnvEnv(GuessNumberEnvironment()),
          "served": ServedOpenEnv(url)}
  for name, env in envs.items():
    rewards, cpu, wall = [], resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for seed in range(episodes):
      script = iter(turns)
      result = run_episode(env, seed, seed, tokenizer, lambda ids, budget: next(script), max_turns=3,
                           max_turn_tokens=16, max_context=1024)
      rewards.append(result.reward)
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime   # both threads: client and server
    print(json.dumps({"layout": name, "episodes": episodes, "turns_per_episode": 3, "wall_s": round(wall, 3),
                      "cpu_s": round(cpu, 3), "ms_per_episode": round(1e3 * wall / episodes, 2),
                      "reward_sum": round(sum(rewards), 6)}))
  server.should_exit = True


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
