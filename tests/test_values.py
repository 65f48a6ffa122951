"""Enums, PerReplica and SyncOnRead."""

import dataclasses

import jax
import numpy as np
import pytest

import jmirror as jm

ENUMS = [
    (jm.ReduceOp, ["sum", "mean", "max", "min"]),
    (jm.Aggregation, ["none", "sum", "mean", "only_first_replica"]),
    (jm.Synchronization, ["auto", "on_write", "on_read", "none"]),
]


@pytest.mark.parametrize("enum, values", ENUMS)
def test_enum_values_are_lowercase_strings(enum, values):
    assert [m.value for m in enum] == values
    for member in enum:
        assert enum(member.value) is member
        assert enum(member.value.upper()) is member
        assert enum(member.name.title()) is member
        assert member == member.value


@pytest.mark.parametrize("enum, values", ENUMS)
@pytest.mark.parametrize("bad", ["bogus", 1, None, 2.5])
def test_enum_rejects_other_values_listing_valid_ones(enum, values, bad):
    with pytest.raises(ValueError) as info:
        enum(bad)
    for v in values:
        assert repr(v) in str(info.value)


def test_per_replica_is_a_pytree_node():
    p = jm.PerReplica({"a": np.zeros((2, 3)), "b": np.ones((2,))})
    leaves, treedef = jax.tree.flatten(p)
    assert len(leaves) == 2
    q = jax.tree.unflatten(treedef, [x + 1 for x in leaves])
    assert isinstance(q, jm.PerReplica)
    np.testing.assert_array_equal(q.values["b"], np.full((2,), 2.0))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(p)[0]]
    assert paths == [".values['a']", ".values['b']"]


def test_sync_on_read_is_a_pytree_with_static_aggregation():
    s = jm.SyncOnRead(np.zeros(3), "MEAN")
    assert s.aggregation is jm.Aggregation.MEAN
    leaves, treedef = jax.tree.flatten(s)
    assert len(leaves) == 1
    t = jax.tree.unflatten(treedef, [leaves[0] + 1])
    assert t.aggregation is jm.Aggregation.MEAN
    r = s.replace(np.ones(2))
    assert r.aggregation is jm.Aggregation.MEAN and r.value.shape == (2,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.value = 1
    with pytest.raises(ValueError):
        jm.SyncOnRead(0.0, "average")
    # Different aggregations are different tree structures.
    assert jax.tree.structure(s) != jax.tree.structure(jm.SyncOnRead(np.zeros(3), "sum"))


def test_value_context_defaults():
    assert jm.ValueContext() == jm.ValueContext(replica_id=0, num_replicas=1)
