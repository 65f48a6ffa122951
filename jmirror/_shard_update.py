"""`jm.shard_update`: the weight update sharded over the replicas (Xu et al. 2020, ZeRO-1).

`init` splits every parameter-shaped leaf of the inner transformation's state into `Sharded`
pieces (1/N per device). Inside a replica function `update`

1. reduce-scatters the mean of this replica's own gradients: one `psum_scatter` per bucket
   (the gradients of one dtype, about `DEFAULT_BUCKET_BYTES` of them in tree order, packed in
   one flat buffer), laid out so that replica i receives piece i of every leaf; with replicas
   spanning k > 1 devices each model device packs and reduces only its own block of every
   leaf (`_shard_jaxpr.layout`: a leaf is cut in k blocks along its last dimension that k
   divides), so no gradient is rebuilt whole inside a replica and each device receives
   1/(N*k) of every leaf;
2. runs the inner transformation's `update`, traced at the full shapes, on the pieces
   (`jmirror._shard_jaxpr`: element-wise work stays local, reductions over whole leaves become
   a local reduction plus a collective, anything else is refused);
3. all-gathers the updates, one `all_gather` per bucket, so they come back mirrored.

The bytes moved equal one all-reduce's (an all-reduce is a reduce-scatter and an all-gather).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmirror import _context, _shard_jaxpr, _shim
from jmirror._shard_jaxpr import Layout, Piece, Pieces, run
from jmirror._topology import Topology
from jmirror._values import PyTree, Sharded

# Parameter leaves traced into `inner.update`: arrays and numbers (the rest is passed as it is).
_ARRAYS = (jax.Array, np.ndarray, np.generic, int, float, complex)

# The default `bucket_bytes`: measured best on 8 XLA:CPU host devices (the largest Adam model
# in a per-device budget 1.99x the mirrored one's, at the same step time;
# benchmarks/RESULTS.md). One buffer per dtype keeps a packed copy of every gradient alive.
DEFAULT_BUCKET_BYTES = 4 * 2**20

_OUTSIDE = (
    "jm.shard_update({name}).update was called outside a replica function. It takes each "
    "replica's own gradients and communicates across the replicas, so call it inside the "
    "function given to jm.replicate / strategy.run (pass the gradients before any "
    "jm.all_reduce)."
)
_OTHER_N = (
    "jm.shard_update({name}).update got a Sharded state leaf at {path} of shape {shape} "
    "whose piece has {found} elements; with {n} replicas it needs {k}. The state was made "
    "for another replica count: restore it through jmirror.checkpoint (which re-shards onto "
    "any N) or call tx.init again."
)


def shard_update(
    inner: optax.GradientTransformation,
    *,
    strategy: _context.Strategy | None = None,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    reduce_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformation:
    """Shards a gradient transformation's state and update over the replicas (ZeRO-1).

    Each replica keeps and updates 1/N of every parameter-shaped leaf of `inner`'s state
    (Xu et al. 2020, "Automatic Cross-Replica Sharding of Weight Update in Data-Parallel
    Training"; ZeRO stage 1). `tx.init(params)` in cross-replica context returns the sharded
    state: each leaf of a parameter's shape becomes a `jm.Sharded` (flattened, padded to a
    multiple of N, 1/N per replica; with replicas spanning k devices first cut in k blocks
    along its last dimension that k divides, each block flattened, padded and cut in N, so
    1/(N*k) per device); scalars such as step counts stay mirrored. Inside a replica
    function, `updates, state = tx.update(grads, state, params)` takes this replica's OWN
    gradients (do not all-reduce them first): it reduce-scatters
    their mean, runs `inner` on this replica's pieces, and all-gathers the updates, which come
    back mirrored and equal to `inner.update(jm.all_reduce("mean", grads), state, params)` on
    the full state.

    Reductions over a whole leaf or the whole tree (`clip_by_global_norm`, the LAMB / LARS
    trust ratios) give the unsharded result: `inner.update` is traced and each such reduction
    becomes a local reduction plus a collective, with the padding masked. What cannot be
    computed exactly on pieces (a reduction over some axes of a leaf, sort, cumsum, gather,
    control flow over sharded values, an unknown primitive) is a `ValueError` at trace time
    naming the primitive. `strategy.read(state)` gives the full, unsharded state;
    `jmirror.checkpoint` saves it once and restores it sharded onto any replica count.

    Args:
      inner: any `optax.GradientTransformation`.
      strategy: the strategy whose replicas `init` shards the state over; `None` means the
        devices the parameters are mirrored on (as `strategy.mirror` placed them), else
        `jm.get_strategy()` when `init` is called.
      bucket_bytes: the gradients of each dtype are packed, in tree order, into buckets of
        at most about this many bytes (a larger leaf has a bucket of its own), each reduced
        as soon as its gradients exist: one reduce-scatter and one all-gather per bucket.
        The default, 4 MiB (`4 * 2**20`), is the value measured best on 8 host devices.
        `None` packs each dtype's gradients into one buffer (one reduce-scatter and one
        all-gather per dtype), which XLA holds beside the gradients: one more copy of them
        at the step's peak. The bytes moved are the same either way.
      reduce_dtype: the floating dtype the reduce-scatter runs in: each floating gradient
        leaf of another dtype is cast to it before the reduction, and this replica's reduced
        pieces are cast back to the gradient's own dtype before `inner` runs (bfloat16
        gradients averaged in float32, say). `None` reduces each gradient in its own dtype.

    Returns:
      An `optax.GradientTransformation` whose `update` must run inside a replica function.

    Raises:
      TypeError: `inner` is not a gradient transformation, or `reduce_dtype` is not a
        floating dtype.
      RuntimeError: `update` called outside a replica function.
      ValueError: at trace time, for a part of `inner` that cannot be computed exactly on
        1/N of each leaf, or a state sharded for another replica count.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> tx = jm.shard_update(optax.adam(0.1))  # gradients reduced in buckets of ~4 MiB
        >>> params = strategy.mirror({"w": jnp.ones(10)})
        >>> state = tx.init(params)
        >>> @jm.replicate(strategy=strategy)
        ... def step(params, state, x):
        ...     grads = jax.grad(lambda p: jnp.mean((x * p["w"]) ** 2))(params)
        ...     updates, state = tx.update(grads, state, params)  # this replica's own grads
        ...     return optax.apply_updates(params, updates), state
        >>> x = jm.PerReplica(jnp.ones((strategy.num_replicas, 10)))
        >>> params, state = step(params, state, x)
        >>> [round(float(w), 3) for w in strategy.read(params)["w"][:2]]
        [0.9, 0.9]
        >>> strategy.read(state)[0].mu["w"].shape
        (10,)
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"jm.shard_update expects an optax.GradientTransformation (with init and update), "
            f"got {type(inner).__name__}: {inner!r}. Wrap the optimizer, e.g. "
            "jm.shard_update(optax.adam(1e-3))."
        )
    name = _name(inner)
    if bucket_bytes is not None and (
        isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1
    ):
        raise ValueError(
            f"jm.shard_update(..., bucket_bytes={bucket_bytes!r}): expected a positive int "
            "(about the most bytes of gradients per bucket; the default is 4 * 2**20) or None "
            "(one buffer per dtype)."
        )
    wire = _context.reduction_dtype(reduce_dtype, "jm.shard_update", "reduce_dtype")

    def init(params: PyTree) -> PyTree:
        if _context.in_replica_context():
            return _init_in_replica(inner, params, _pieces(name))
        if strategy is None and (found := _mirrored_on(params)) is not None:
            return _init_placed(inner, params, found)  # the devices the params are on
        chosen = strategy or _context.current_strategy()
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
            params = chosen.mirror(params)  # traced (`nnx.eval_shape`): the layouts say it
        return _init_placed(inner, params, chosen.topology)

    def update(updates: PyTree, state: PyTree, params: PyTree = None) -> tuple[PyTree, PyTree]:
        # `updates`: this replica's own gradients (optax's name for the argument).
        if not _context.in_replica_context():
            raise RuntimeError(_OUTSIDE.format(name=name))
        if params is not None:
            _check_like_params(name, updates, params)
        return _update(inner, updates, state, params, _pieces(name), bucket_bytes, wire)

    return optax.GradientTransformation(init, update)


