"""Enums, PerReplica and SyncOnRead."""

import copy
import dataclasses
import operator
import pickle
import typing

import flax.struct
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


class Batch(typing.NamedTuple):
    image: np.ndarray
    label: np.ndarray


@flax.struct.dataclass
class Pair:
    image: np.ndarray
    label: np.ndarray
    name: str = flax.struct.field(pytree_node=False, default="pair")


@dataclasses.dataclass
class Plain:
    image: np.ndarray
    label: np.ndarray


jax.tree_util.register_dataclass(Plain, data_fields=["image", "label"], meta_fields=[])


def _batch_items(n):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4, 3)).astype(np.float32), np.arange(n * 4).reshape(n, 4)


@pytest.mark.parametrize("kind", ["dict", "tuple", "list", "namedtuple", "struct", "dataclass"])
def test_per_replica_items_are_per_replica_without_a_copy(kind, n):
    image, label = _batch_items(n)
    container = {
        "dict": lambda: {"image": image, "label": label},
        "tuple": lambda: (image, label),
        "list": lambda: [image, label],
        "namedtuple": lambda: Batch(image, label),
        "struct": lambda: Pair(image, label),
        "dataclass": lambda: Plain(image, label),
    }[kind]()
    batch = jm.PerReplica(container)
    if kind == "dict":
        items = batch["image"], batch["label"]
    elif kind in ("tuple", "list", "namedtuple"):
        items = batch[0], batch[-1]
        first, second = batch  # unpacks into the PerReplica of each item
        assert first.values is image and second.values is label
    else:
        items = batch.image, batch.label
    if kind == "namedtuple":
        assert batch.image.values is image and batch.label.values is label
    for item, expected in zip(items, (image, label)):
        assert isinstance(item, jm.PerReplica)
        assert item.values is expected  # the same leaf array: no copy


def test_per_replica_item_runs_like_the_leaf(strategy, n):
    image, label = _batch_items(n)
    batch = jm.PerReplica({"image": jax.device_put(image), "label": label})
    step = jm.replicate(lambda x: x * 2)
    out = step(batch["image"])
    np.testing.assert_allclose(np.stack(strategy.local_results(out)), image * 2)


def test_per_replica_missing_items_name_what_is_there(n):
    image, label = _batch_items(n)
    with pytest.raises(KeyError, match=r"no item 'imagee'.*\['image', 'label'\]"):
        jm.PerReplica({"image": image, "label": label})["imagee"]
    with pytest.raises(IndexError, match="2 items"):
        jm.PerReplica((image, label))[2]
    with pytest.raises(AttributeError, match=r"'imagee'.*\('image', 'label'\)"):
        _ = jm.PerReplica(Batch(image, label)).imagee
    with pytest.raises(AttributeError, match="'image'.*dict"):
        _ = jm.PerReplica({"image": image}).image  # a dict's keys are items, not attributes
    with pytest.raises(TypeError, match=r"local_results\(x\)\[i\]"):
        jm.PerReplica(image)[0]
    with pytest.raises(TypeError, match="not iterable"):
        iter(jm.PerReplica({"image": image}))
    leaf = jm.PerReplica(image)
    assert not hasattr(leaf, "shape") and not hasattr(leaf, "dtype")
    assert not hasattr(leaf, "__jax_array__") and not hasattr(leaf, "_fields")


def test_per_replica_keeps_pickle_copy_and_pytree_behaviour(n):
    image, label = _batch_items(n)
    batch = jm.PerReplica(Batch(image, label))
    for other in (pickle.loads(pickle.dumps(batch)), copy.copy(batch), copy.deepcopy(batch)):
        assert isinstance(other, jm.PerReplica)
        np.testing.assert_array_equal(other.values.image, image)
        np.testing.assert_array_equal(other.image.values, image)
    leaves, treedef = jax.tree.flatten(batch)
    assert leaves[0] is image and leaves[1] is label
    assert jax.tree.unflatten(treedef, leaves).label.values is label
    assert not dataclasses.is_dataclass(batch)
    pair = jm.PerReplica(Pair(image, label))
    assert dataclasses.replace(pair.values, name="other").name == "other"
    assert repr(batch) == f"PerReplica(Batch(image=({n}, 4, 3), label=({n}, 4)))"


@pytest.mark.parametrize(
    "convert",
    [float, int, bool, complex, operator.index, lambda x: f"{x:.3f}", lambda x: format(x, "d")],
    ids=["float", "int", "bool", "complex", "index", "fstring", "format"],
)
def test_per_replica_has_no_single_number(convert, n):
    x = jm.PerReplica(np.arange(n, dtype=np.float32))
    with pytest.raises(TypeError) as info:
        convert(x)
    for fix in ("strategy.reduce(op, x)", "strategy.gather(x)", "strategy.local_results(x)"):
        assert fix in str(info.value)
    assert f"{x}" == repr(x)  # no format spec: the repr
