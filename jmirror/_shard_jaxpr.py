"""Running an update's jaxpr on 1/N of each sharded leaf, with the unsharded result.

`jm.shard_update` traces the inner transformation's `update` at the parameters' full shapes
and runs the jaxpr here, on this replica's pieces (Xu et al. 2020 do the same analysis on the
XLA graph). Every value of the jaxpr is one of two layouts:

- *whole*: the full value, present on this replica (mirrored state, parameters, constants,
  scalars, and everything computed from them alone);
- a `Piece`: this replica's piece of a value of shape `shape`, cut by its `Layout`. With one
  device per replica (k = 1), and for a leaf no dimension of which k divides, the value is
  flattened (row-major), padded to a multiple of N and cut into N pieces of `ceil(size / N)`
  elements (piece i on replica i). With replicas spanning k > 1 devices the value is first cut
  into k blocks along its last dimension that k divides (block j is what model device j holds
  when the leaf is laid out over that dimension); each block is flattened, padded to a
  multiple of N and cut into N sub-pieces, and piece i is the k blocks' sub-pieces i, one
  after another (the sub-piece of block j on model device j: 1/(N*k) of the leaf per device,
  every cut local to a device). A layout depends on the shape the piece was cut from, which
  a `Layout` records, so reshapes keep it.

The rules, each of which gives exactly the unsharded result:

- an equation with only whole inputs runs as it is;
- an element-wise equation runs on the pieces (a whole operand of the full shape is cut to
  this replica's piece first, a scalar one is broadcast as in the jaxpr);
- a reshape, a squeeze, and a broadcast or transpose that only moves size-1 axes keep the
  piece (the flattened order does not change);
- a reduction over every axis of a size above 1 (`reduce_sum`, `max`, `min`, `prod`, `and`,
  `or`, and a `dot_general` contracting every such axis) is the reduction of the piece, with
  the padding replaced by the reduction's identity, then a collective over the replicas
  (`psum`, `pmax`, `pmin`); the result is whole;
- `jit`, `closed_call`, `remat`, `custom_jvp_call` and `custom_vjp_call` are followed into
  their jaxprs; a `cond` whose index is whole runs each branch by these rules (an output is a
  piece where any branch gives one).

Anything else that touches a piece (a reduction over some axes only, sort, cumsum, gather,
scatter, slices, concatenation, a transpose of the data, loops, an unknown primitive)
mixes elements across positions of a leaf and is a `ValueError` naming the primitive.
Padding never reaches a result: element-wise work may turn it into anything (NaN, from
`0 / 0`), so every piece operand of a reduction and of a `dot_general` has its padding
replaced, by a `where`, with the reduction's identity (zero for the products); the padded
outputs of element-wise work are dropped or zeroed by the caller.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a value is cut into N pieces: `blocks` (1, or k with replicas spanning k devices)
    blocks along the middle axis of its `(pre, mid, post)` view, each flattened, padded to a
    multiple of N and cut in N sub-pieces of `sub` elements; piece i is the blocks' sub-pieces
    i. `dim` is the dimension of the value's own shape split into the blocks (not compared:
    two layouts that cut the same elements the same way are equal)."""

    n: int
    blocks: int
    pre: int
    mid: int
    post: int
    dim: int | None = dataclasses.field(default=None, compare=False)

    @property
    def size(self) -> int:
        return self.pre * self.mid * self.post

    @property
    def block(self) -> int:
        """Returns the elements of one block (padding excluded)."""
        return self.size // self.blocks

    @property
    def sub(self) -> int:
        """Returns the elements of one block's piece (padding included)."""
        return -(-self.block // self.n)

    @property
    def length(self) -> int:
        """Returns the elements of one replica's piece (padding included)."""
        return self.blocks * self.sub


def layout(shape: Sequence[int], n: int, k: int = 1) -> Layout:
    """Returns the layout of the pieces of a value of `shape` over `n` replicas of `k` devices:
    split into k blocks along its last dimension that k divides (k > 1), else row-major."""
    shape = tuple(int(d) for d in shape)
    if k > 1:
        for d in reversed(range(len(shape))):
            if shape[d] and shape[d] % k == 0:
                pre, post = math.prod(shape[:d]), math.prod(shape[d + 1 :])
                return Layout(n, k, pre, shape[d], post, d)
    return Layout(n, 1, 1, math.prod(shape), 1)


def stack(x: jax.Array | np.ndarray, lay: Layout, xp: types.ModuleType = jnp) -> Any:
    """Returns the `[N, length]` pieces of the whole value `x` (`xp`: `jax.numpy` or `numpy`)."""
    if lay.blocks == 1:  # row-major: flattened, padded with zeros, cut in N
        flat = xp.ravel(x)
        return xp.pad(flat, (0, lay.n * lay.sub - flat.size)).reshape(lay.n, lay.sub)
    b = lay.blocks
    blocks = xp.moveaxis(xp.reshape(x, (lay.pre, b, lay.mid // b, lay.post)), 1, 0)
    blocks = xp.pad(blocks.reshape(b, lay.block), ((0, 0), (0, lay.n * lay.sub - lay.block)))
    pieces = blocks.reshape(b, lay.n, lay.sub).transpose(1, 0, 2)
    return pieces.reshape(lay.n, lay.length)


def unstack(
    pieces: jax.Array | np.ndarray, lay: Layout, shape: Sequence[int], xp: types.ModuleType = jnp
) -> Any:
    """Returns the whole value of `shape` from its `[N, length]` pieces (padding dropped)."""
    shape = tuple(shape)
    if lay.blocks == 1:
        return pieces.reshape(-1)[: lay.size].reshape(shape)
    b = lay.blocks
    blocks = pieces.reshape(lay.n, b, lay.sub).transpose(1, 0, 2).reshape(b, lay.n * lay.sub)
    blocks = blocks[:, : lay.block].reshape(b, lay.pre, lay.mid // b, lay.post)
    return xp.moveaxis(blocks, 0, 1).reshape(shape)


@dataclasses.dataclass(frozen=True)
class Piece:
    """This replica's piece (`local`, `[length]`) of a value of shape `shape`, cut by
    `layout`."""

    local: jax.Array
    shape: tuple[int, ...]
    layout: Layout

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """How values are cut over the replicas: N, the axis and this replica's index; with
    replicas spanning `k` > 1 devices, the `mesh` and its `model_axis_name` too."""

    axis_name: str
    n: int
    index: jax.Array  # traced replica index
    name: str  # how errors name the transformation
    k: int = 1
    mesh: jax.sharding.Mesh | None = None
    model_axis_name: str = "model"

    def layout(self, shape: Sequence[int]) -> Layout:
        """Returns the layout of the pieces of a value of `shape`."""
        return layout(shape, self.n, self.k)

    def length(self, shape: Sequence[int]) -> int:
        """Returns the elements per piece of a value of `shape`."""
        return self.layout(shape).length

    def take(self, x: jax.Array, lay: Layout | None = None) -> jax.Array:
        """Returns this replica's piece of the whole value `x` (cut by `lay`, else by its
        shape's)."""
        lay = self.layout(np.shape(x)) if lay is None else lay
        if lay.blocks == 1:
            flat = jnp.ravel(x)
            flat = jnp.pad(flat, (0, self.n * lay.sub - flat.size))
            return lax.dynamic_slice_in_dim(flat, self.index * lay.sub, lay.sub)
        mine = lax.dynamic_index_in_dim(
            stack(x, lay).reshape(self.n, lay.blocks, lay.sub), self.index, 0, False
        )
        return mine.reshape(lay.length)

    def valid(self, lay: Layout) -> jax.Array:
        """Returns which entries of this replica's piece lie inside the value (not padding)."""
        inside = self.index * lay.sub + lax.iota(np.int32, lay.sub) < lay.block
        if lay.blocks == 1:
            return inside
        return jnp.broadcast_to(inside, (lay.blocks, lay.sub)).reshape(lay.length)

    def fill_padding(self, piece: Piece, value: jax.typing.ArrayLike = 0) -> jax.Array:
        """Returns the piece's local entries with the padding replaced by `value`.

        A `where`, not a product: element-wise work may have made the padding NaN or
        infinite (`0 / 0` where the real entries are finite), and NaN * 0 is NaN.
        """
        local = piece.local
        return jnp.where(self.valid(piece.layout), local, jnp.asarray(value, local.dtype))

    def whole(self, piece: Piece) -> jax.Array:
        """Returns the whole value of `piece` on every replica (an all-gather)."""
        gathered = lax.all_gather(piece.local, self.axis_name)
        lay = piece.layout
        base = (lay.pre, lay.mid, lay.post)
        return unstack(gathered, lay, base).reshape(piece.shape)

    def relayout(self, piece: Piece, lay: Layout) -> Piece:
        """Returns `piece` cut by `lay` instead (the same piece when the layouts are equal)."""
        if piece.layout == lay:
            return piece
        return Piece(self.take(self.whole(piece), lay), piece.shape, lay)


def run(closed: jex.ClosedJaxpr, args: Sequence[Any], pieces: Pieces) -> list[Any]:
    """Evaluates `closed` on `args` (whole values and `Piece`s); outputs in the same layouts."""
    return _eval(closed.jaxpr, closed.consts, args, pieces)


def _eval(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any], pieces: Pieces) -> list:
    env: dict[Any, Any] = {}

    def read(v: jex.Var | jex.Literal) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    for var, value in zip(jaxpr.constvars, consts):
        env[var] = value
    for var, value in zip(jaxpr.invars, args):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if any(isinstance(v, Piece) for v in invals):
            outs = _rule(eqn)(eqn, invals, pieces)
        else:
            outs = _bind(eqn, invals)
        for var, value in zip(eqn.outvars, outs):
            if not isinstance(var, jex.DropVar):
                env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn: Any, invals: Sequence[Any], **changes: object) -> list[Any]:
    """Returns the equation's primitive applied to `invals` (with some parameters changed)."""
    params = eqn.primitive.get_bind_params({**eqn.params, **changes})
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # JAX before 0.9: (subfuns, params)
        subfuns, params = params
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# --- the rules ---------------------------------------------------------------------------------

_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp
    clz complex conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc
    exp exp2 expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p
    logistic lt max min mul ne neg nextafter not or polygamma population_count pow real
    reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh xor zeta""".split()
)
_PASS_THROUGH = frozenset({"sharding_constraint", "optimization_barrier"})
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}

_REFUSED = (
    "jm.shard_update({name}): the inner transformation's update applies `{primitive}` to a "
    "sharded value (a piece of a leaf of shape {shape}), and {why}, so it cannot be computed "
    "exactly on 1/N of each leaf. Use the transformation unsharded (inner.update on "
    "jm.all_reduce('mean', grads), with mirrored state), or leave out the part of it that "
    "uses `{primitive}`."
)
_MIXES = "`{primitive}` mixes elements across positions of the leaf"
_UNKNOWN = "jm.shard_update does not know how `{primitive}` acts on a sharded leaf"


def _refuse(eqn: Any, invals: Sequence[Any], pieces: Pieces, why: str = _MIXES) -> ValueError:
    primitive = eqn.primitive.name
    shape = next(v.shape for v in invals if isinstance(v, Piece))
    return ValueError(
        _REFUSED.format(
            name=pieces.name, primitive=primitive, shape=shape, why=why.format(primitive=primitive)
        )
    )


def _rule(eqn: Any) -> Callable[[Any, list, Pieces], list]:
    name = eqn.primitive.name
    if name in _ELEMENTWISE:
        return _elementwise
    if name in _PASS_THROUGH:
        return lambda eqn, invals, pieces: list(invals)
    if name in _CALLS:
        return _call
    return _RULES.get(name, _unknown)


def _unknown(eqn: Any, invals: list, pieces: Pieces) -> list:
    mixing = {
        "sort",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "cumlogsumexp",
        "gather",
        "scatter",
        "scatter-add",
        "scatter_add",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "pad",
        "rev",
        "argmax",
        "argmin",
        "top_k",
        "conv_general_dilated",
        "reduce_window_sum",
        "fft",
    }
    why = _MIXES if eqn.primitive.name in mixing else _UNKNOWN
    raise _refuse(eqn, invals, pieces, why)


def _to_pieces(
    eqn: Any, invals: list, pieces: Pieces, shape: tuple[int, ...]
) -> tuple[list[Any], Layout]:
    """Returns the operands of an element-wise equation on the pieces of values of `shape`, all cut
    by one layout (the first piece operand's), and that layout."""
    size = math.prod(shape)
    lay = next(v.layout for v in invals if isinstance(v, Piece))
    out = []
    for v in invals:
        if isinstance(v, Piece):
            if v.size != size:
                raise _refuse(eqn, invals, pieces)
            out.append(pieces.relayout(v, lay).local)
        elif np.ndim(v) == 0:
            out.append(v)  # scalar operands broadcast, as in the jaxpr
        elif tuple(np.shape(v)) == shape:
            out.append(pieces.take(v, lay))
        else:
            raise _refuse(eqn, invals, pieces)
    return out, lay


def _elementwise(eqn: Any, invals: list, pieces: Pieces) -> list:
    shape = tuple(eqn.outvars[0].aval.shape)
    operands, lay = _to_pieces(eqn, invals, pieces, shape)
    outs = _bind(eqn, operands)
    return [Piece(o, tuple(v.aval.shape), lay) for o, v in zip(outs, eqn.outvars)]


def _same_layout(eqn: Any, invals: list, pieces: Pieces) -> list:
    """Returns the same piece for a reshape / squeeze / broadcast_in_dim that keeps the flattened
    order."""
    (x, *rest) = invals
    shape = tuple(eqn.outvars[0].aval.shape)
    name = eqn.primitive.name
    keeps = math.prod(shape) == x.size and not rest
    if name == "reshape":
        keeps = keeps and eqn.params.get("dimensions") is None
    if name == "transpose":
        order = [a for a in eqn.params["permutation"] if x.shape[a] != 1]
        keeps = keeps and order == sorted(order)
    if not keeps:
        raise _refuse(eqn, invals, pieces)
    return [Piece(x.local, shape, x.layout)]


def _all_axes(shape: tuple[int, ...], axes: Sequence[int]) -> bool:
    """Returns whether reducing `axes` of `shape` reduces every element into one."""
    return all(d == 1 or i in axes for i, d in enumerate(shape))


def _identity(name: str, dtype: jax.typing.DTypeLike) -> np.ndarray:
    dtype = np.dtype(dtype)
    if name in ("reduce_sum", "reduce_or", "reduce_xor"):
        return np.zeros((), dtype)
    if name in ("reduce_prod", "reduce_and"):
        return np.ones((), dtype)
    big = name == "reduce_min"
    if dtype == np.bool_:
        return np.array(big)
    if np.issubdtype(dtype, np.inexact):
        return np.array(np.inf if big else -np.inf, dtype)
    info = np.iinfo(dtype)
    return np.array(info.max if big else info.min, dtype)


def _reduction(eqn: Any, invals: list, pieces: Pieces) -> list:
    (x,) = invals
    name = eqn.primitive.name
    if not _all_axes(x.shape, eqn.params["axes"]):
        raise _refuse(
            eqn,
            invals,
            pieces,
            f"`{name}` over axes {tuple(eqn.params['axes'])} reduces only part of the leaf",
        )
    masked = pieces.fill_padding(x, _identity(name, x.local.dtype))
    (partial,) = _bind(eqn, [masked], axes=(0,))
    axis = pieces.axis_name
    if name == "reduce_sum":
        total = lax.psum(partial, axis)
    elif name == "reduce_max":
        total = lax.pmax(partial, axis)
    elif name == "reduce_min":
        total = lax.pmin(partial, axis)
    elif name in ("reduce_and", "reduce_or"):
        as_int = partial.astype(np.int32)
        reduce = lax.pmin if name == "reduce_and" else lax.pmax
        total = reduce(as_int, axis).astype(partial.dtype)
    else:  # reduce_prod
        (total,) = _bind(eqn, [lax.all_gather(partial, axis)], axes=(0,))
    return [jnp.reshape(total, eqn.outvars[0].aval.shape)]


def _dot_general(eqn: Any, invals: list, pieces: Pieces) -> list:
    (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
    a, b = invals
    shape_a = a.shape if isinstance(a, Piece) else tuple(np.shape(a))
    shape_b = b.shape if isinstance(b, Piece) else tuple(np.shape(b))
    # Only a full contraction in the same order (a vdot of two leaves): a sum of products.
    in_order = [i for i in lhs_c if shape_a[i] != 1] == sorted(i for i in lhs_c if shape_a[i] != 1)
    in_order = in_order and [j for j in rhs_c if shape_b[j] != 1] == sorted(
        j for j in rhs_c if shape_b[j] != 1
    )
    pairs_match = all(shape_a[i] == shape_b[j] for i, j in zip(lhs_c, rhs_c))
    full = _all_axes(shape_a, lhs_c) and _all_axes(shape_b, rhs_c)
    if lhs_b or rhs_b or not (full and in_order and pairs_match):
        raise _refuse(eqn, invals, pieces, "`dot_general` contracts only part of the leaf")
    # Both operands' padding is zeroed: either may be NaN there (an update `g / sqrt(nu)`
    # of a zero-padded `nu`), and 0 * NaN would make the sum NaN.
    lay = next(v.layout for v in (a, b) if isinstance(v, Piece))
    la, lb = (
        pieces.fill_padding(pieces.relayout(v, lay))
        if isinstance(v, Piece)
        else pieces.take(v, lay)
        for v in (a, b)
    )
    (partial,) = _bind(eqn, [la, lb], dimension_numbers=(((0,), (0,)), ((), ())))
    total = lax.psum(partial, pieces.axis_name)
    return [jnp.reshape(total, eqn.outvars[0].aval.shape)]


def _call(eqn: Any, invals: list, pieces: Pieces) -> list:
    sub = eqn.params[_CALLS[eqn.primitive.name]]
    if isinstance(sub, jex.ClosedJaxpr):
        return _eval(sub.jaxpr, sub.consts, invals, pieces)
    return _eval(sub, (), invals, pieces)


def _cond(eqn: Any, invals: list, pieces: Pieces) -> list:
    """Interprets a `cond` on a whole index: each branch interpreted, its outputs in one layout."""
    index, *operands = invals
    if isinstance(index, Piece):
        raise _refuse(eqn, invals, pieces, "the branch taken would differ along the leaf")
    branches = eqn.params["branches"]
    kinds = [(v.shape, v.layout) if isinstance(v, Piece) else None for v in operands]
    locals_ = [v.local if isinstance(v, Piece) else v for v in operands]

    def rebuild(flat: Sequence[Any]) -> list[Any]:
        return [x if s is None else Piece(x, *s) for x, s in zip(flat, kinds)]

    # First each branch's layouts (abstractly): an output is a piece if any branch's is, cut
    # by the first such branch's layout.
    layouts: list[Layout | None] = [None] * len(eqn.outvars)
    for branch in branches:
        found: list[list[Layout | None]] = []

        def trace(*flat: jax.Array, branch=branch, found=found) -> list[Any]:
            outs = _eval(branch.jaxpr, branch.consts, rebuild(flat), pieces)
            found.append([o.layout if isinstance(o, Piece) else None for o in outs])
            return [o.local if isinstance(o, Piece) else o for o in outs]

        jax.eval_shape(trace, *locals_)
        layouts = [a if a is not None else b for a, b in zip(layouts, found[0])]

    def run_branch(branch: jex.ClosedJaxpr) -> Callable[..., list[Any]]:
        def fn(*flat: jax.Array) -> list[Any]:
            outs = _eval(branch.jaxpr, branch.consts, rebuild(flat), pieces)
            return [
                (pieces.relayout(o, lay).local if isinstance(o, Piece) else pieces.take(o, lay))
                if lay is not None
                else o
                for o, lay in zip(outs, layouts)
            ]

        return fn

    outs = lax.switch(index, [run_branch(b) for b in branches], *locals_)
    return [
        Piece(o, tuple(v.aval.shape), lay) if lay is not None else o
        for o, lay, v in zip(outs, layouts, eqn.outvars)
    ]


_RULES: dict[str, Callable[[Any, list, Pieces], list]] = {
    "cond": _cond,
    "reshape": _same_layout,
    "squeeze": _same_layout,
    "broadcast_in_dim": _same_layout,
    "transpose": _same_layout,
    "reduce_sum": _reduction,
    "reduce_max": _reduction,
    "reduce_min": _reduction,
    "reduce_prod": _reduction,
    "reduce_and": _reduction,
    "reduce_or": _reduction,
    "dot_general": _dot_general,
}