def _check_like_params(name: str, updates: PyTree, params: PyTree) -> None:
    """Raises a `ValueError` naming the path when the gradients are not shaped as the
    parameters (optax's contract; the pieces are cut by the parameters' shapes). A `None`
    gradient (a frozen parameter) stands for its parameter's subtree, as optax takes it."""
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def compare(path: tuple, g: Any, p: Any) -> None:
        if g is not None and np.shape(g) != np.shape(p):
            shapes.append((jax.tree_util.keystr(path), np.shape(g), np.shape(p)))

    try:
        jax.tree_util.tree_map_with_path(compare, updates, params, is_leaf=lambda x: x is None)
    except ValueError:
        raise ValueError(
            f"jm.shard_update({name}).update got gradients of structure "
            f"{jax.tree.structure(updates)}, but the parameters have structure "
            f"{jax.tree.structure(params)}. Pass gradients of the parameters "
            "(jax.grad(loss)(params)), as tx.update(grads, opt_state, params)."
        ) from None
    if shapes:
        path, found, wanted = shapes[0]
        raise ValueError(
            f"jm.shard_update({name}).update got a gradient of shape {tuple(found)} "
            f"at {path or '<root>'}, where the parameter has shape {tuple(wanted)}. Pass "
            "gradients of the parameters (jax.grad(loss)(params)), each of its parameter's shape."
        )


