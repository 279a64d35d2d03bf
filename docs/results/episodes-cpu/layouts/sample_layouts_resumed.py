"""Resume a calculator run from RUN_DIR's checkpoint and sample STEPS more steps without updating: each step's
trees and their stacked layout (data.batches.pad_trees):
  PYTHONPATH=. python docs/results/episodes-cpu/layouts/sample_layouts_resumed.py RUN_DIR STEPS"""
import json, sys, shutil, tempfile
from experiments import grpo_smollm2_calc
from branch_replay_jax.algorithms import grpo, runs
from branch_replay_jax.data.batches import pad_trees
cfg = grpo_smollm2_calc.get_config()
cfg.eval.size = 0
d = tempfile.mkdtemp(); shutil.rmtree(d); shutil.copytree(sys.argv[1], d)
cfg.run_dir = d; cfg.resume = True; cfg.train.steps = 30
alg = grpo.GRPO(cfg)
run = runs.start_run(cfg, alg.fingerprint(), optimizer_fn=lambda _: alg.make_optimizer(), wrap=alg.wrap, keep_initial=True)
params, opt = alg.setup(run)
pos = run.data_pos
for step in range(run.start, run.start + int(sys.argv[2])):
  groups, pos = alg.collect(run, params, step, pos)
  trees = [g.batch for g in groups]
  own = [[list(l.tokens.shape) for l in t.levels] for t in trees]
  padded = pad_trees(trees)
  print(json.dumps({"step": step, "own": own, "stacked": [list(l.tokens.shape) for l in padded[0].levels]}), flush=True)
