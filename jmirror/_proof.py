"""The static proof of which values are identical on every replica.

A replicated function is traced once into a jaxpr under `jax.pmap` semantics
(`jax.make_jaxpr(..., axis_env=[(axis_name, N)])`). This module walks that jaxpr forward and
marks every variable *varying* (may differ between replicas) or *identical*:

- per-replica inputs vary; mirrored and broadcast inputs, constants and literals are identical;
- `axis_index`, `io_callback` (a host function with effects: it may answer each replica
  differently), stateful RNG and every collective over the replica axis other than the full
  reductions below vary;
- `pure_callback` is a pure host function: like any other equation, its results vary only
  when one of its arguments does;
- `psum`, `pmax`, `pmin` and `all_gather` over the replica axis (without index groups) are
  identical, whatever their inputs;
- any other equation varies when one of its inputs varies;
- control flow is followed exactly: loop carries are iterated to a fixpoint, and a `cond` or
  `while_loop` whose predicate varies makes its outputs vary. A collective inside such a
  `cond` or `while_loop` is a `ValueError`: replicas would wait on each other forever.

The analysis is sound (an identical value never differs) and conservative where it cannot
see through an equation. It also reports, for each *marker*, which of its inputs vary.

A marker is an equation of the `jmirror_marker` primitive defined here: an identity on its
operands, carrying a `marker_id`. `sync` and `merge_call` (see `_context.py`) pass the values
they need to know about through `mark(values, marker_id)` while the replica function is traced;
the proof finds the equation by its primitive and reports on its operands. The primitive is
transparent to JAX's transformations (differentiation, batching) and lowers to nothing.

The proof also knows which values are passed through unchanged: an output of a call (`jit`,
`remat`, custom derivatives), of a `cond` whose every branch returns the same operand, or a
loop carry that every iteration returns as it got it, *is* that operand. A key restore, an
equation of the `jmirror_restore_key` primitive (`restore_key(written, original, folded)`,
see `_nnx.py`), asks that question of an rng stream's key after the replica function: when
the key the function left *is* the key with the replica id folded in, passed through
(`nnx.jit` and `nnx.remat` give it back as a new value), the proof decides for the original
key (identical on every replica), else for the written one (a reseed: what the proof says of
it). The decision is structural, made from the jaxpr alone, and the primitive lowers to what
was decided (its `KeyChoice`), so what runs is what was proven; undecided (lowered without
the proof) it gives the original wherever the written key equals the folded one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
from jax.interpreters import ad, batching, mlir

MARKER = jex.Primitive("jmirror_marker")
MARKER.multiple_results = True
MARKER.def_impl(lambda *xs, marker_id: list(xs))
MARKER.def_abstract_eval(lambda *avals, marker_id: list(avals))
mlir.register_lowering(MARKER, lambda ctx, *xs, marker_id: list(xs))


def _marker_jvp(primals, tangents, *, marker_id):
    return MARKER.bind(*primals, marker_id=marker_id), list(tangents)


def _marker_batch(args, dims, *, marker_id):
    return MARKER.bind(*args, marker_id=marker_id), list(dims)


ad.primitive_jvps[MARKER] = _marker_jvp
batching.primitive_batchers[MARKER] = _marker_batch


def mark(values: Sequence[Any], marker_id: int) -> list[Any]:
    """`values` unchanged, tagged in the traced jaxpr with the marker `marker_id`."""
    return MARKER.bind(*values, marker_id=marker_id)


class KeyChoice:
    """Holds what one `restore_key` gives, decided by the proof (`Proof`) from the jaxpr alone:
    the original key (`restore` True), the key the function wrote (False), or not decided
    yet (None: the original wherever the written key equals the folded one)."""

    __slots__ = ("restore",)

    def __init__(self) -> None:
        self.restore: bool | None = None

    def __repr__(self) -> str:
        return {None: "undecided", True: "original", False: "written"}[self.restore]


RESTORE = jex.Primitive("jmirror_restore_key")


def restore_key(written: Any, original: Any, folded: Any) -> Any:
    """Returns an rng stream's key after the replica function: `original` when `written` is the
    `folded` key passed through unchanged (the proof decides), else `written`.

    The three are arrays of one shape and dtype (typed PRNG keys or raw key data).
    """
    return RESTORE.bind(written, original, folded, choice=KeyChoice())


def _restore_select(written: Any, original: Any, folded: Any) -> Any:
    """Returns the undecided restore: `original` for each key that `written` holds equal to
    `folded`'s (raw key data: a key along the last axis)."""
    typed = jax.numpy.issubdtype(written.dtype, jax.dtypes.prng_key)
    a, b = (
        (jax.random.key_data(written), jax.random.key_data(folded)) if typed else (written, folded)
    )
    same = jax.numpy.all(a == b, axis=-1, keepdims=not typed) if a.ndim else a == b
    return jax.lax.select(jax.numpy.broadcast_to(same, written.shape), original, written)