def _name(inner: optax.GradientTransformation) -> str:
    fn = getattr(inner, "update", None)
    return getattr(fn, "__qualname__", type(inner).__name__).replace(".<locals>.", ".")


def _pieces(name: str) -> Pieces:
    context = _context.replica_context()
    axis = context.axis_name
    topology = context.strategy.topology
    k = 1 if topology.is_emulated else topology.devices_per_replica
    if k == 1:
        return Pieces(axis, context.num_replicas, lax.axis_index(axis), name)
    return Pieces(
        axis,
        context.num_replicas,
        lax.axis_index(axis),
        name,
        k=k,
        mesh=topology.mesh,
        model_axis_name=topology.model_axis_name,
    )


def _sharded_shapes(params: PyTree) -> set[tuple[int, ...]]:
    """Returns the shapes whose state leaves are sharded: those of the non-scalar parameters."""
    return {tuple(np.shape(p)) for p in jax.tree.leaves(params) if np.ndim(p) >= 1 and np.size(p)}


def _is_sharded(leaf: PyTree, shapes: set[tuple[int, ...]]) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype") and tuple(leaf.shape) in shapes


def stack(x: jax.Array, n: int, k: int = 1) -> jax.Array:
    """Returns the `[N, length]` pieces of a whole leaf over N replicas of k devices: flattened,
    padded with zeros, cut in N (k = 1); cut in k blocks first (k > 1, `_shard_jaxpr.layout`)."""
    return _shard_jaxpr.stack(x, _shard_jaxpr.layout(np.shape(x), n, k))


def _devices_per_replica(topology: Topology) -> int:
    return 1 if topology.is_emulated else topology.devices_per_replica


def _mirrored_on(params: PyTree) -> Topology | None:
    """Returns the topology of the mesh every parameter is mirrored over (as `strategy.mirror`
    places them: one strategy's mesh, no leaf split over its replica axis), or None."""
    shardings = {getattr(x, "sharding", None) for x in jax.tree.leaves(params)}
    meshes = {
        s.mesh for s in shardings if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh)
    }
    if len(meshes) != 1 or not all(isinstance(s, NamedSharding) for s in shardings):
        return None
    topology = Topology.of_mesh(meshes.pop())
    if not all(topology.is_mirrored(x) for x in jax.tree.leaves(params)):
        return None
    return topology


