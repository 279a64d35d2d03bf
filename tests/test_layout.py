"""The package's import graph: no module imports another module's underscore name, and imports
flow one way through the layers (docs/design.md, "Layers")."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "branch_replay_jax")

# Layer of each subpackage (or top-level module), lowest first: a module may import from its own
# layer or a lower one, never from a higher one. kernels/ installs as branch_replay_jax.kernels.
LAYERS = [
    {"data", "losses", "correction"},
    {"core"},
    {"kernels", "models"},
    {"distributed"},   # the mesh and its shard_map wrapper know no model output and no algorithm
    {"gradients", "rollout", "outputs"},
    {"algorithms"},
    {"benchmarks", "main", "export"},
]


def _modules():
  """(dotted module name, path) of every Python file of the package and of kernels/."""
  for base, dotted in ((PACKAGE, "branch_replay_jax"), (os.path.join(ROOT, "kernels"), "branch_replay_jax.kernels")):
    for dirpath, _, files in os.walk(base):
      for f in sorted(files):
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
          name = dotted if rel == "__init__" else dotted + "." + rel.removesuffix(".__init__")
          yield name, os.path.join(dirpath, f)


def _imports(path):
  """(imported module, imported name or None, line) of every import statement in a file."""
  tree = ast.parse(open(path).read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        yield node.module, alias.name, node.lineno
    elif isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, None, node.lineno


def _layer(module: str) -> int | None:
  parts = module.split(".")
  if parts[0] != "branch_replay_jax" or len(parts) < 2:
    return None
  for i, layer in enumerate(LAYERS):
    if parts[1] in layer:
      return i
  raise AssertionError(f"{module}: not in any layer of tests/test_layout.py's LAYERS; add it")


def _private_attributes(path, modules):
  """(alias, attribute, line) of every `alias._name` where alias names a module of the package
  (`from branch_replay_jax.x import y as alias`, `import branch_replay_jax.x as alias`)."""
  tree = ast.parse(open(path).read(), path)
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        if f"{node.module}.{a.name}" in modules:
          aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name in modules and a.asname:
          aliases[a.asname] = a.name
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
        and node.attr.startswith("_") and not node.attr.startswith("__")):
      yield aliases[node.value.id], node.attr, node.lineno


def test_no_module_imports_another_modules_private_name():
  modules = dict(_modules())
  bad = []
  for name, path in modules.items():
    for module, imported, line in _imports(path):
      if module.startswith("branch_replay_jax") and module != name:
        private = [p for p in module.split(".") if p.startswith("_") and p != "__init__"]
        if private or (imported is not None and imported.startswith("_")):
          bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module}.{imported or ''}")
    for module, attr, line in _private_attributes(path, modules):
      if module != name:
        bad.append(f"{os.path.relpath(path, ROOT)}:{line} reads {module}.{attr}")
  assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_imports_flow_one_way_through_the_layers():
  bad = []
  for name, path in _modules():
    own = _layer(name)
    if own is None:
      continue
    for module, _, line in _imports(path):
      other = _layer(module)
      if other is not None and other > own:
        bad.append(f"{os.path.relpath(path, ROOT)}:{line} ({name}, layer {own}) imports {module} (layer {other})")
  assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_every_module_is_in_a_layer():
  names = {n.split(".")[1] for n, _ in _modules() if n.count(".") >= 1}
  assert names <= set().union(*LAYERS), sorted(names - set().union(*LAYERS))