def _restore_impl(written: Any, original: Any, folded: Any, *, choice: KeyChoice) -> Any:
    if choice.restore is None:
        return _restore_select(written, original, folded)
    return original if choice.restore else written


def _restore_lowering(ctx: Any, written: Any, original: Any, folded: Any, *, choice: KeyChoice):
    if choice.restore is None:
        lowered = mlir.lower_fun(_restore_select, multiple_results=False)
        return lowered(ctx, written, original, folded)
    return [original if choice.restore else written]


def _restore_batch(args: Sequence[Any], dims: Sequence[Any], *, choice: KeyChoice):
    if choice.restore is not None:
        k = 1 if choice.restore else 0
        return args[k], dims[k]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    return RESTORE.bind(*moved, choice=choice), 0


RESTORE.def_impl(_restore_impl)
RESTORE.def_abstract_eval(lambda written, original, folded, *, choice: written)
mlir.register_lowering(RESTORE, _restore_lowering)
batching.primitive_batchers[RESTORE] = _restore_batch


# The call primitives whose one jaxpr is the equation itself (operands in, results out).
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
    }
)


_REDUCTIONS = frozenset({"psum", "pmax", "pmin", "all_gather", "psum_invariant"})
_ALWAYS_VARYING = frozenset({"axis_index", "rng_uniform", "io_callback", "ppermute", "pbroadcast"})
_AXIS_PARAMS = ("axes", "axis_name")

_DIVERGENT = (
    "{prim} whose {what} differs across replicas contains a cross-replica collective "
    "({collective}): replicas would wait on each other forever. Make the {what} identical on "
    "every replica (for example reduce it with jm.all_reduce first), or move the collective "
    "out of the {where}."
)


