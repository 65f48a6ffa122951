"""The recipes' gradient accumulation: `accumulate_gradients`, `make_accumulating_train_step`.

Part of `jmirror.recipes` (see its docstring), where both are public. Each replica cuts its
batch into k consecutive micro-batches and a `lax.scan` runs them one after another, summing
the gradients locally; the step then reduces them once, so the compiled step holds one
gradient all-reduce whatever k is (with `jm.shard_update`, its one reduce-scatter and
all-gather per bucket). Other state the loss changes (NNX batch statistics, rng counts,
metrics; functional state passed as `state=`: an `eqx.nn.State`, a linen `batch_stats`
collection) is threaded from one micro-batch to the next, as k sequential passes leave it.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmirror import _nnx_recipes
from jmirror._context import all_reduce, keep_weak
from jmirror._replicate import Replicated, replicate
from jmirror._strategy import MirroredStrategy
from jmirror._values import PyTree, ReduceOp, Sharded, SyncOnRead

if TYPE_CHECKING:
    import optax

LossFn = Callable[..., Any]
# `(params, carry, micro_batch) -> (loss, carry)`: one micro-batch's loss, with the other
# state the loss changes passed from one micro-batch to the next.
MicroLoss = Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]]


@overload
def accumulate_gradients(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    num_micro_batches: int,
    *,
    args: Sequence[Any] = (),
    state: None = None,
    reduce: bool = True,
    dtype: jax.typing.DTypeLike | None = None,
) -> tuple[jax.Array, PyTree]: ...


@overload
def accumulate_gradients(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    num_micro_batches: int,
    *,
    args: Sequence[Any] = (),
    state: PyTree,
    reduce: bool = True,
    dtype: jax.typing.DTypeLike | None = None,
) -> tuple[jax.Array, PyTree, PyTree]: ...


def accumulate_gradients(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    num_micro_batches: int,
    *,
    args: Sequence[Any] = (),
    state: PyTree | None = None,
    reduce: bool = True,
    dtype: jax.typing.DTypeLike | None = None,
) -> tuple[jax.Array, PyTree] | tuple[jax.Array, PyTree, PyTree]:
    """Returns the mean loss and gradients over the global batch, one micro-batch at a time.

    Call it in replica context. The replica's batch is cut into `num_micro_batches`
    consecutive micro-batches along axis 0 and a `lax.scan` runs them one after another
    (only one micro-batch's activations are alive at a time), summing their gradients on
    the replica; the sum is then reduced across replicas once, so the compiled step holds
    one gradient all-reduce whatever `num_micro_batches` is. The result equals the
    gradients of the full batch, identical on every replica.

    `params` may be:

    - a pytree of arrays (a linen `TrainState.params`): `loss_fn(params, micro_batch,
      *args)`;
    - an NNX model: `loss_fn(model, micro_batch, *args)`; the gradients are the
      `nnx.State` of its `nnx.Param`s, as `nnx.grad` gives them. Every other `Variable`
      the loss changes — `BatchStat`s, rng counts, a metric held by the model or an NNX
      metric passed in `args` — is carried from one micro-batch to the next and written
      back, as k sequential passes over the micro-batches leave it (a metric counts every
      micro-batch);
    - an equinox module: `loss_fn(model, micro_batch, *args)`, differentiated with respect
      to its floating arrays as `eqx.filter_value_and_grad` does; the gradients are a module
      with `None` elsewhere.

    Functional state the loss changes — an `eqx.nn.State` (equinox's `BatchNorm`), a linen
    `batch_stats` collection — goes in `state`: the loss is then `loss_fn(params,
    micro_batch, state, *args) -> (loss, new_state)`, the state is carried from one
    micro-batch to the next, and the call returns `(loss, grads, state)` with the state as k
    sequential passes over the micro-batches leave it. jmirror does not reduce the state: a
    `BatchNorm` whose `axis_name` includes the strategy's axis reduces its own statistics,
    per micro-batch, as sequential passes would, and the state stays mirrored.

    Gradients of a dtype narrower than float32 are summed in float32 and given back in
    their own dtype.

    Args:
      loss_fn: returns the mean loss over the micro-batch.
      params: the parameters (mirrored), an NNX model or an equinox module.
      batch: the replica's batch, every leaf with a leading size divisible by
        `num_micro_batches`.
      num_micro_batches: how many micro-batches to cut the replica's batch into.
      args: passed to `loss_fn` after the micro-batch (and after `state`), the same for
        every micro-batch (NNX objects among them carry their changes from one micro-batch
        to the next).
      state: a pytree of arrays the loss takes after the micro-batch and returns updated,
        as `(loss, new_state)` with the same structure, shapes and dtypes (an
        `eqx.nn.State`; a linen `{"batch_stats": ...}` or `batch_stats` dict). `None` (the
        default): the loss returns the loss alone.
      reduce: `False` gives this replica's own mean gradients, not reduced (for
        `jm.shard_update`, which reduce-scatters them itself); the loss is reduced either
        way.
      dtype: the dtype the gradients are reduced in (`jm.all_reduce(..., dtype=)`). The
        loss rides in the same all-reduce, so it is reduced in `dtype` too (one reduction
        per step); it comes back in its own dtype.

    Returns:
      `(loss, grads)`, the mean loss and gradients; with `state`, `(loss, grads, state)`.

    Raises:
      ValueError: when `num_micro_batches` is below 1, or a batch leaf's leading size is not
        divisible by it.
      TypeError: when `num_micro_batches` is not an int; when the loss returns a tuple
        without `state` given, or with `state` given returns anything but
        `(loss, new_state)` with `new_state` shaped as `state`.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, jmirror as jm
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> loss_fn = lambda w, x: jnp.mean((x * w - 1.0) ** 2)
        >>> n = strategy.num_replicas
        >>> x = np.linspace(0.0, 1.0, 4 * n, dtype=np.float32)
        >>> _, grads = strategy.run(lambda w, b: recipes.accumulate_gradients(loss_fn, w, b, 2),
        ...                         args=(jnp.ones(()), jm.PerReplica(x.reshape(n, 4))))
        >>> bool(jnp.allclose(strategy.read(grads), jax.grad(loss_fn)(jnp.ones(()), x)))
        True

        With state: a count of the examples seen, carried through both micro-batches.

        >>> def counting_loss(w, x, seen):
        ...     return jnp.mean((x * w - 1.0) ** 2), seen + x.shape[0]
        >>> _, _, seen = strategy.run(
        ...     lambda w, b: recipes.accumulate_gradients(counting_loss, w, b, 2, state=0),
        ...     args=(jnp.ones(()), jm.PerReplica(x.reshape(n, 4))))
        >>> int(strategy.read(seen))
        4
    """
    num_micro_batches = _check(batch, num_micro_batches)
    args = tuple(args)
    stateful = state is not None
    # With state, the kinds below see `(micro_batch, state)` as their micro-batch: the state
    # then rides in the scan's carry beside theirs, whatever the kind.
    call = _with_state(loss_fn) if stateful else loss_fn
    if _nnx_recipes.is_model(params):
        diff, carry, loss, finish = _nnx_recipes.micro_loss(call, params, args)
    elif _is_equinox_module(params):
        from jmirror import _equinox_recipes  # equinox is the caller's: imported already

        diff, carry, loss, finish = _equinox_recipes.micro_loss(call, params, args)
    else:
        diff, carry, loss, finish = params, (), _plain_micro_loss(call, args), _nothing
    micro = jax.tree.map(
        lambda x: jnp.reshape(x, (num_micro_batches, -1) + jnp.shape(x)[1:]), batch
    )
    loss_sum, grad_sum, (carry, state), loss_dtype = _sum_over_micro_batches(
        _checked(loss, state), diff, (carry, state), micro
    )
    finish(carry)
    grads = jax.tree.map(lambda g: g / num_micro_batches, grad_sum)
    loss = loss_sum / num_micro_batches
    if reduce:
        loss, grads = all_reduce(ReduceOp.MEAN, (loss, grads), dtype=dtype)
    else:
        loss = all_reduce(ReduceOp.MEAN, loss)
    loss = loss.astype(loss_dtype)  # summed and reduced in at least float32
    if stateful:
        return loss, _own_dtypes(grads, diff), state
    return loss, _own_dtypes(grads, diff)


def _count(num_micro_batches: int, call: str = "recipes.accumulate_gradients") -> int:
    """Returns `num_micro_batches` as an int (numpy integers too); refuses anything else than
    a positive one."""
    count = None
    if not isinstance(num_micro_batches, bool):
        try:
            count = operator.index(num_micro_batches)
        except TypeError:
            pass
    if count is None:
        raise TypeError(
            f"{call}(num_micro_batches={num_micro_batches!r}) expects a positive int, got a "
            f"{type(num_micro_batches).__name__}."
        )
    if count < 1:
        raise ValueError(f"{call}(num_micro_batches={num_micro_batches!r}) expects a positive int.")
    return count


def _check(batch: PyTree, num_micro_batches: int) -> int:
    """Returns `num_micro_batches` as an int (`_count`), checked against `batch`."""
    count = _count(num_micro_batches)
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        size = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if size is None or size % count:
            raise ValueError(
                f"recipes.accumulate_gradients: the batch leaf at {jax.tree_util.keystr(path)!r} "
                f"has shape {jnp.shape(leaf)}, whose leading size is not divisible by "
                f"num_micro_batches={count}. Use a per-replica batch size that is "
                "a multiple of num_micro_batches; pass values that are not per example (a "
                "scalar, a learning rate) through args= instead of the batch."
            )
    return count


def _sum_over_micro_batches(
    loss: MicroLoss, diff: PyTree, carry: PyTree, micro: PyTree
) -> tuple[jax.Array, PyTree, PyTree, np.dtype]:
    """Returns the sums of the micro-batches' losses and gradients (in at least float32), the
    carry after the last micro-batch, and the loss's own dtype: one `lax.scan`, no
    collective."""
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    first = jax.tree.map(lambda x: x[0], micro)
    (loss_shape, _), grad_shapes = jax.eval_shape(grad_fn, diff, carry, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, _wide(s.dtype)), (loss_shape, grad_shapes))

    def body(state: tuple, micro_batch: PyTree) -> tuple[tuple, None]:
        sums, carry = state
        (value, carry), grads = grad_fn(diff, carry, micro_batch)
        sums = jax.tree.map(lambda t, x: t + x.astype(t.dtype), sums, (value, grads))
        return (sums, carry), None

    ((loss_sum, grad_sum), carry), _ = lax.scan(body, (zeros, carry), micro)
    return loss_sum, grad_sum, carry, loss_shape.dtype


def _with_state(loss_fn: LossFn) -> LossFn:
    """Returns `loss_fn` taking `(micro_batch, state)` where it takes the micro-batch."""

    def call(params: PyTree, micro_batch_and_state: tuple, *args: PyTree) -> PyTree:
        micro_batch, state = micro_batch_and_state
        return loss_fn(params, micro_batch, state, *args)

    return call


def _checked(loss: MicroLoss, state: PyTree) -> MicroLoss:
    """Returns `loss` with `state` (None: none) threaded beside its carry, its output checked
    before JAX differentiates it, so that a loss of the wrong form is named with its fix."""

    def checked(
        diff: PyTree, both: tuple[PyTree, PyTree], micro_batch: PyTree
    ) -> tuple[jax.Array, tuple[PyTree, PyTree]]:
        carry, old = both
        if old is None:
            value, carry = loss(diff, carry, micro_batch)
            if isinstance(value, (tuple, list)):
                raise TypeError(_TUPLE_WITHOUT_STATE.format(found=_describe(value)))
            return value, (carry, None)
        out, carry = loss(diff, carry, (micro_batch, old))
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(_NOT_A_PAIR.format(found=_describe(out)))
        value, new = out
        _check_state(old, new)
        return value, (carry, new)

    return checked


_CALL = "recipes.accumulate_gradients"
_TUPLE_WITHOUT_STATE = (
    f"{_CALL}: loss_fn returned {{found}} where a scalar loss was expected. A loss that also "
    "returns the state it changes, `(loss, new_state)` (an eqx.nn.State, a linen "
    "batch_stats collection), takes that state after the micro-batch, as loss_fn(params, "
    "micro_batch, state, *args): pass it as accumulate_gradients(..., state=state), which "
    "carries it from one micro-batch to the next and returns (loss, grads, new_state). "
    "For an equinox (model, opt_state) or a linen TrainState, make_accumulating_train_step "
    "takes (model, opt_state, state) or a TrainState with a batch_stats field."
)
_NOT_A_PAIR = (
    f"{_CALL}(..., state=state): loss_fn returned {{found}} where (loss, new_state) was "
    "expected. With state (state= given, an equinox (model, opt_state, state) triple, or a "
    "TrainState's batch_stats) the loss is loss_fn(params, micro_batch, state, *args) and "
    "returns the scalar loss and the state it leaves: `return loss, new_state`."
)


def _describe(value: object) -> str:
    """Returns what a loss or a step got, in words: an array's dtype and shape, a tuple's
    items."""
    if isinstance(value, (tuple, list)):
        items = ", ".join(_name(x) for x in value)
        return f"a {type(value).__name__} of {len(value)} ({items})"
    return _name(value)


def _name(value: object) -> str:
    """Returns an array as `a float32[] array`, anything else by its type."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {dtype}[{','.join(str(d) for d in shape)}] array"
    return f"a {type(value).__name__}"


def _check_state(old: PyTree, new: PyTree) -> None:
    """Refuses a new state that cannot replace the old one in the scan's carry."""
    old_def, new_def = jax.tree.structure(old), jax.tree.structure(new)
    if old_def != new_def:
        hint = ""
        if (
            isinstance(new, dict)
            and set(new) == {"batch_stats"}
            and not (isinstance(old, dict) and set(old) == {"batch_stats"})
        ):
            hint = " (return updates['batch_stats'], not the whole mutable updates dict)"
        raise TypeError(
            f"{_CALL}(..., state=state): loss_fn returned a new state of structure {new_def}, "
            f"where the state passed in has structure {old_def}. Return the state as the loss "
            f"received it, updated{hint}."
        )
    paths = jax.tree_util.tree_flatten_with_path(old)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(new), strict=True):
        was = (jnp.shape(a), jnp.result_type(a))
        now = (jnp.shape(b), jnp.result_type(b))
        if was != now:
            raise TypeError(
                f"{_CALL}(..., state=state): the state leaf at "
                f"{jax.tree_util.keystr(path)!r} came in with shape {was[0]} and dtype "
                f"{was[1]}, and loss_fn returned it with shape {now[0]} and dtype {now[1]}. "
                "Return every state leaf in the shape and dtype it came in with (cast it with "
                ".astype), so it can be carried from one micro-batch to the next."
            )


