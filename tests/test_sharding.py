"""Parameter layouts by annotation (distributed/sharding.py): each parameter's logical axis names, through
one rules table, give its PartitionSpec; attribute names play no part. Specs only: no step runs here
(the FSDP step's exactness is tests/test_mesh.py's)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from branch_replay_jax.distributed.mesh import make_mesh
from branch_replay_jax.distributed.sharding import LOGICAL_AXIS_RULES, MESH_AXES, param_specs, shard_params
from branch_replay_jax.models import Llama, lora, tiny_config
from branch_replay_jax.models.critic import ActorCritic
from branch_replay_jax.models.llama import AXES_KEY, LOGICAL_AXES, annotated

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

ALL = MESH_AXES   # fsdp splits one dimension over every mesh axis
is_spec = lambda x: isinstance(x, P)


def _specs(tree, mesh, mode="fsdp", rules=None) -> dict:
  """{dotted path: spec} of `param_specs`'s leaves."""
  out = param_specs(tree, mesh, mode, rules)
  return {".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path if getattr(k, "name", None) != "value"): s
          for path, s in jax.tree_util.tree_flatten_with_path(out, is_leaf=is_spec)[0]}


def _module(attribute: str):
  """A module with one parameter [16, 8] annotated ("layers", "embed"), stored under `attribute`."""
  class Stack(nnx.Module):
    def __init__(self):
      setattr(self, attribute, annotated(jnp.zeros((16, 8)), ("layers", "embed")))
  return Stack()


@pytest.mark.parametrize("attribute", ["stack", "embed", "layers", "w_gate"])
def test_a_parameters_layout_follows_its_annotation_not_its_attribute_name(attribute):
  # [16, 8] ("layers", "embed") on 8 devices: "layers" has no fsdp rule, so the larger dimension 16
  # stays whole and "embed" (8) is split: P(None, all mesh axes), whatever the attribute is called
  # (a name-matching rule would split the largest dimension of any name outside "layers.*").
  _, state = nnx.split(_module(attribute))
  assert _specs(state, make_mesh(8, 1)) == {attribute: P(None, ALL)}


def test_the_rules_table_moves_the_split():
  # The tiny model's w_gate [L=2, d=32, F=48] is (layers, embed, mlp). The fsdp table tries "mlp"
  # before "embed": P(None, None, all) (48 % 8 == 0). A table with "embed" alone splits d instead;
  # one mapping "mlp" to "data" and "embed" to ("branch", "seq") on 2x2x2 splits both, each over its
  # own axes; a table naming only a dimension w_gate lacks ("vocab") leaves it whole, as "replicated" does.
  _, state = nnx.split(Llama(tiny_config(), rngs=nnx.Rngs(0)))
  mesh = make_mesh(8, 1)
  assert _specs(state, mesh)["layers.w_gate"] == P(None, None, ALL)
  assert _specs(state, mesh, rules=(("embed", ALL),))["layers.w_gate"] == P(None, ALL)
  cube = make_mesh(2, 2, 2)
  both = (("mlp", ("data",)), ("embed", ("branch", "seq")))
  assert _specs(state, cube, rules=both)["layers.w_gate"] == P(None, ("branch", "seq"), "data")
  assert _specs(state, mesh, rules=(("vocab", ALL),))["layers.w_gate"] == P()
  assert _specs(state, mesh, "replicated")["layers.w_gate"] == P()
  # The fallback: F = 20 is not divisible by 8, so fsdp's "mlp" rule is skipped and "embed" (32) is split.
  _, odd = nnx.split(Llama(tiny_config(ffn_dim=20), rngs=nnx.Rngs(0)))
  assert _specs(odd, mesh)["layers.w_gate"] == P(None, ALL)
  assert _specs(odd, mesh, rules=(("mlp", ALL),))["layers.w_gate"] == P()
  with pytest.raises(ValueError, match=r"rules name \['ffn'\]"):
    param_specs(state, mesh, "fsdp", rules=(("ffn", ALL),))


