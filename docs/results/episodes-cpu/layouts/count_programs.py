"""The programs data.batches.TreeLayouts compiles for a sequence of stacked layouts (JSON lines with "stacked"),
at several max_cost, and the level positions they compute:
  python docs/results/episodes-cpu/layouts/count_programs.py FILE.jsonl"""
import json, sys
sys.path.insert(0, '.')
from branch_replay_jax.data.batches import TreeLayouts
rows = [json.loads(l) for l in open(sys.argv[1])]
def layout(r):
  st = r["stacked"]
  return (tuple(l[i] for i, l in enumerate(st)), tuple(l[-1] for l in st), 8)
distinct = set()
for mc in (1.0, 1.5, 2.0, 3.0, 4.0):
  tl = TreeLayouts(mc); compiled = set(); pos = 0; need = 0
  for r in rows:
    lay = layout(r); distinct.add(lay)
    ch = tl.choose(lay); compiled.add(ch); pos += TreeLayouts.cost(ch); need += TreeLayouts.cost(lay)
  print(f"max_cost={mc}: programs={len(compiled)} positions={pos} (own layouts {need}, x{pos/need:.2f})")
print("distinct own layouts:", len(distinct))
