"""The fault suite: careless and hostile use never hangs, crashes or gives a wrong value.

Each test here failed on the code before the reliability fixes (outer transforms left tracers
in the in-flight queue, donated buffers crashed jaxlib, merge_fn results were clamped, ...).
Input faults live in `tests/test_input_faults.py`.
"""

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmirror as jm
import jmirror.testing as jmt
from jmirror.metrics import Mean

# --- composition with outer transformations ------------------------------------------------------


def _replica(x):
    return jnp.sin(x) * jm.all_reduce("sum", x)


def _pmap_replica(x):
    return jnp.sin(x) * lax.psum(x, "replica")


def _run(fn):
    return lambda x: fn(jm.PerReplica(x)).values


_TRANSFORMS = {
    "jit": lambda g, x: jax.jit(g)(x),
    "grad": lambda g, x: jax.grad(lambda x: g(x).sum())(x),
    "vjp": lambda g, x: jax.vjp(g, x)[1](jnp.cos(x))[0],
    "jvp": lambda g, x: jax.jvp(g, (x,), (jnp.cos(x),))[1],
    "linearize": lambda g, x: jax.linearize(g, x)[1](jnp.cos(x)),
    "vmap": lambda g, x: jax.vmap(g)(jnp.stack([x, 2 * x, -x])),
    "fori_loop": lambda g, x: lax.fori_loop(0, 3, lambda i, c: g(c) * 0.1, x),
    "scan": lambda g, x: lax.scan(lambda c, _: (g(c) * 0.1, c.sum()), x, None, length=3),
}


@pytest.mark.parametrize("transform", sorted(_TRANSFORMS))
def test_outer_transform_matches_pmap_and_leaves_nothing_behind(strategy, n, transform):
    f = jm.replicate(_replica, strategy=strategy)
    p = jax.pmap(_pmap_replica, axis_name="replica")
    x = jnp.linspace(0.5, 1.5, n, dtype=jnp.float32)
    apply = _TRANSFORMS[transform]
    expected = apply(p, x)
    got = apply(_run(f), x)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, expected)
    assert not any(isinstance(t, jax.core.Tracer) for t in list(strategy.dispatch.in_flight))
    # Later plain calls behave as if the traced call never happened.
    for _ in range(3):
        out = f(jm.PerReplica(x))
    np.testing.assert_array_equal(out.values, p(x))
    assert f.num_compilations == 1


def test_float0_outputs_are_not_waited_on(strategy):
    # The gradient with respect to an int (allow_int=True) is a float0 array on the host.
    def grads(w, k):
        return jax.grad(lambda w, k: (w * k).sum(), argnums=(0, 1), allow_int=True)(w, k)

    f = jm.replicate(grads, strategy=strategy)
    for _ in range(4):
        gw, gk = f(jnp.ones(3), jnp.arange(3))
    np.testing.assert_array_equal(strategy.read(gw), np.arange(3))
    assert gk.dtype == jax.dtypes.float0


def test_only_float0_outputs_still_bounded(strategy):
    f = jm.replicate(
        lambda k: jax.grad(lambda k: k.sum() * 1.0, allow_int=True)(k), strategy=strategy
    )
    for _ in range(5):
        out = f(jnp.arange(3))
        assert len(strategy.dispatch.in_flight) <= strategy.max_in_flight
    assert out.dtype == jax.dtypes.float0