def _init_placed(inner: optax.GradientTransformation, params: PyTree, topology: Topology) -> PyTree:
    """Returns the sharded state of N replicas, placed: pieces stacked, the rest mirrored."""
    n, k = topology.num_replicas, _devices_per_replica(topology)
    shapes = _sharded_shapes(params)
    leaves, treedef = jax.tree.flatten(jax.eval_shape(inner.init, params))
    sharded = [_is_sharded(leaf, shapes) for leaf in leaves]

    def build(params: PyTree) -> list[jax.Array]:
        state = jax.tree.leaves(inner.init(params))
        return [stack(x, n, k) if s else x for x, s in zip(state, sharded)]

    layouts = [
        topology.pieces_sharding(_shard_jaxpr.layout(leaf.shape, n, k).length)
        if s
        else topology.mirrored
        for leaf, s in zip(leaves, sharded)
    ]
    placed = jax.jit(build, out_shardings=layouts)(params)
    return treedef.unflatten(
        [Sharded(x, leaf.shape) if s else x for x, leaf, s in zip(placed, leaves, sharded)]
    )


def _init_in_replica(inner: optax.GradientTransformation, params: PyTree, pieces: Pieces) -> PyTree:
    """Returns the sharded state made inside a replica function: this replica's pieces."""
    shapes = _sharded_shapes(params)
    return jax.tree.map(
        lambda x: (
            Sharded(_laid_out(pieces.take(x), pieces), x.shape) if _is_sharded(x, shapes) else x
        ),
        inner.init(params),
    )


def _laid_out(local: jax.Array, pieces: Pieces) -> jax.Array:
    """Returns this replica's piece laid out as `Topology.pieces_sharding` lays out the stacked
    pieces: split over the model axis when k > 1 divides its length.

    The state `init` makes in cross-replica context is placed that way; state made inside a
    replica function and the state a step returns are given the same layout, so that a step
    called with either compiles once (XLA's propagation alone leaves a piece whole on every
    model device when nothing in the step cuts it).
    """
    if pieces.k == 1 or local.shape[0] % pieces.k:
        return local
    spec = P(pieces.model_axis_name)
    return _on_blocks(lambda x: (x,), pieces, (spec,), (spec,))(local)[0]


def _update(
    inner: optax.GradientTransformation,
    grads: PyTree,
    state: PyTree,
    params: PyTree,
    pieces: Pieces,
    bucket_bytes: int | None,
    reduce_dtype: np.dtype | None = None,
) -> tuple[PyTree, PyTree]:
    grad_leaves, grad_def = jax.tree.flatten(grads)
    state_nodes, state_def = jax.tree.flatten(state, is_leaf=lambda x: isinstance(x, Sharded))
    _check_state(state, pieces)
    param_leaves, param_def = jax.tree.flatten(params)
    # Only the parameters' arrays are traced: a whole equinox module passed as `params` also
    # holds functions and flags, which `inner.update` sees as they are (as optax does).
    traced_at = [i for i, p in enumerate(param_leaves) if isinstance(p, _ARRAYS)]
    param_arrays = [param_leaves[i] for i in traced_at]

    grads_in = _scatter_mean(grad_leaves, pieces, bucket_bytes, reduce_dtype)
    state_in = [
        Piece(x.shards, x.shape, pieces.layout(x.shape)) if isinstance(x, Sharded) else x
        for x in state_nodes
    ]
    full_state = [
        jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, Sharded) else jax.typeof(x)
        for x in state_nodes
    ]
    avals = [jax.typeof(g) for g in grad_leaves] + full_state
    avals += [jax.typeof(p) for p in param_arrays]
    sizes = (len(grad_leaves), len(state_nodes))
    out_def: list[Any] = []

    def flat_update(*flat: PyTree) -> list[Any]:
        g = grad_def.unflatten(flat[: sizes[0]])
        s = state_def.unflatten(flat[sizes[0] : sizes[0] + sizes[1]])
        leaves = list(param_leaves)
        for i, traced in zip(traced_at, flat[sizes[0] + sizes[1] :]):
            leaves[i] = traced
        p = param_def.unflatten(leaves)
        out, tree = jax.tree.flatten(inner.update(g, s, p))
        out_def.append(tree)
        return out

    closed = jax.make_jaxpr(flat_update)(*avals)
    outs = run(closed, grads_in + state_in + param_arrays, pieces)
    updates_def, new_state_def = out_def[0].children()
    n_updates = updates_def.num_leaves
    outs[:n_updates] = _gather(outs[:n_updates], pieces, bucket_bytes)
    outs = _weak_as_traced(outs, closed.out_avals)
    updates = updates_def.unflatten(outs[:n_updates])
    new_state = _new_state(outs[n_updates:], new_state_def, state_nodes, state_def, pieces)
    return updates, new_state