class Proof:
    """Result of analysing one replica jaxpr."""

    def __init__(self, axis_name: str):
        self.axis_name = axis_name
        self.markers: dict[int, list[bool]] = {}
        # Per jaxpr (by id, kept alive): each variable's root, the variable it is unchanged.
        self._roots: dict[int, tuple[Any, dict[Any, Any]]] = {}

    # --- helpers -----------------------------------------------------------------------------

    def _axes(self, eqn: jex.JaxprEqn) -> tuple:
        for key in _AXIS_PARAMS:
            if key in eqn.params:
                value = eqn.params[key]
                return tuple(value) if isinstance(value, (tuple, list)) else (value,)
        return ()

    def _communicates(self, eqn: jex.JaxprEqn) -> bool:
        return eqn.primitive.name != "axis_index" and self.axis_name in self._axes(eqn)

    def find_collective(self, jaxpr: jex.Jaxpr) -> str | None:
        """Returns the name of the first collective over the replica axis inside `jaxpr`, if any."""
        for eqn in jaxpr.eqns:
            if self._communicates(eqn):
                return eqn.primitive.name
            for sub in jex.jaxprs_in_params(eqn.params):
                found = self.find_collective(sub)
                if found is not None:
                    return found
        return None

    def _introduces_variation(self, jaxpr: jex.Jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in _ALWAYS_VARYING or (self._communicates(eqn) and name not in _REDUCTIONS):
                return True
            if any(self._introduces_variation(s) for s in jex.jaxprs_in_params(eqn.params)):
                return True
        return False

    # --- analysis ------------------------------------------------------------------------------

    def run(self, closed: jex.ClosedJaxpr | jex.Jaxpr, in_varying: Sequence[bool]) -> list[bool]:
        """Returns, for each output of the closed jaxpr, whether it may vary."""
        jaxpr = closed.jaxpr if isinstance(closed, jex.ClosedJaxpr) else closed
        env: dict[Any, bool] = {v: False for v in jaxpr.constvars}
        env.update(zip(jaxpr.invars, in_varying))

        def read(atom: jex.Var | jex.Literal) -> bool:
            return False if isinstance(atom, jex.Literal) else env.get(atom, False)

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            if eqn.primitive is RESTORE:
                outs = [self._restore(jaxpr, eqn, ins)]
            else:
                outs = self._equation(eqn, ins)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def _restore(self, jaxpr: jex.Jaxpr, eqn: jex.JaxprEqn, ins: list[bool]) -> bool:
        """Decides a `restore_key`: the original key when the written one is the folded key
        passed through unchanged (sound: it then holds the folded value on every replica)."""
        written, _, folded = (self._root(jaxpr, v) for v in eqn.invars)
        restore = written is folded and not isinstance(written, jex.Literal)
        eqn.params["choice"].restore = restore
        return ins[1] if restore else ins[0]

    # --- values passed through unchanged ------------------------------------------------------

    def _root(self, jaxpr: jex.Jaxpr, atom: jex.Var | jex.Literal) -> jex.Var | jex.Literal:
        """Returns the variable of `jaxpr` that `atom` is, passed through unchanged (itself
        if none)."""
        if isinstance(atom, jex.Literal):
            return atom
        cached = self._roots.get(id(jaxpr))
        if cached is None:
            roots: dict[Any, Any] = {}
            for eqn in jaxpr.eqns:
                for out, i in zip(eqn.outvars, self._forwards(eqn)):
                    if i is not None and not isinstance(eqn.invars[i], jex.Literal):
                        roots[out] = roots.get(eqn.invars[i], eqn.invars[i])
            cached = self._roots[id(jaxpr)] = (jaxpr, roots)
        return cached[1].get(atom, atom)

    def _forwarded(self, closed: jex.ClosedJaxpr | jex.Jaxpr) -> list[int | None]:
        """Returns, for each output of a jaxpr, the input it is unchanged (None: computed)."""
        jaxpr = closed.jaxpr if isinstance(closed, jex.ClosedJaxpr) else closed
        index: dict[object, int] = {v: k for k, v in enumerate(jaxpr.invars)}
        return [
            None if isinstance(v, jex.Literal) else index.get(self._root(jaxpr, v))
            for v in jaxpr.outvars
        ]

    def _forwards(self, eqn: jex.JaxprEqn) -> list[int | None]:
        """Returns, for each output of an equation, the operand it is (None: computed)."""
        n_out, name = len(eqn.outvars), eqn.primitive.name
        if eqn.primitive is MARKER:
            return list(range(n_out))
        if name == "cond":  # the same operand from every branch (operands follow the index)
            every = zip(*(self._forwarded(b) for b in eqn.params["branches"]))
            return [f[0] + 1 if f[0] is not None and len(set(f)) == 1 else None for f in every]
        if name == "scan":  # a carry every iteration returns as it got it
            n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
            body = self._forwarded(eqn.params["jaxpr"])
            return [
                n_consts + j if j < n_carry and body[j] == n_consts + j else None
                for j in range(n_out)
            ]
        if name == "while":
            n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
            body = self._forwarded(eqn.params["body_jaxpr"])
            return [n_cond + n_body + j if body[j] == n_body + j else None for j in range(n_out)]
        subs = list(jex.jaxprs_in_params(eqn.params)) if name in _CALLS else []
        if len(subs) == 1 and _arity(subs[0]) == (len(eqn.invars), n_out):
            return self._forwarded(subs[0])
        return [None] * n_out

    def _equation(self, eqn: jex.JaxprEqn, ins: list[bool]) -> list[bool]:
        name = eqn.primitive.name
        n_out = len(eqn.outvars)
        if name in _REDUCTIONS and self.axis_name in self._axes(eqn):
            grouped = eqn.params.get("axis_index_groups") is not None
            return [grouped] * n_out
        if name in _ALWAYS_VARYING or self._communicates(eqn):
            return [True] * n_out
        if name == "scan":
            return self._scan(eqn, ins)
        if name == "while":
            return self._while(eqn, ins)
        if name == "cond":
            return self._cond(eqn, ins)
        if eqn.primitive is MARKER:
            self._record_marker(eqn.params["marker_id"], ins)
            return list(ins)
        subs = list(jex.jaxprs_in_params(eqn.params))
        if not subs:
            return [any(ins)] * n_out
        if len(subs) == 1 and _arity(subs[0]) == (len(ins), n_out):
            return self.run(subs[0], ins)
        # An equation we cannot see through: conservative.
        varies = any(ins) or any(self._introduces_variation(s) for s in subs)
        return [varies] * n_out

    def _record_marker(self, marker_id: int, ins: list[bool]) -> None:
        previous = self.markers.get(marker_id)
        if previous is None or len(previous) != len(ins):
            self.markers[marker_id] = list(ins)
        else:
            self.markers[marker_id] = [a or b for a, b in zip(previous, ins)]

    def _scan(self, eqn: jex.JaxprEqn, ins: list[bool]) -> list[bool]:
        body = eqn.params["jaxpr"]
        n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        consts, carry, xs = (
            ins[:n_consts],
            ins[n_consts : n_consts + n_carry],
            ins[n_consts + n_carry :],
        )
        while True:
            outs = self.run(body, consts + carry + xs)
            new_carry = [a or b for a, b in zip(carry, outs[:n_carry])]
            if new_carry == carry:
                return carry + outs[n_carry:]
            carry = new_carry

    def _while(self, eqn: jex.JaxprEqn, ins: list[bool]) -> list[bool]:
        cond_jaxpr, body_jaxpr = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
        n_cond, n_body = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        cond_consts, body_consts = ins[:n_cond], ins[n_cond : n_cond + n_body]
        carry = ins[n_cond + n_body :]
        while True:
            predicate_varies = self.run(cond_jaxpr, cond_consts + carry)[0]
            if predicate_varies:
                collective = self.find_collective(body_jaxpr.jaxpr) or self.find_collective(
                    cond_jaxpr.jaxpr
                )
                if collective is not None:
                    raise ValueError(
                        _DIVERGENT.format(
                            prim="A while_loop",
                            where="while_loop",
                            what="predicate",
                            collective=collective,
                        )
                    )
                # The trip count differs between replicas, so every carry may differ.
                carry = [True] * len(carry)
            outs = self.run(body_jaxpr, body_consts + carry)
            new_carry = [a or b for a, b in zip(carry, outs)]
            if new_carry == carry:
                return carry
            carry = new_carry

    def _cond(self, eqn: jex.JaxprEqn, ins: list[bool]) -> list[bool]:
        index_varies, operands = ins[0], ins[1:]
        branches = eqn.params["branches"]
        if index_varies:
            for branch in branches:
                collective = self.find_collective(branch.jaxpr)
                if collective is not None:
                    raise ValueError(
                        _DIVERGENT.format(
                            prim="A cond", where="cond", what="predicate", collective=collective
                        )
                    )
        outs = [index_varies] * len(eqn.outvars)
        for branch in branches:
            outs = [a or b for a, b in zip(outs, self.run(branch, operands))]
        return outs


def _arity(jaxpr: jex.Jaxpr) -> tuple[int, int]:
    return len(jaxpr.invars), len(jaxpr.outvars)


def dependencies(closed: jex.ClosedJaxpr | jex.Jaxpr) -> list[int]:
    """Returns, for each output of a (closed) jaxpr, the inputs it is computed from, as a bit
    mask over the inputs' positions. Calls (`jit`, `remat`, custom derivatives, `shard_map`)
    are followed inside; any other equation's outputs come from all of its operands."""
    jaxpr = closed.jaxpr if isinstance(closed, jex.ClosedJaxpr) else closed
    return _dependencies(jaxpr, [1 << i for i in range(len(jaxpr.invars))])


def _dependencies(jaxpr: jex.Jaxpr, ins: list[int]) -> list[int]:
    env: dict[Any, int] = dict(zip(jaxpr.invars, ins))

    def read(atom: object) -> int:
        return env.get(atom, 0) if isinstance(atom, jex.Var) else 0  # literals: nothing

    for eqn in jaxpr.eqns:
        operands = [read(a) for a in eqn.invars]
        subs = list(jex.jaxprs_in_params(eqn.params))
        name = eqn.primitive.name
        if (name in _CALLS or name == "shard_map") and len(subs) == 1:
            inner = subs[0]
            if _arity(inner) == (len(eqn.invars), len(eqn.outvars)):
                env.update(zip(eqn.outvars, _dependencies(inner, operands)))
                continue
        every = 0
        for mask in operands:
            every |= mask
        env.update((v, every) for v in eqn.outvars)
    return [read(v) for v in jaxpr.outvars]


def prove(
    closed: jex.ClosedJaxpr | jex.Jaxpr, in_varying: Sequence[bool], axis_name: str
) -> tuple[list[bool], Proof]:
    """Analyses a replica jaxpr; returns each output's "may vary" flag and the proof."""
    proof = Proof(axis_name)
    return proof.run(closed, in_varying), proof