def test_lowered_and_compiled_step_returns_what_the_call_returns(strategy, n):
    f = jm.replicate(lambda w, x: (w + jm.all_reduce("mean", x), x * 2), strategy=strategy)
    w = strategy.mirror(jnp.ones(3))
    x = jm.PerReplica(jnp.arange(3 * n, dtype=jnp.float32).reshape(n, 3))
    compiled = f.lower(w, x).compile()
    got, want = compiled(w, x), f(w, x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert f.num_compilations == 1  # .lower() does not count


# --- donated buffers (jaxlib crashes on several devices) ------------------------------------------


@pytest.fixture
def donating(strategy):
    return jm.MirroredStrategy(backend=strategy.backend, donation="always")


def test_reusing_a_donated_argument_is_a_value_error(donating):
    step = jm.replicate(lambda w: w + 1, strategy=donating, donate_argnums=0)
    w = donating.mirror(jnp.ones(4))
    new = step(w)
    with pytest.raises(ValueError, match=r"args\[0\].*deleted.*donated"):
        step(w)
    np.testing.assert_array_equal(donating.read(step(new)), np.full(4, 3.0))


def test_reusing_a_donated_per_replica_batch_is_a_value_error(donating, n):
    step = jm.replicate(lambda b: b["x"] * 2, strategy=donating, donate_argnums=0)
    stacked = NamedSharding(donating.mesh, P(donating.axis_name))
    batch = jm.PerReplica({"x": jax.device_put(np.ones((n, 3), np.float32), stacked)})
    step(batch)
    with pytest.raises(ValueError, match=r"args\[0\]\.values\['x'\].*deleted"):
        step(batch)


def test_one_array_for_two_donated_arguments_is_a_value_error(donating):
    step = jm.replicate(lambda a, b: a + b, strategy=donating, donate_argnums=(0, 1))
    w = donating.mirror(jnp.ones(4))
    with pytest.raises(ValueError, match=r"args\[0\] and again at args\[1\]"):
        step(w, w)
    assert not w.is_deleted()


def test_donated_and_plain_argument_is_a_value_error(donating):
    step = jm.replicate(lambda a, b: a + b, strategy=donating, donate_argnums=0)
    w = donating.mirror(jnp.ones(4))
    with pytest.raises(ValueError, match=r"args\[0\] and again at kwargs\['b'\]"):
        step(w, b=w)
    np.testing.assert_array_equal(donating.read(step(w, b=donating.mirror(jnp.ones(4)))), 2.0)


def test_a_donated_argument_passed_to_another_step_is_a_value_error(donating):
    # The other step not compiled yet (compiled, on several devices, jaxlib ends the process
    # without the check: test_a_deleted_argument_never_ends_the_process).
    train = jm.replicate(lambda w: w + 1, strategy=donating, donate_argnums=0)
    evaluate = jm.replicate(lambda w: jm.all_reduce("sum", w * 2), strategy=donating)
    w = donating.mirror(jnp.ones(3))
    new = train(w)
    for call in (evaluate, lambda w: donating.run(lambda v: v * 2, args=(w,))):
        with pytest.raises(ValueError, match=r"args\[0\].*has been deleted.*donate_argnums"):
            call(w)
    np.testing.assert_array_equal(donating.read(evaluate(new)), 4.0 * donating.num_replicas)


@pytest.mark.parametrize("call", ["mirror", "read", "local_results", "gather", "reduce"])
def test_strategy_apis_name_a_deleted_array(donating, call):
    w = donating.mirror(jnp.ones(3))
    jm.replicate(lambda w: w + 1, strategy=donating, donate_argnums=0)(w)
    apis = {
        "mirror": lambda: donating.mirror({"w": w}),
        "read": lambda: donating.read({"w": w}),
        "local_results": lambda: donating.local_results({"w": w}),
        "gather": lambda: donating.gather({"w": w}),
        "reduce": lambda: donating.reduce("mean", {"w": w}),
    }
    with pytest.raises(ValueError, match=rf"strategy\.{call}: .*\['w'\].*has been deleted"):
        apis[call]()


_DELETED_ON_SEVERAL_DEVICES = """
import jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp, jmirror as jm
s = jm.MirroredStrategy(donation="always")
train = jm.replicate(lambda w: w + 1, strategy=s, donate_argnums=0)
evaluate = jm.replicate(lambda w: w * 2, strategy=s)
w = s.mirror(jnp.ones(3))
evaluate(w)
train(w)
try:
    evaluate(w)
except ValueError as e:
    print("refused:", e)
"""


@pytest.mark.once
def test_a_deleted_argument_never_ends_the_process():
    # jaxlib ends the process (SIGSEGV) on a deleted buffer given to a compiled program that
    # runs on several devices: in a process of its own, so that the suite survives if it does.
    run = subprocess.run(
        [sys.executable, "-c", _DELETED_ON_SEVERAL_DEVICES],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "refused:" in run.stdout and "args[0]" in run.stdout, run.stdout + run.stderr


def test_donation_policy_is_explicit(n):
    large = np.zeros(8 * 2**20 // 4, np.float32)  # 8 MiB
    for donation in ("auto", "always"):
        strategy = jm.MirroredStrategy(donation=donation)
        assert strategy.donation == donation
        w = strategy.mirror(large)
        jm.replicate(lambda w: w + 1, strategy=strategy, donate_argnums=0)(w)
        # "auto" skips donating 8 MiB leaves on several host devices only.
        assert w.is_deleted() is (donation == "always" or n == 1)
    with pytest.raises(ValueError, match="donation='sometimes'.*'auto'.*'always'"):
        jm.MirroredStrategy(donation="sometimes")


# --- the in-flight bound -------------------------------------------------------------------------


def test_too_deep_in_flight_on_host_devices_is_a_value_error(n):
    if n == 1:
        assert jm.MirroredStrategy(max_in_flight=64).max_in_flight == 64
        return
    with pytest.raises(ValueError, match="max_in_flight=64.*aborts.*at most 16"):
        jm.MirroredStrategy(max_in_flight=64)
    assert jm.MirroredStrategy(max_in_flight=16).max_in_flight == 16


def test_strategies_on_the_same_devices_share_one_bound(n):
    strategies = [
        jm.MirroredStrategy(backend=b, max_in_flight=4) for b in ("pmap", "shard_map") * 2
    ]
    steps = [jm.replicate(lambda x: jm.all_reduce("sum", x), strategy=s) for s in strategies]
    queues = {id(s.dispatch.in_flight): s.dispatch.in_flight for s in strategies}
    x = jm.PerReplica(np.ones((n,), np.float32))
    for _ in range(50):
        for step in steps:
            out = step(x)
            assert sum(len(q) for q in queues.values()) <= 4
    assert float(strategies[-1].read(out)) == n


# --- merge_call --------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [3, 16])
def test_merge_fn_per_replica_of_the_wrong_size_is_a_value_error(strategy, size):
    def step():
        x = jnp.float32(jm.replica_id())
        return jm.merge_call(lambda s, v: jm.PerReplica(jnp.arange(size)), args=(x,))

    if size == strategy.num_replicas:
        return
    with pytest.raises(
        ValueError, match=rf"shape \({size},\).*leading axis of {strategy.num_replicas}"
    ):
        strategy.run(step)


def test_merge_call_passes_python_objects_through(strategy, n):
    def merge_fn(s, message, v):
        return jax.tree.map(lambda a: a * len(message), v)

    def step():
        return jm.merge_call(merge_fn, args=("hello", jnp.float32(jm.replica_id())))

    np.testing.assert_array_equal(strategy.gather(strategy.run(step)), 5.0 * np.arange(n))


def test_reduce_of_a_closure_captured_tracer_says_to_pass_it(strategy):
    def step():
        y = jnp.float32(jm.replica_id())
        return jm.merge_call(lambda s: s.reduce("sum", y))

    with pytest.raises(ValueError, match="captured from the replica function's closure"):
        strategy.run(step)


def test_assign_integer_sum_in_merge_fn_is_exact(strategy, n):
    def step(count):
        return jm.merge_call(lambda s, c: s.assign(c, 10), args=(count,))

    count = strategy.run(step, args=(strategy.sync_on_read(np.int32(0), "sum"),))
    assert int(strategy.read(count)) == 10
    assert [int(c) for c in strategy.local_results(count)] == [
        10 // n + (i < 10 % n) for i in range(n)
    ]


def test_divergent_cond_message_names_the_cond(strategy):
    def step(x):
        return lax.cond(x > 0, lambda v: jm.all_reduce("sum", v), lambda v: v, x)

    if strategy.num_replicas == 1:
        return
    with pytest.raises(ValueError, match="move the collective out of the cond\\."):
        strategy.run(step, args=(jm.PerReplica(jnp.arange(strategy.num_replicas) - 1.0),))


# --- messages ----------------------------------------------------------------------------------


def test_collective_over_another_axis_name_names_the_fix(strategy, n):
    f = jm.replicate(lambda x: lax.psum(x, "batch"), strategy=strategy)
    with pytest.raises(
        NameError, match=r"'batch'.*'replica'.*MirroredStrategy\(axis_name='batch'\)"
    ) as info:
        f(jm.PerReplica(np.ones(n, np.float32)))
    assert isinstance(info.value, ValueError)  # as jmirror's errors about what was passed
    assert "jm.sync_batch_norm(model, strategy)" in str(info.value)
    batch = jm.MirroredStrategy(backend=strategy.backend, axis_name="batch")
    out = jm.replicate(lambda x: lax.psum(x, "batch"), strategy=batch)(
        jm.PerReplica(np.ones(n, np.float32))
    )
    assert float(batch.read(out)) == n


def test_read_of_a_per_replica_names_the_path(strategy, n):
    state = {"params": strategy.mirror(1.0), "logits": jm.PerReplica(np.zeros((n, 2)))}
    with pytest.raises(TypeError, match=r"at path \"\['logits'\]\".*reduce"):
        strategy.read(state)


def test_host_batch_broadcast_every_call_warns_once(strategy, n):
    f = jm.replicate(lambda b: b.sum(), strategy=strategy)
    batch = np.ones((n, 3), np.float32)  # common_utils.shard output, without jm.PerReplica
    with pytest.warns(UserWarning, match=r"numpy array of shape .* at args\[0\].*jm\.PerReplica"):
        f(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(batch)
        f(np.ones((n, 4), np.float32))  # a new signature, but the warning was given already
        f(jm.PerReplica(batch))


def test_retracing_warning_names_the_changing_argument(strategy):
    f = jm.replicate(lambda w, x: w + x.sum(), strategy=strategy)
    w = strategy.mirror(jnp.ones(()))
    for size in range(1, 9):
        f(w, x=jnp.ones(size))
        f.lower(w, x=jnp.ones(size + 100))  # .lower() does not count
    with pytest.warns(UserWarning, match=r"compiled 9 input signatures.*kwargs\['x'\]: \(1,\)"):
        f(w, x=jnp.ones(9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(w, x=jnp.ones(10))  # once per function


def test_retracing_warning_counts_changing_static_arguments(strategy):
    f = jm.replicate(lambda w, k: w * k, strategy=strategy, static_argnums=1)
    w = strategy.mirror(jnp.ones(2))
    for k in range(1, 9):
        f(w, k)
    with pytest.warns(
        UserWarning, match=r"compiled 9 input signatures.*args\[1\]: static 1 \(int\)"
    ):
        f(w, 9)


def test_traced_calls_do_not_count_toward_the_retracing_warning(strategy):
    f = jm.replicate(lambda x: x.sum(), strategy=strategy)
    for size in range(1, 12):  # eleven signatures, all traced by the caller's own jit
        jax.jit(lambda x: f(x))(jnp.ones(size))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(jnp.ones(1))
        f(jnp.ones(100))


def test_metric_masks_must_not_be_weights():
    with pytest.raises(TypeError, match="dtype float32.*not a weight"):
        Mean.empty().update(jnp.ones(3), mask=jnp.array([1.0, 0.5, 0.0]))
    assert float(Mean.empty().update(jnp.arange(3.0), mask=jnp.array([1, 1, 0])).compute()) == 0.5


def test_integer_like_counts_and_device_specs_are_accepted(n):
    assert jm.MirroredStrategy(num_devices=np.int64(1)).num_replicas == 1
    emulated = jmt.EmulatedStrategy(np.int32(2), device=f"cpu:{n - 1}")
    assert emulated.devices == (jax.devices()[n - 1],) * 2
    total = emulated.run(lambda: jm.all_reduce("sum", jm.replica_id()))
    assert int(emulated.read(total)) == 1
    with pytest.raises(ValueError, match="cpu:99"):
        jmt.EmulatedStrategy(2, device="cpu:99")


@pytest.mark.once
@pytest.mark.parametrize("count", ["0", "-3"])
def test_pytest_plugin_device_count_is_a_usage_error(tmp_path, count):
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--jmirror-devices",
            count,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 4, run.stdout + run.stderr
    assert "at least 1" in run.stderr and "INTERNALERROR" not in run.stdout + run.stderr


@pytest.mark.parametrize("leaf", [np.ones(7), jnp.ones(7), jnp.ones(9), jnp.float32(1.0)])
def test_per_replica_of_the_wrong_size_names_the_leaf(strategy, leaf):
    if strategy.num_replicas == 1 and jnp.ndim(leaf) == 1:
        leaf = jnp.ones(2)  # one replica: any other leading size is wrong
    f = jm.replicate(lambda x: x * 2, strategy=strategy)
    with pytest.raises(ValueError, match=r"per-replica leaf of shape .* at args\[0\]\.values"):
        f(jm.PerReplica(leaf))


def test_mirror_inside_jit_is_a_type_error_naming_the_path(strategy):
    # Found by a hostile hunt: a raw AttributeError ("The 'sharding' attribute is not available
    # on traced array") from jmirror's internals.
    with pytest.raises(TypeError, match=r"strategy.mirror got a traced value at \"\['w'\]\""):
        jax.jit(lambda x: strategy.mirror({"w": x}))(jnp.ones(3))
    with pytest.raises(TypeError, match="at the top level.*strategy.mirror\\(jax.jit\\(init\\)"):
        jax.jit(strategy.mirror)(jnp.ones(3))
    # Outside the transformation it still places the value.
    np.testing.assert_array_equal(np.asarray(strategy.mirror(jnp.ones(3))), np.ones(3))