def _weak_as_traced(values: list[Any], avals: Sequence[Any]) -> list[Any]:
    """Returns `values` with each whole array weakly typed where `inner.update`, traced on the
    whole gradients, gives a weakly typed leaf (the collectives drop weak types, `_shim`)."""
    return [
        _shim.weakly_typed(x)
        if isinstance(x, jax.Array) and aval.weak_type and x.dtype == aval.dtype
        else x
        for x, aval in zip(values, avals)
    ]


def _check_state(state: PyTree, pieces: Pieces) -> None:
    nodes = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, Sharded))
    for path, node in nodes[0]:
        if isinstance(node, Sharded):
            k = pieces.length(node.shape)
            found = tuple(np.shape(node.shards))
            if found != (k,):
                raise ValueError(
                    _OTHER_N.format(
                        name=pieces.name,
                        path=jax.tree_util.keystr(path) or "<root>",
                        shape=node.shape,
                        found=found,
                        n=pieces.n,
                        k=k,
                    )
                )


def _buffers(leaves: Sequence[Any], bucket_bytes: int | None) -> list[tuple[Any, list[int]]]:
    """Returns the leaves packed into buffers: one per dtype, or per dtype and bucket of at most
    `bucket_bytes` (in tree order; a larger leaf has a buffer of its own)."""
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(jnp.result_type(x), []).append(i)
    if bucket_bytes is None:
        return list(groups.items())
    out: list[tuple[Any, list[int]]] = []
    for dtype, indices in groups.items():
        bucket: list[int] = []
        used = 0
        for i in indices:
            size = np.size(leaves[i]) * np.dtype(dtype).itemsize
            if bucket and used + size > bucket_bytes:
                out.append((dtype, bucket))
                bucket, used = [], 0
            bucket.append(i)
            used += size
        out.append((dtype, bucket))
    return out


def _scatter_mean(
    leaves: list[Any],
    pieces: Pieces,
    bucket_bytes: int | None,
    reduce_dtype: jax.typing.DTypeLike | None = None,
) -> list[Any]:
    """Returns the mean over the replicas of every gradient leaf: this replica's piece of each
    non-scalar leaf (one reduce-scatter per buffer), scalars whole (a small all-reduce);
    floating leaves reduced in `reduce_dtype` (when given) and cast back to their own."""
    own = [jnp.result_type(x) for x in leaves]
    leaves = [_on_wire(x, reduce_dtype) for x in leaves]
    out: list[Any] = list(leaves)
    n, axis = pieces.n, pieces.axis_name
    split = [i for i, x in enumerate(leaves) if np.ndim(x) >= 1 and np.size(x)]
    for i in set(range(len(leaves))) - set(split):
        out[i] = lax.pmean(leaves[i], axis) if np.size(leaves[i]) else leaves[i]
    for dtype, group in _buffers([leaves[i] for i in split], bucket_bytes):
        indices = [split[j] for j in group]
        if pieces.k > 1:
            for i, piece in zip(indices, _scatter_blocks([leaves[i] for i in indices], pieces)):
                out[i] = piece
            continue
        stacked = [stack(leaves[i], n) for i in indices]
        buffer = jnp.concatenate(stacked, axis=1).reshape(-1)
        mine = lax.psum_scatter(buffer, axis, scatter_dimension=0, tiled=True)
        mine = mine / jnp.asarray(n, dtype)
        offsets = np.cumsum([0] + [s.shape[1] for s in stacked])
        for i, start, stop in zip(indices, offsets[:-1], offsets[1:]):
            shape = tuple(np.shape(leaves[i]))
            out[i] = Piece(mine[start:stop], shape, pieces.layout(shape))
    return [_cast(x, dtype) for x, dtype in zip(out, own)]