def _wide(dtype: jax.typing.DTypeLike) -> Any:
    """Returns the dtype a sum of `dtype` values is kept in: at least float32 for floating ones."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.promote_types(dtype, jnp.float32)
    return dtype


def _own_dtypes(grads: PyTree, like: PyTree) -> PyTree:
    """Returns `grads` in the dtypes of the differentiated leaves they belong to, weakly typed
    where those are (as `jax.grad` gives them: a weak parameter stays weak after its update)."""

    return jax.tree.map(lambda g, p: keep_weak(p, g.astype(jnp.result_type(p))), grads, like)


def _plain_micro_loss(loss_fn: LossFn, args: tuple) -> MicroLoss:
    def loss(params: PyTree, carry: PyTree, micro_batch: PyTree) -> tuple[jax.Array, PyTree]:
        return loss_fn(params, micro_batch, *args), carry

    return loss


def _nothing(carry: PyTree) -> None:
    """Writes nothing back: a plain pytree's loss changes no other state."""


# --- the train step ------------------------------------------------------------------------


def make_accumulating_train_step(
    loss_fn: LossFn,
    num_micro_batches: int,
    *,
    tx: optax.GradientTransformation | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    strategy: MirroredStrategy | None = None,
) -> Replicated:
    """Returns a replicated train step that accumulates gradients over micro-batches.

    The step is `step(state, batch, *args) -> (state, loss)`, one optimizer step on the
    global batch with the gradients of `accumulate_gradients` (reduced once per step), for

    - a mirrored flax `TrainState`: `loss_fn(params, micro_batch, *args)`;
    - a flax `TrainState` with a `batch_stats` field (`recipes.BatchNormTrainState`, or your
      own subclass), for a linen model with `BatchNorm`: `loss_fn(params, micro_batch,
      batch_stats, *args) -> (loss, new_batch_stats)`, where `batch_stats` is the
      collection itself (`state.batch_stats`) and `new_batch_stats` the one `model.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"])` returns
      (`updates["batch_stats"]`). The statistics are carried from one micro-batch to the
      next and the step returns the `TrainState` with the new ones. With
      `nn.BatchNorm(axis_name=strategy.axis_name)` they stay mirrored; a `jm.SyncOnRead`
      `batch_stats` (`recipes.distribute_batch_norm_state(..., per_replica_stats=True)`)
      is carried per replica;
    - an NNX `(model, optimizer)` pair, updated in place: `loss_fn(model, micro_batch,
      *args)`; batch statistics and metrics (held by the model, or NNX metrics in `args`)
      are left as k sequential micro-batch passes leave them. NNX objects after the pair in
      `state`, `(model, optimizer, metrics)`, are passed to `loss_fn` first, as
      `loss_fn(model, micro_batch, metrics, *args)`, and updated the same way;
    - an equinox `(model, opt_state)` pair with the optax transformation given as `tx`
      (`opt_state = tx.init(eqx.filter(model, eqx.is_array))`): `loss_fn(model,
      micro_batch, *args)`; the step returns the new `(model, opt_state)`;
    - an equinox `(model, opt_state, state)` triple, `state` an `eqx.nn.State` (from
      `eqx.nn.make_with_state`, for `eqx.nn.BatchNorm`): `loss_fn(model, micro_batch,
      state, *args) -> (loss, new_state)`, as `eqx.filter_value_and_grad(has_aux=True)`
      users write it; the state is carried from one micro-batch to the next and the step
      returns the new `(model, opt_state, state)`.

    The state of a `BatchNorm` is not reduced by jmirror: one whose `axis_name` includes the
    strategy's axis reduces its statistics per micro-batch, as sequential passes would.

    An optimizer made by `jm.shard_update` (its state holds `jm.Sharded` leaves) receives
    each replica's own gradients and reduces them itself: one reduce-scatter and one
    all-gather per bucket, and no gradient all-reduce.

    Args:
      loss_fn: returns the mean loss over the micro-batch (with `(loss, new_state)` for
        the kinds with state above).
      num_micro_batches: micro-batches per replica batch.
      tx: the optax transformation of an equinox `(model, opt_state)` pair or `(model,
        opt_state, state)` triple (not used for a `TrainState` or an NNX pair, which hold
        theirs).
      dtype: the dtype the gradients (and, in the same all-reduce, the loss) are reduced
        in (`jm.all_reduce(..., dtype=)`).
      strategy: passed to `jm.replicate`.

    Raises:
      ValueError: when `num_micro_batches` is below 1 (the batch's divisibility is checked
        when the step is traced).
      TypeError: when `num_micro_batches` is not an int; when the step is called with a
        `state` of none of the kinds above.

    Example:
        >>> import jax.numpy as jnp, numpy as np, optax, jmirror as jm
        >>> from flax.training.train_state import TrainState
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> state = strategy.mirror(TrainState.create(
        ...     apply_fn=None, params={"w": jnp.zeros(())}, tx=optax.sgd(0.5)))
        >>> step = recipes.make_accumulating_train_step(
        ...     lambda p, x: jnp.mean((p["w"] - x) ** 2), 2, strategy=strategy)
        >>> n = strategy.num_replicas
        >>> state, loss = step(state, jm.PerReplica(np.ones((n, 4), np.float32)))
        >>> float(strategy.read(state.params["w"])), float(strategy.read(loss))
        (1.0, 1.0)
    """

    num_micro_batches = _count(num_micro_batches, "recipes.make_accumulating_train_step")

    def accumulate(
        params: PyTree, batch: PyTree, args: tuple, opt_state: PyTree, state: PyTree = None
    ) -> tuple:
        return accumulate_gradients(
            loss_fn,
            params,
            batch,
            num_micro_batches,
            args=args,
            state=state,
            reduce=not _is_sharded(opt_state),
            dtype=dtype,
        )

    def train_step(state: PyTree, batch: PyTree, *args: PyTree) -> tuple[Any, jax.Array]:
        if _is_equinox_state(state):
            from jmirror import _equinox_recipes

            return _equinox_recipes.step(state, tx, accumulate, batch, args)
        pair = _nnx_recipes.pair(state, "make_accumulating_train_step")
        if pair is not None:
            model, optimizer = pair
            extra = tuple(state[2:])  # NNX objects after the pair: (model, optimizer, metrics)
            opt_state = _nnx_recipes.optimizer_state(optimizer)
            loss, grads = accumulate(model, batch, extra + args, opt_state)
            return _nnx_recipes.apply(state, pair, grads), loss
        if _is_train_state(state):
            return _train_state_step(state, accumulate, batch, args)
        raise TypeError(_NO_KIND.format(found=_describe(state)))

    return replicate(train_step, strategy=strategy)


