"""jm.replicate / strategy.run: splitting, typing of outputs, gradients, compilation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmirror as jm

N = jax.device_count()
ROTATE = [(i, (i + 1) % N) for i in range(N)]


def vmap_oracle(fn, n, in_axes, axis_name="replica"):
    """The independent oracle: N replicas as a vmap with the replica axis name."""
    return jax.vmap(fn, in_axes=in_axes, axis_name=axis_name, axis_size=n)


def is_mirrored(strategy, x):
    return isinstance(x, jax.Array) and strategy.topology.is_mirrored(x)


def test_replica_ids_are_seen_once_each(strategy, n):
    ids = strategy.run(jm.replica_id)
    assert isinstance(ids, jm.PerReplica)
    assert sorted(int(i) for i in strategy.local_results(ids)) == list(range(n))
    assert [int(i) for i in strategy.local_results(ids)] == list(range(n))


def test_per_replica_inputs_are_split_and_others_broadcast(strategy, n):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)

    def fn(per, mirrored, host, scalar, *, kw):
        return per * mirrored + host + scalar + kw

    w = strategy.mirror(np.full(3, 2.0, np.float32))
    out = strategy.run(
        fn, args=(jm.PerReplica(x), w, np.ones(3, np.float32), 1.5), kwargs={"kw": 0.5}
    )
    assert isinstance(out, jm.PerReplica)
    np.testing.assert_allclose(out.values, x * 2.0 + 1.0 + 1.5 + 0.5)


def test_arrays_committed_to_other_devices_are_moved(n):
    if n < 2:
        pytest.skip("needs two devices")
    small = jm.MirroredStrategy(num_devices=n // 2)
    other = jax.local_devices()[-1]
    host = jax.device_put(np.arange(3.0, dtype=np.float32), other)
    per = jm.PerReplica(jax.device_put(np.ones((n // 2, 3), np.float32), other))
    out = small.run(lambda a, b: a + b, args=(host, per))
    assert isinstance(out, jm.PerReplica)
    np.testing.assert_array_equal(out.values, np.arange(3.0) + np.ones((n // 2, 3)))
    assert out.values.sharding.device_set == set(small.devices)


def test_function_of_no_arguments(strategy, n):
    out = strategy.run(lambda: jnp.arange(3.0))
    assert is_mirrored(strategy, out)
    np.testing.assert_array_equal(strategy.read(out), np.arange(3.0))
    assert strategy.run(lambda: None) is None


@pytest.mark.parametrize(
    "body, mirrored",
    [
        (lambda x, w, k: w * 2, True),  # only mirrored inputs
        (lambda x, w, k: w, True),  # a mirrored input returned as it is
        (lambda x, w, k: jnp.ones(3), True),  # a constant
        (lambda x, w, k: x, False),  # a per-replica input
        (lambda x, w, k: x * w, False),
        (lambda x, w, k: lax.psum(x, "replica"), True),
        (lambda x, w, k: lax.pmean(x * w, "replica") + w, True),
        (lambda x, w, k: lax.pmax(x, "replica"), True),
        (lambda x, w, k: lax.all_gather(x, "replica"), True),
        (lambda x, w, k: lax.psum(x, "replica") + x, False),
        (lambda x, w, k: w * lax.axis_index("replica"), False),
        (lambda x, w, k: lax.psum(w * lax.axis_index("replica"), "replica"), True),
        (lambda x, w, k: jax.random.normal(k, (3,)), True),  # mirrored key
        # Conservative: a permutation is taken to vary even when its input is identical.
        (lambda x, w, k: lax.ppermute(w, "replica", ROTATE), False),
        (lambda x, w, k: lax.cond(w[0] > 0, lambda: w, lambda: -w), True),
        (lambda x, w, k: lax.cond(x[0] > 0, lambda: w, lambda: -w), False),
        (lambda x, w, k: lax.fori_loop(0, 3, lambda i, c: c + w, w), True),
        (lambda x, w, k: lax.fori_loop(0, 3, lambda i, c: c + x, w), False),
        # The carry starts identical and becomes per-replica on a later iteration.
        (lambda x, w, k: lax.scan(lambda c, _: (x * 0 + c[::-1], None), w, None, 3)[0], False),
        # A loop whose trip count differs per replica, although its body adds identical values.
        (lambda x, w, k: lax.while_loop(lambda c: c[0] < x[0], lambda c: c + 1.0, w), False),
        (lambda x, w, k: jax.jit(lambda a: a * 2)(w), True),
        (lambda x, w, k: jax.checkpoint(lambda a: jnp.sin(a))(w), True),
    ],
)
def test_outputs_typed_by_the_static_proof(strategy, n, body, mirrored):
    x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
    w = strategy.mirror(np.arange(1.0, 4.0, dtype=np.float32))
    key = strategy.mirror(jax.random.key(1))
    out = strategy.run(body, args=(jm.PerReplica(x), w, key))
    oracle = vmap_oracle(body, n, (0, None, None))(x, np.arange(1.0, 4.0, dtype=np.float32), key)
    if mirrored:
        assert is_mirrored(strategy, out), "a provably identical value must come back mirrored"
        np.testing.assert_allclose(strategy.read(out), oracle[0], rtol=1e-6)
        np.testing.assert_allclose(oracle, np.broadcast_to(oracle[0], oracle.shape), rtol=1e-6)
    else:
        assert isinstance(out, jm.PerReplica)
        np.testing.assert_allclose(out.values, oracle, rtol=1e-6)


def test_mixed_output_tree(strategy, n):
    def fn(x):
        return {"loss": jm.all_reduce("mean", x.sum()), "per": x, "n": 3, "none": None}

    out = strategy.run(fn, args=(jm.PerReplica(np.ones((n, 2), np.float32)),))
    assert is_mirrored(strategy, out["loss"]) and float(strategy.read(out["loss"])) == 2.0
    assert isinstance(out["per"], jm.PerReplica) and out["per"].values.shape == (n, 2)
    assert is_mirrored(strategy, out["n"]) and out["none"] is None


def test_gradient_wrt_mirrored_input_is_the_replica_own(strategy, n):
    x = np.random.default_rng(1).normal(size=(n, 4, 3)).astype(np.float32)
    w0 = np.random.default_rng(2).normal(size=(3,)).astype(np.float32)

    def local_grad(w, x):
        return jax.grad(lambda w: jnp.mean((x @ w - 1.0) ** 2))(w)

    out = strategy.run(local_grad, args=(strategy.mirror(w0), jm.PerReplica(x)))
    # Forgetting the all-reduce gives per-replica gradients, never replica 0's value.
    assert isinstance(out, jm.PerReplica)
    oracle = vmap_oracle(local_grad, n, (None, 0))(w0, x)
    np.testing.assert_allclose(out.values, oracle, rtol=1e-5)
    single = [jax.grad(lambda w, xi=xi: jnp.mean((xi @ w - 1.0) ** 2))(w0) for xi in x]
    np.testing.assert_allclose(out.values, np.stack(single), rtol=1e-5)


def test_gradient_of_all_reduce_sum_is_the_all_reduced_cotangent(strategy, n):
    c = np.arange(1.0, n + 1.0, dtype=np.float32)

    def fn(x, c):
        return jax.grad(lambda x: jm.all_reduce("sum", x) * c)(x)

    out = strategy.run(fn, args=(jm.PerReplica(np.ones(n, np.float32)), jm.PerReplica(c)))
    assert is_mirrored(strategy, out)
    assert float(strategy.read(out)) == pytest.approx(c.sum())


def test_compiles_once_per_signature(strategy, n):
    traces = []

    @jm.replicate(strategy=strategy)
    def step(w, x):
        traces.append(1)
        return w + jm.all_reduce("mean", x)

    w = strategy.mirror(np.zeros(2, np.float32))
    for _ in range(3):
        w = step(w, jm.PerReplica(np.ones((n, 2), np.float32)))
    assert len(traces) == 1 and step.num_compilations == 1
    step(w, jm.PerReplica(np.ones((n, 2), np.float64).astype(np.int32)))
    assert step.num_compilations == 2
    np.testing.assert_array_equal(strategy.read(w), [3.0, 3.0])


def test_per_replica_state_passed_back_as_returned_compiles_once(strategy, n):
    # In: one PerReplica of a dict (distribute_values_from_function's form); out: the dict of
    # PerReplica leaves. Both are the same leaves, each split over the replicas.
    @jm.replicate(strategy=strategy)
    def step(state, x):
        return {"w": state["w"] + x, "count": state["count"] + 1}

    state = jm.PerReplica({"w": np.zeros((n, 3), np.float32), "count": np.zeros(n, np.int32)})
    x = jm.PerReplica(np.arange(3 * n, dtype=np.float32).reshape(n, 3))
    for _ in range(3):
        state = step(state, x)
    assert step.num_compilations == 1
    assert isinstance(state["w"], jm.PerReplica)
    np.testing.assert_array_equal(strategy.gather(state["w"]), 3 * np.asarray(x.values).ravel())
    np.testing.assert_array_equal(strategy.gather(state["count"]), np.full(n, 3))


def test_static_argnums_and_decorator_forms(strategy, n):
    @functools.partial(jm.replicate, static_argnums=(1,), strategy=strategy)
    def scale(x, k):
        return x * k

    x = jm.PerReplica(np.ones((n, 2), np.float32))
    np.testing.assert_array_equal(scale(x, 3).values, np.full((n, 2), 3.0))
    np.testing.assert_array_equal(scale(x, 4).values, np.full((n, 2), 4.0))
    assert scale.num_compilations == 2

    @jm.replicate
    def double(x):
        return x * 2

    with strategy.scope():
        np.testing.assert_array_equal(double(x).values, np.full((n, 2), 2.0))


def _repeat_double(x, n):
    for _ in range(n):  # a Python loop: `n` must be static
        x = x * 2
    return x


@pytest.mark.parametrize(
    "given", [{"static_argnames": "n"}, {"static_argnums": 1}], ids=["argnames", "argnums"]
)
def test_static_arguments_are_static_passed_either_way_as_jax_jit_takes_them(strategy, given):
    step = jm.replicate(_repeat_double, strategy=strategy, **given)
    expected = jax.jit(_repeat_double, **given)(jnp.ones(2), 2)
    for out in (step(jnp.ones(2), 2), step(jnp.ones(2), n=2)):
        np.testing.assert_array_equal(strategy.read(out), expected)
    step(jnp.ones(2), 3)
    assert step.num_compilations == 3  # n=2 by position, n=2 by name, n=3


def test_static_arguments_equal_across_types_are_different_steps(strategy):
    full = jm.replicate(lambda n: jnp.full((2,), n), strategy=strategy, static_argnums=0)
    pick = jm.replicate(lambda x, n: x[n], strategy=strategy, static_argnames="n")
    for n in (1, 1.0, True):  # equal and of one hash, as dictionary keys
        expected = jax.jit(jnp.full, static_argnums=(0, 1))((2,), n)
        assert strategy.read(full(n)).dtype == expected.dtype
    for n in (1, True):  # an index, then a new axis
        np.testing.assert_array_equal(strategy.read(pick(jnp.arange(3.0), n=n)), np.arange(3.0)[n])
    assert (full.num_compilations, pick.num_compilations) == (3, 2)


def test_donate_argnums(strategy, n):
    step = jm.replicate(
        lambda w, x: w + jm.all_reduce("sum", x), strategy=strategy, donate_argnums=0
    )
    w = strategy.mirror(np.zeros(4, np.float32))
    w = step(w, jm.PerReplica(np.ones((n, 4), np.float32)))
    np.testing.assert_array_equal(strategy.read(w), np.full(4, float(n)))


def test_lower_gives_the_step_hlo(strategy, n):
    step = jm.replicate(lambda w, x: w + jm.all_reduce("mean", x), strategy=strategy)
    w = strategy.mirror(np.zeros(4, np.float32))
    lowered = step.lower(w, jm.PerReplica(np.ones((n, 4), np.float32)))
    assert isinstance(lowered, jax.stages.Lowered)
    text = lowered.compile().as_text()
    if n > 1:
        assert "all-reduce" in text


def test_exceptions_in_fn_keep_their_type(strategy):
    class Custom(Exception):
        pass

    def fn():
        raise Custom("boom")

    with pytest.raises(Custom, match="boom"):
        strategy.run(fn)
    with pytest.raises(KeyError):
        strategy.run(lambda: {}["missing"])
    assert not jm.in_replica_context()


def test_leading_axis_mismatch_is_a_value_error_naming_the_path(strategy, n):
    bad = jm.PerReplica({"x": np.zeros((n + 1, 2))})
    with pytest.raises(ValueError) as info:
        strategy.run(lambda b: b, args=(bad,))
    message = str(info.value)
    assert "['x']" in message and f"({n + 1}, 2)" in message and str(n) in message


def test_replicated_functions_do_not_nest(strategy):
    inner = jm.replicate(lambda: 1.0, strategy=strategy)
    with pytest.raises(RuntimeError, match="do not nest"):
        strategy.run(lambda: inner())


def test_bad_argnums(strategy):
    with pytest.raises(TypeError):
        jm.replicate(lambda x: x, static_argnums="0")
    with pytest.raises(ValueError):
        jm.replicate(lambda x: x, static_argnums=0, donate_argnums=0)
    with pytest.raises(TypeError):
        jm.replicate(3)


@pytest.mark.parametrize(
    "option, points_to",
    [
        ("axis_name", r"MirroredStrategy\(axis_name=\.\.\.\)"),
        ("in_axes", r"jm\.PerReplica"),
        ("out_axes", r"mirrored when proven"),
        ("static_broadcasted_argnums", r"static_argnums"),
        ("devices", r"MirroredStrategy\(devices=\.\.\.\)"),
    ],
)
def test_jax_pmap_options_point_to_where_jmirror_has_them(option, points_to):
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{option}'; .*{points_to}"):
        jm.replicate(lambda x: x, **{option: 0})
    with pytest.raises(TypeError, match=r"'learning_rate'\. It takes strategy, donate_argnums"):
        jm.replicate(lambda x: x, learning_rate=0.1)


def test_argument_numbers_and_names_the_function_does_not_take_are_refused(n):
    # jax.jit refuses them too; ignored, a donation or a static argument would silently not be.
    def step(params, x):
        return params + x

    for options, named in [
        ({"donate_argnums": (0, 3)}, r"donate_argnums=\(0, 3\).*2 positional.*index 3"),
        ({"static_argnums": 2}, r"static_argnums=\(2,\).*\('params', 'x'\)"),
        ({"static_argnames": "lr"}, r"static_argnames=\('lr',\).*no keyword argument 'lr'"),
    ]:
        with pytest.raises(ValueError, match=named):
            jm.replicate(step, **options)
    # Negative numbers count from the last positional parameter, as in jax.jit.
    last = jm.replicate(lambda params, scale: params * scale, static_argnums=-1)
    out = last(jm.PerReplica(np.ones((n, 2), np.float32)), 2.0)
    assert last.num_compilations == 1
    last(jm.PerReplica(np.ones((n, 2), np.float32)), 3.0)  # a new static value
    assert last.num_compilations == 2
    np.testing.assert_array_equal(jm.MirroredStrategy().gather(out, axis=0), np.full(2 * n, 2))
    with pytest.raises(ValueError, match=r"static_argnums=-3.*2 positional"):
        jm.replicate(step, static_argnums=-3)
    with pytest.raises(TypeError, match=r"no fixed number"):
        jm.replicate(lambda *args: args[0], static_argnums=-1)
    # numpy integers count as ints; a positional-only name points to its number.
    assert jm.replicate(step, static_argnums=np.int64(1)) is not None

    def only(params, scale, /):
        return params * scale

    with pytest.raises(ValueError, match=r"'scale' is positional-only.*static_argnums=1"):
        jm.replicate(only, static_argnames="scale")

    # A functools.wraps wrapper that takes more than it wraps (*args, a keyword of its own):
    # either signature may take the options.
    def with_training(fn):
        @functools.wraps(fn)
        def wrapper(*args, training=False, **kwargs):
            return fn(*args, **kwargs) * (2.0 if training else 1.0)

        return wrapper

    wrapped = jm.replicate(with_training(lambda x: x + 1.0), static_argnames="training")
    out = wrapped(jm.PerReplica(np.ones((n, 2), np.float32)), training=True)
    np.testing.assert_array_equal(jm.MirroredStrategy().gather(out, axis=0), np.full(2 * n, 4))
    # *args and **kwargs take any number and any name; a method counts `self`.
    jm.replicate(lambda *args: args[0], donate_argnums=4)
    jm.replicate(lambda x, **options: x, static_argnames="lr")

    class Model:
        @jm.replicate(static_argnums=2)
        def apply(self, x, scale):
            return x * scale

    out = Model().apply(jm.PerReplica(np.ones((n, 2), np.float32)), 3.0)
    np.testing.assert_array_equal(jm.MirroredStrategy().gather(out, axis=0), np.full(2 * n, 3))


def test_both_backends_give_identical_results(n):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    w = rng.normal(size=(5,)).astype(np.float32)

    def fn(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x * w)))(w)
        return jm.all_reduce("mean", g), g, jm.all_gather(x)

    outs = []
    for backend in ["pmap", "shard_map"]:
        s = jm.MirroredStrategy(backend=backend)
        outs.append(s.run(fn, args=(s.mirror(w), jm.PerReplica(x))))
    a, b = outs
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(a[1].values, b[1].values)
    np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(b[2]))


def test_a_training_loop_compiles_once_from_mirror_of_device_arrays(strategy, n):
    step = jm.replicate(lambda w, x: w + jm.all_reduce("mean", x), strategy=strategy)
    w = strategy.mirror(jnp.zeros(3))  # a device array, already on devices[0]
    x = jm.PerReplica(np.ones((n, 3), np.float32))
    for _ in range(3):
        w = step(w, x)
    assert step.num_compilations == 1


def test_batch_of_another_strategys_distribute_dataset_names_it(backend, n):
    # A notebook cell re-run after the strategy was created again, with other devices.
    if n == 1:
        pytest.skip("needs two strategies with different device counts")
    old = jm.MirroredStrategy(num_devices=n // 2, backend=backend)
    source = [np.ones((n, 2), np.float32)]
    batch = next(iter(old.distribute_dataset(source, remainder="drop")))
    new = jm.MirroredStrategy(backend=backend)
    step = jm.replicate(lambda x: jm.all_reduce("sum", x.sum()), strategy=new)
    with pytest.raises(
        ValueError, match="another strategy: it came from that strategy's distribute_dataset"
    ):
        step(batch)
    # The same devices in another order: the batch's slice i is this strategy's replica i.
    flipped = jm.MirroredStrategy(devices=jax.devices()[::-1], backend=backend)
    batch = next(iter(new.distribute_dataset(source, remainder="drop")))
    ids = jm.replicate(lambda x: x[0, 0] * 0 + jm.replica_id(), strategy=flipped)(batch)
    assert flipped.gather(ids).tolist() == list(range(n))
    total = jm.replicate(lambda x: jm.all_reduce("sum", x.sum()), strategy=flipped)(batch)
    assert float(flipped.read(total)) == 2.0 * n


def test_a_traced_argument_used_in_python_names_the_argument_and_static_argnums(strategy, n):
    # JAX names it "flat[1]" of a function inside jmirror: the note says which argument.
    step = jm.replicate(lambda a, training: a * (2 if training else 1), strategy=strategy)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        step(jm.PerReplica(np.ones((n, 2), np.float32)), True)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "is args[1] of" in notes and "static_argnums" in notes, notes
    fixed = jm.replicate(
        lambda a, training: a * (2 if training else 1), static_argnums=(1,), strategy=strategy
    )
    np.testing.assert_allclose(
        np.asarray(strategy.gather(fixed(jm.PerReplica(np.ones((n, 2), np.float32)), True))),
        np.full((n * 2,), 2.0),
    )
