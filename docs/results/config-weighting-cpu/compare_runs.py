import json, sys, filecmp
a, b = sys.argv[1], sys.argv[2]
timing = lambda k: k.endswith("_s") or k.endswith("_per_s") or "wall" in k or "throughput" in k
def recs(d):
  return [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
ra, rb = recs(a), recs(b)
assert len(ra) == len(rb), (len(ra), len(rb))
n = 0
for x, y in zip(ra, rb):
  kx = {k for k in x if not timing(k)}; ky = {k for k in y if not timing(k)}
  assert kx == ky, kx ^ ky
  for k in sorted(kx):
    assert x[k] == y[k], (x["step"], k, x[k], y[k])
    n += 1
print(f"metrics.jsonl: {len(ra)} records, {n} non-timing fields equal; dropped: {sorted(k for k in ra[0] if timing(k))}")
print("samples.jsonl byte-identical:", filecmp.cmp(f"{a}/samples.jsonl", f"{b}/samples.jsonl", shallow=False))
