"""The dtype of a reduction: `jm.all_reduce(..., dtype=)` and `jm.shard_update(reduce_dtype=)`,
checked in the lowered step and against a hand cast under `jax.vmap` with an axis name."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmirror as jm
import jmirror.testing as jmt

_LOWERED_OP = re.compile(
    r'"stablehlo\.(?P<op>all_reduce|reduce_scatter)"\(.*?\}\) : \((?P<types>[^)]*)\) ->',
    re.DOTALL,
)
_ELEMENT = re.compile(r"tensor<(?:[\dx]*x)?(\w+)>")


def lowered_operand_dtypes(lowered, op):
    """The element types of `op`'s operands in the lowered (StableHLO) step, in order."""
    return [
        _ELEMENT.search(t).group(1)
        for m in _LOWERED_OP.finditer(lowered.as_text())
        if m.group("op") == op
        for t in m.group("types").split(", ")
    ]


def bf16_tree(n):
    """Per-replica bfloat16 values whose sums are exact in float32 but not in bfloat16: each
    has 8 significant bits, so a float32 sum of n of them loses nothing."""
    rng = np.random.default_rng(0)
    grid = lambda *shape: (1 + rng.integers(0, 128, shape) / 128).astype(jnp.bfloat16)  # noqa: E731
    return {"w": grid(n, 6, 3), "b": grid(n, 3), "count": np.arange(n, dtype=np.int32)}


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_all_reduce_in_float32_equals_a_hand_cast(strategy, n, op):
    tree = bf16_tree(n)
    out = strategy.run(
        lambda t: jm.all_reduce(op, t, dtype=jnp.float32), args=(jm.PerReplica(tree),)
    )
    raw = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax}[op]

    def hand_cast(t):
        wide = {k: t[k].astype(jnp.float32) for k in ("w", "b")}
        reduced = {k: raw(v, "i").astype(jnp.bfloat16) for k, v in wide.items()}
        count = lax.psum(t["count"], "i")
        return {**reduced, "count": count / n if op == "mean" else raw(t["count"], "i")}

    expected = jax.vmap(hand_cast, axis_name="i")(tree)
    for path, got in jax.tree_util.tree_flatten_with_path(out)[0]:
        want = jax.tree_util.tree_flatten_with_path(expected)[0]
        want = dict((jax.tree_util.keystr(p), w[0]) for p, w in want)[jax.tree_util.keystr(path)]
        assert strategy.topology.is_mirrored(got)
        assert got.dtype == want.dtype, path  # each leaf comes back in its own dtype
        np.testing.assert_array_equal(np.asarray(strategy.read(got)), np.asarray(want))


def test_all_reduce_operands_have_the_dtype_in_the_lowered_step(strategy, n):
    tree = jm.PerReplica(bf16_tree(n))

    def step(t, dtype):
        return jm.all_reduce("mean", t, dtype=dtype)

    for dtype, floating in ((jnp.float32, "f32"), (None, "bf16")):
        lowered = jm.replicate(lambda t, dtype=dtype: step(t, dtype), strategy=strategy).lower(tree)
        found = lowered_operand_dtypes(lowered, "all_reduce")
        assert sorted(found) == sorted([floating, floating, "i32"]), found
        if n > 1:
            ops = jmt.collectives(lowered)
            assert {c.op for c in ops} == {"all-reduce"}
            wide = np.dtype(jnp.float32 if dtype else jnp.bfloat16)
            assert sorted(str(d) for c in ops for d in c.dtypes) == sorted(
                [str(wide)] * 2 + ["int32"]
            )


def test_all_reduce_in_bfloat16_narrows_float32_leaves(strategy, n):
    x = np.linspace(1.0, 2.0, n * 4, dtype=np.float32).reshape(n, 4)
    replicated = jm.replicate(
        lambda x: jm.replica_context().all_reduce("sum", x, dtype=jnp.bfloat16), strategy=strategy
    )
    lowered = replicated.lower(jm.PerReplica(x))
    assert lowered_operand_dtypes(lowered, "all_reduce") == ["bf16"]
    if n > 1:
        (entry,) = jmt.collectives(lowered)
        assert entry.dtype == jnp.bfloat16 and entry.bytes == 4 * 2
    out = replicated(jm.PerReplica(x))
    narrow = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    # The hand cast: each replica's value in bfloat16, their sum as one bfloat16 number.
    expected = jax.vmap(lambda v: narrow(lax.psum(narrow(v), "i")), axis_name="i")(x)[0]
    got = np.asarray(strategy.read(out))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(narrow(got), got)  # it went through bfloat16
    # XLA:CPU adds bfloat16 in float32 and rounds once, as the oracle does; a device that
    # adds in bfloat16 may round at every addition.
    np.testing.assert_allclose(got, expected, rtol=2**-6)
    assert not np.array_equal(got, x.sum(0))  # float32 would have kept the low bits