def _on_wire(x: PyTree, reduce_dtype: jax.typing.DTypeLike | None) -> PyTree:
    """Returns `x` in the dtype it is reduced in: `reduce_dtype` for a floating leaf, else its
    own."""
    if reduce_dtype is None or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        return x
    return jnp.asarray(x).astype(reduce_dtype)


def _cast(x: PyTree, dtype: jax.typing.DTypeLike) -> PyTree:
    """Returns a reduced gradient (a whole value or a `Piece`) back in its own `dtype`."""
    if isinstance(x, Piece):
        return x if x.local.dtype == dtype else dataclasses.replace(x, local=x.local.astype(dtype))
    return x if jnp.result_type(x) == dtype else jnp.asarray(x).astype(dtype)


def _block_spec(lay: Layout, pieces: Pieces) -> P:
    """Returns the spec, over the model axis, of a whole value cut in `lay`'s blocks along its
    dimension `lay.dim` (replicated when the layout has one block)."""
    if lay.blocks == 1 or lay.dim is None:
        return P()
    return P(*([None] * lay.dim), pieces.model_axis_name)


def _piece_spec(lay: Layout, pieces: Pieces) -> P:
    """Returns the spec, over the model axis, of a piece cut by `lay`: block j's sub-piece on model
    device j (replicated when the layout has one block)."""
    return P(pieces.model_axis_name) if lay.blocks > 1 else P()


def _on_blocks(fn: Callable[..., Any], pieces: Pieces, in_specs: tuple, out_specs: tuple) -> PyTree:
    """Runs `fn` on each model device's own blocks (manual over the model axis too): every cut
    and collective of the packing is local to a device, none rebuilds a whole leaf."""
    return jax.shard_map(
        fn,
        mesh=pieces.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={pieces.model_axis_name},
        check_vma=False,
    )


def _scatter_blocks(grads: list[Any], pieces: Pieces) -> list[Piece]:
    """Returns this replica's pieces of the mean of one bucket of gradient leaves, with replicas
    spanning k > 1 devices: each model device packs its own block of every leaf (a local
    flatten: the block along the dimension the layout cuts), one reduce-scatter over the
    replica axis, and keeps its sub-piece (1/(N*k) of each leaf per device)."""
    n, axis = pieces.n, pieces.axis_name
    shapes = [tuple(np.shape(g)) for g in grads]
    layouts = [pieces.layout(shape) for shape in shapes]
    dtype = jnp.result_type(grads[0])

    def pack(*blocks: jax.Array) -> tuple[Any, ...]:
        stacked = []
        for block, lay in zip(blocks, layouts):
            flat = jnp.ravel(block)  # this device's block: lay.block elements
            stacked.append(jnp.pad(flat, (0, n * lay.sub - flat.size)).reshape(n, lay.sub))
        buffer = jnp.concatenate(stacked, axis=1).reshape(-1)
        mine = lax.psum_scatter(buffer, axis, scatter_dimension=0, tiled=True)
        mine = mine / jnp.asarray(n, dtype)
        offsets = np.cumsum([0] + [lay.sub for lay in layouts])
        return tuple(mine[a:b] for a, b in zip(offsets[:-1], offsets[1:]))

    in_specs = tuple(_block_spec(lay, pieces) for lay in layouts)
    out_specs = tuple(_piece_spec(lay, pieces) for lay in layouts)
    mine = _on_blocks(pack, pieces, in_specs, out_specs)(*grads)
    return [Piece(x, shape, lay) for x, shape, lay in zip(mine, shapes, layouts)]