_NO_KIND = (
    "recipes.make_accumulating_train_step: the step got a state that is {found}, which is "
    "none of the kinds it trains: a flax TrainState (with a batch_stats field for a linen "
    "BatchNorm), an NNX (model, optimizer) pair (NNX objects may follow), an equinox "
    "(model, opt_state) pair or an equinox (model, opt_state, state) triple with "
    "tx=optimizer given. Pass one of these as the step's first argument."
)


def _is_sharded(opt_state: PyTree) -> bool:
    """Returns whether an optimizer state is `jm.shard_update`'s (it holds `jm.Sharded` leaves)."""
    leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, Sharded))
    return any(isinstance(x, Sharded) for x in leaves)


def _is_train_state(state: PyTree) -> bool:
    """Returns whether `state` trains as a flax `TrainState` does (`params`, `opt_state` and
    `apply_gradients`)."""
    return all(hasattr(state, name) for name in ("params", "opt_state", "apply_gradients"))


def _train_state_step(
    state: PyTree, accumulate: Callable[..., tuple], batch: PyTree, args: tuple
) -> tuple[PyTree, jax.Array]:
    """Takes one step of a flax `TrainState`, carrying its `batch_stats` when it has them."""
    stats = getattr(state, "batch_stats", None)
    if stats is None:
        loss, grads = accumulate(state.params, batch, args, state.opt_state)
        return state.apply_gradients(grads=grads), loss
    # Per-replica statistics (a SyncOnRead) are carried as each replica's own value.
    per_replica = isinstance(stats, SyncOnRead)
    own = stats.value if per_replica else stats
    loss, grads, own = accumulate(state.params, batch, args, state.opt_state, own)
    stats = stats.replace(own) if per_replica else own
    return state.apply_gradients(grads=grads, batch_stats=stats), loss


# --- equinox, only once the caller imported it (the rest in `_equinox_recipes`) --------------


def _is_equinox_module(x: object) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def _is_equinox_state(state: PyTree) -> bool:
    """Returns whether `state` is an equinox `(model, opt_state)` pair or `(model, opt_state,
    state)` triple."""
    return (
        isinstance(state, (tuple, list)) and len(state) in (2, 3) and _is_equinox_module(state[0])
    )
