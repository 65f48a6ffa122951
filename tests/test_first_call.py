"""The first call of a replicated step traces the replica function's equations as often as a
hand-written `jax.jit(jax.shard_map(...))` of the same function does."""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import jmirror as jm


def counted_primitive():
    """Returns a primitive `x -> 2 x` and the list its abstract evaluation appends to (once
    for each time an equation of it is traced)."""
    traced = []
    prim = jex.Primitive("jmirror_test_counted")
    prim.def_impl(lambda x: 2 * x)

    def abstract(x):
        traced.append(x)
        return x

    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))
    return prim, traced


def replica_fn(prim):
    def step(x):
        return jm.all_reduce("sum", prim.bind(x) + 1.0)

    return step


def test_first_call_traces_each_equation_as_often_as_jit_of_shard_map(strategy, n):
    prim, traced = counted_primitive()
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)

    hand = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(prim.bind(v[0]) + 1.0, strategy.axis_name),
            mesh=strategy.mesh,
            in_specs=P(strategy.axis_name),
            out_specs=P(),
            check_vma=False,
        )
    )
    expected = np.asarray(hand(jnp.asarray(x)))
    hand_traces = len(traced)
    del traced[:]

    got = jm.replicate(replica_fn(prim), strategy=strategy)(jm.PerReplica(x))

    np.testing.assert_allclose(np.asarray(got), expected)
    np.testing.assert_allclose(expected, (2 * x + 1.0).sum(axis=0))
    assert len(traced) <= hand_traces, (
        f"jm.replicate traced the equation {len(traced)} times, jit(shard_map) {hand_traces}"
    )
