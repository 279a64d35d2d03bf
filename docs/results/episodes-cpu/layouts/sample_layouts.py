"""Sample a calculator run's step trees with the initial policy (no update) and print each step's own tree
layouts, one JSON line per step:  PYTHONPATH=. python docs/results/episodes-cpu/layouts/sample_layouts.py STEPS"""
import json, sys, tempfile
from experiments import grpo_smollm2_calc
from branch_replay_jax.algorithms import grpo, runs
cfg = grpo_smollm2_calc.get_config()
cfg.eval.size = 0
cfg.run_dir = tempfile.mkdtemp()
alg = grpo.GRPO(cfg)
run = runs.start_run(cfg, alg.fingerprint(), optimizer_fn=lambda _: alg.make_optimizer(), wrap=alg.wrap, keep_initial=True)
params, opt = alg.setup(run)
pos = 0
for step in range(int(sys.argv[1])):
  groups, pos = alg.collect(run, params, step, pos)
  rec = {"step": step, "trees": [[list(l.tokens.shape) for l in g.batch.levels] if g.kind == "tree" else ["rows", list(g.batch.branches.tokens.shape)] for g in groups],
         "prompt": [int(g.batch.prompt_ids.shape[0]) for g in groups],
         "nodes": [[len(g.batch.levels)] for g in groups]}
  print(json.dumps(rec), flush=True)