@pytest.mark.parametrize("dtype", [jnp.int32, "not a dtype"])
def test_a_reduction_dtype_that_is_not_floating_is_a_type_error(strategy, dtype):
    with pytest.raises(TypeError, match=r"dtype=.*expects a floating dtype"):
        strategy.run(lambda: jm.all_reduce("sum", jnp.ones(2), dtype=dtype))
    with pytest.raises(TypeError, match=r"reduce_dtype=.*expects a floating dtype"):
        jm.shard_update(optax.sgd(0.1), reduce_dtype=dtype)


# --- jm.shard_update(reduce_dtype=) --------------------------------------------------------------

SHAPES = {"w": (7, 3), "b": (3,)}


def sharded_step(strategy, tx):
    @jm.replicate(strategy=strategy)
    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def bf16_params():
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal(s).astype(jnp.bfloat16) for k, s in SHAPES.items()}


@pytest.mark.parametrize("reduce_dtype", [jnp.float32, None])
def test_shard_update_reduce_scatters_in_reduce_dtype(strategy, n, reduce_dtype):
    tx = jm.shard_update(optax.sgd(0.5), reduce_dtype=reduce_dtype)
    params = strategy.mirror(bf16_params())
    state = tx.init(params)
    x = jm.PerReplica(np.random.default_rng(2).standard_normal((n, 4, 7)).astype(jnp.bfloat16))
    lowered = sharded_step(strategy, tx).lower(params, state, x)
    wire = "f32" if reduce_dtype is not None else "bf16"
    assert lowered_operand_dtypes(lowered, "reduce_scatter") == [wire]
    if n > 1:
        (scatter,) = [c for c in jmt.collectives(lowered) if c.op == "reduce-scatter"]
        assert scatter.dtype == np.dtype(jnp.float32 if reduce_dtype else jnp.bfloat16)


def test_shard_update_in_float32_equals_a_hand_cast(strategy, n):
    # Oracle: every replica's bfloat16 gradients averaged in float32 and cast back to
    # bfloat16 before the inner SGD, under jax.vmap with an axis name.
    tx = jm.shard_update(optax.sgd(0.5), reduce_dtype=jnp.float32)
    params = bf16_params()
    x = np.random.default_rng(3).standard_normal((n, 4, 7)).astype(jnp.bfloat16)
    placed = strategy.mirror(params)
    new, _ = sharded_step(strategy, tx)(placed, tx.init(placed), jm.PerReplica(x))

    def oracle(params, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        grads = jax.tree.map(lambda g: lax.pmean(g.astype(jnp.float32), "i").astype(g.dtype), grads)
        updates, _ = optax.sgd(0.5).update(grads, optax.sgd(0.5).init(params), params)
        return optax.apply_updates(params, updates)

    expected = jax.vmap(oracle, in_axes=(None, 0), axis_name="i")(params, x)
    for got, want in zip(jax.tree.leaves(strategy.read(new)), jax.tree.leaves(expected)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want[0], np.float32), rtol=1e-2, atol=1e-2
        )


@pytest.mark.skipif(len(jax.devices()) < 8, reason="replicas spanning 2 devices need 8 devices")
def test_reductions_in_a_dtype_across_replicas_spanning_devices():
    # XLA:CPU's promotion of bfloat16 all-reduces aborted the process on the collectives of
    # replicas spanning devices.
    strategy = jm.MirroredStrategy(devices_per_replica=2)
    n = strategy.num_replicas
    test_all_reduce_in_bfloat16_narrows_float32_leaves(strategy, n)
    test_shard_update_in_float32_equals_a_hand_cast(strategy, n)
    tx = jm.shard_update(optax.sgd(0.5), reduce_dtype=jnp.bfloat16)
    params = {k: v.astype(np.float32) for k, v in bf16_params().items()}
    x = np.random.default_rng(3).standard_normal((n, 4, 7)).astype(np.float32)
    placed = strategy.mirror(params)
    step = sharded_step(strategy, tx)
    lowered = step.lower(placed, tx.init(placed), jm.PerReplica(x))
    assert lowered_operand_dtypes(lowered, "reduce_scatter") == ["bf16"]
    new, _ = step(placed, tx.init(placed), jm.PerReplica(x))

    def oracle(params, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        narrow = lambda g: g.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
        grads = jax.tree.map(lambda g: narrow(lax.pmean(narrow(g), "i")), grads)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    expected = jax.vmap(oracle, in_axes=(None, 0), axis_name="i")(params, x)
    for got, want in zip(jax.tree.leaves(strategy.read(new)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want[0]), rtol=1e-2, atol=1e-2)