def _gather(outs: list[Any], pieces: Pieces, bucket_bytes: int | None = None) -> list[Any]:
    """Returns whole values of `outs`: the pieces all-gathered (one all-gather per buffer)."""
    whole = list(outs)
    split = [i for i, x in enumerate(outs) if isinstance(x, Piece)]
    n, axis = pieces.n, pieces.axis_name
    sizes = [jax.ShapeDtypeStruct(outs[i].shape, outs[i].local.dtype) for i in split]
    for _, group in _buffers(sizes, bucket_bytes):
        indices = [split[j] for j in group]
        if pieces.k > 1:
            for i, x in zip(indices, _gather_blocks([outs[i] for i in indices], pieces)):
                whole[i] = x
            continue
        locals_ = [outs[i].local for i in indices]
        buffer = jnp.concatenate(locals_)
        full = lax.all_gather(buffer, axis, tiled=True).reshape(n, buffer.shape[0])
        offsets = np.cumsum([0] + [x.shape[0] for x in locals_])
        for i, start, stop in zip(indices, offsets[:-1], offsets[1:]):
            piece = outs[i]
            flat = full[:, start:stop].reshape(-1)[: piece.size]
            whole[i] = flat.reshape(piece.shape)
    return whole


def _gather_blocks(outs: list[Piece], pieces: Pieces) -> list[Any]:
    """Returns the whole values of one bucket of pieces, with replicas spanning k > 1 devices: each
    model device gathers its sub-pieces over the replica axis (one all-gather) into its own
    blocks, laid out over the model axis as the layout cuts them."""
    n, axis = pieces.n, pieces.axis_name
    layouts = [piece.layout for piece in outs]

    def unpack(*locals_: jax.Array) -> tuple[Any, ...]:
        buffer = jnp.concatenate(locals_)
        full = lax.all_gather(buffer, axis, tiled=True).reshape(n, buffer.shape[0])
        offsets = np.cumsum([0] + [lay.sub for lay in layouts])
        blocks = []
        for lay, a, b in zip(layouts, offsets[:-1], offsets[1:]):
            flat = full[:, a:b].reshape(-1)[: lay.block]
            blocks.append(flat.reshape(lay.pre, lay.mid // lay.blocks, lay.post))
        return tuple(blocks)

    in_specs = tuple(_piece_spec(lay, pieces) for lay in layouts)
    out_specs = tuple(
        P(None, pieces.model_axis_name, None) if lay.blocks > 1 else P() for lay in layouts
    )
    blocks = _on_blocks(unpack, pieces, in_specs, out_specs)(*[piece.local for piece in outs])
    return [x.reshape(piece.shape) for x, piece in zip(blocks, outs)]


def _new_state(
    outs: list[Any], out_def: Any, inputs: list[Any], in_def: Any, pieces: Pieces
) -> PyTree:
    """Returns the new state in the layout of the old one: `Sharded` where it was, whole
    elsewhere."""
    full_in_def = jax.tree.structure(in_def.unflatten([0] * in_def.num_leaves))
    if out_def != full_in_def:
        raise ValueError(
            f"jm.shard_update({pieces.name}): the inner transformation's update returned a "
            f"state of structure {out_def}, but was given {full_in_def}; jm.shard_update needs "
            "a transformation whose update keeps the structure of its state (every optax "
            "transformation does)."
        )
    new: list[Any] = [None] * len(outs)
    to_gather = []
    for i, (out, old) in enumerate(zip(outs, inputs)):
        if isinstance(old, Sharded):
            lay = pieces.layout(old.shape)
            if isinstance(out, Piece):
                piece = pieces.relayout(out, lay)
            else:
                piece = Piece(pieces.take(out, lay), old.shape, lay)
            local = pieces.fill_padding(piece).astype(old.dtype)
            new[i] = Sharded(_laid_out(local, pieces), old.shape)
        elif isinstance(out, Piece):
            to_gather.append(i)
        else:
            new[i] = out
    for i, x in zip(to_gather, _gather([outs[i] for i in to_gather], pieces)):
        new[i] = x
    return in_def.unflatten(new)