def _every_option_model():
  """An actor-critic with a separate critic over a Llama with qkv biases, q/k norms, an untied head and
  LoRA adapters on every projection: every kind of parameter the models define."""
  policy = Llama(tiny_config(qkv_bias=True, qk_norm=True, tie_embeddings=False), rngs=nnx.Rngs(0))
  lora.add_adapters(policy, lora.LoraSpec(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
  return ActorCritic(policy, critic="separate")


def test_every_parameter_of_the_models_carries_logical_axis_names():
  # 2 trunks x (embed, final_norm, lm_head + 14 layer parameters + 14 adapters) + value_w, value_b
  # = 2 x 31 + 2 = 64 parameters, each with one known logical name per dimension; fsdp on 8 devices
  # then splits every one but the scalar value_b (each has a dimension 8 divides).
  _, state = nnx.split(_every_option_model())
  variables = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert len(variables) == 64
  for v in variables:
    names = v.get_metadata(AXES_KEY)
    assert len(names) == v.ndim and set(names) <= set(LOGICAL_AXES), (names, v.shape)
  specs = _specs(state, make_mesh(8, 1))
  assert [k for k, s in specs.items() if s == P()] == ["value_b"]
  assert specs["policy.layers.wq_lora_b"] == P(None, None, None, ALL)   # [L, r=4, Hq=4, D=8]: head_dim
  assert specs["critic.lm_head"] == P(None, ALL)                         # [d, V]: vocab


def test_an_unannotated_parameter_is_refused_by_name_when_sharded():
  # nnx.Param without logical names, an array outside any Variable, names that do not fit: ValueError
  # naming the parameter, for fsdp; "replicated" splits nothing and takes them as they are.
  class Plain(nnx.Module):
    def __init__(self):
      self.head = annotated(jnp.zeros((8,)), ("embed",))
      self.w = nnx.Param(jnp.zeros((8, 8)))
  _, state = nnx.split(Plain())
  mesh = make_mesh(8, 1)
  with pytest.raises(ValueError, match=r"parameter 'w' \(shape \(8, 8\)\) carries no logical axis names"):
    param_specs(state, mesh, "fsdp")
  with pytest.raises(ValueError, match=r"parameter 'w' \(shape \(8, 8\)\) carries no logical axis names"):
    shard_params(state, mesh, "fsdp")
  assert _specs(state, mesh, "replicated") == {"head": P(), "w": P()}
  with pytest.raises(ValueError, match=r"array 'x.w' \(shape \(8,\)\) is not an nnx.Variable"):
    param_specs({"x": {"w": jnp.zeros(8)}}, mesh, "fsdp")
  with pytest.raises(ValueError, match="one per dimension"):
    annotated(jnp.zeros((8, 8)), ("embed",))
  with pytest.raises(ValueError, match="one per dimension"):
    annotated(jnp.zeros((8,)), ("hidden",))


def test_optimizer_state_takes_its_parameters_specs_inside_multi_transform():
  # PPO's optimizer: optax.multi_transform with labels "policy" / "critic" (algorithms/ppo.py) over
  # Adam. Each label's first and second moments hold that label's parameters, and get exactly
  # their specs (carried by the parameters' nnx.Variable nodes, no path read); the step counts
  # are scalars, replicated.
  _, state = nnx.split(_every_option_model())
  label = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "policy" if path[0].key == "policy" else "critic", params)
  tx = optax.multi_transform({"policy": optax.adam(1e-3), "critic": optax.adam(1e-3)}, label)
  mesh = make_mesh(8, 1)
  param = param_specs(state, mesh, "fsdp")
  opt = param_specs(jax.eval_shape(tx.init, state), mesh, "fsdp")
  for name, keep in (("policy", lambda k: k == "policy"), ("critic", lambda k: k != "policy")):
    want = [s for k, sub in param.items() if keep(k)
            for s in jax.tree_util.tree_leaves(sub, is_leaf=is_spec)]
    adam = opt.inner_states[name].inner_state[0]
    for moment in (adam.mu, adam.nu):
      assert jax.tree_util.tree_leaves(moment, is_leaf=is_spec) == want
    assert adam.count == P()
  assert sum(s != P() for s in jax.tree_util.tree_leaves(opt, is_leaf=is_spec)) == 2 * 63   # mu and nu, all but value_b


def test_fsdp_rules_table_splits_every_dimension_over_all_mesh_axes_and_never_layers():
  # The table's contract (docs/design.md, "Mesh and sharding"): fsdp maps every logical name but
  # "layers" to all of ("data", "branch", "seq"); replicated maps none.
  assert LOGICAL_AXIS_RULES["replicated"] == ()
  names = [n for n, axes in LOGICAL_AXIS_RULES["fsdp"]]
  assert set(names) == set(LOGICAL_AXES) - {"layers"} and len(names) == len(set(names))
  assert all(axes == ("data", "branch", "seq") for _, axes in LOGICAL_AXIS_RULES["fsdp"])
