"""Dispatching replicated steps: the bound on steps in flight and the donation policy.

**The bound.** On XLA:CPU host devices, XLA's collective rendezvous aborts the process when too
many collective programs are queued back to back (64 in flight aborted on 8 host devices; see
benchmarks/RESULTS.md). jmirror keeps a queue of the steps it dispatched, each recorded by one
small output (every output of a step is ready when the step is done), and waits for the oldest
before dispatching past the limit. There is one queue per platform, shared by every strategy
on it, so strategies interleaved on the same devices never add up past their limits. Steps
that JAX dispatches itself (a replicated function traced inside the caller's `jax.jit`, `grad`,
`scan`, ...) are not jmirror's to bound: their outputs are tracers and are never queued.

**Donation.** `donation="always"` donates exactly what `donate_argnums` names. `"auto"` also
does, except on several XLA:CPU host devices for arguments holding a leaf of `LARGE_DONATION`
bytes or more, where donating made steps much slower (benchmarks/RESULTS.md). Before a donating
call, `Donation.check` refuses arguments that jaxlib would crash on (a deleted buffer, or one
buffer passed twice), with a `ValueError` instead of the process dying. A buffer donated once
and passed again to another step, not donated there, crashes jaxlib as well when the step runs
on several devices (on one it raises): `refuse_deleted` checks every argument leaf of such
calls, one C-level pass, and `explain_deleted` names the leaf where JAX raised.

**Per call, flat in the tree's size.** A replicated function asks its `Donation`
(`Donation(dispatch, donate_argnums)`) on every call. The policy depends only on the donated
leaves' shapes and dtypes, so it is decided once per input signature: the key is the identity
of the leaves' abstract values, which JAX shares between every output of one compiled program
(so `state = step(state, ...)` hits the same key every call) and which the cache keeps alive
(so an identity is never reused while it is a key). The check then costs C-level passes over
the flattened leaves (no Python code runs per leaf); paths are worked out only to explain a
problem.

**Where the time goes.** `Dispatch.stats` is the strategy's `jmirror._step_stats.Recorder`:
the wait for room reports the seconds it blocked (none when there is room, which costs
nothing), and `track` names the function whose row the call counts in.

**Timeout.** With several processes and `timeout_s` (`jm.MultiWorkerMirroredStrategy`), each
tracked step is also watched by `jmirror._deadline`, which ends the process when one has not
completed `timeout_s` seconds after it was waited on: so the wait for room here is bounded too.
The dispatch itself is bounded as well (`bounded`): XLA:CPU runs a cheap program inline, so
a step may wait for the other processes before the call returns.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import operator
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.core

from jmirror import _deadline, _step_stats
from jmirror._topology import Topology
from jmirror._values import PyTree

DONATIONS = ("auto", "always")
# Steps in flight by platform: XLA:CPU host devices abort in their collective rendezvous when
# many programs are queued back to back; accelerators queue deeper safely.
DEFAULT_IN_FLIGHT = {"cpu": 2}
DEFAULT_IN_FLIGHT_ACCELERATOR = 16
# The most steps in flight allowed on several CPU host devices (32 ran, 64 aborted).
MAX_IN_FLIGHT_HOST = 16
# With donation="auto" on several XLA:CPU devices, arguments holding a leaf this large are
# not donated.
LARGE_DONATION = 8 * 2**20


def check_max_in_flight(max_in_flight: object, platform: str, num_devices: int, call: str) -> int:
    """Validates `max_in_flight` (None: the platform's default) and returns the bound."""
    if max_in_flight is None:
        return DEFAULT_IN_FLIGHT.get(platform, DEFAULT_IN_FLIGHT_ACCELERATOR)
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int):
        raise TypeError(
            f"{call}(max_in_flight=...) expects an int or None, got {max_in_flight!r} of type "
            f"{type(max_in_flight).__name__}."
        )
    if max_in_flight < 1:
        raise ValueError(
            f"{call}(max_in_flight={max_in_flight}) must be at least 1 (or None for the "
            "platform's safe default)."
        )
    if platform == "cpu" and num_devices > 1 and max_in_flight > MAX_IN_FLIGHT_HOST:
        raise ValueError(
            f"{call}(max_in_flight={max_in_flight}) is too deep for {num_devices} CPU host "
            "devices: XLA:CPU's collective rendezvous aborts the process when too many "
            "collective steps are queued (64 aborted on 8 host devices). Use at most "
            f"{MAX_IN_FLIGHT_HOST}, or None for the default of "
            f"{DEFAULT_IN_FLIGHT['cpu']}, which costs no measurable speed there."
        )
    return max_in_flight


def check_donation(donation: object, call: str) -> str:
    if donation not in DONATIONS:
        raise ValueError(
            f"{call}(donation={donation!r}) is not a donation policy; expected 'auto' (skip "
            "donating where it is measured to be slower: arguments holding leaves of 8 MiB or "
            "more on several CPU host devices) or 'always' (donate exactly what "
            "donate_argnums names)."
        )
    return donation


class InFlight:
    """The steps dispatched on one platform and not yet known to be finished."""

    def __init__(self):
        self._queue: collections.deque[jax.Array] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._queue)

    def __getitem__(self, i: int) -> jax.Array:
        return self._queue[i]

    def wait_for_room(self, limit: int) -> float:
        """Blocks until fewer than `limit` steps are queued; returns the seconds it blocked.

        When the queue is full, the older steps are waited for together (one batched
        `jax.block_until_ready`), down to half the bound: the next `limit // 2` calls then
        find room at once, so most calls wait on nothing and none waits on one step at a
        time. At most `limit` steps are ever in flight.
        """
        if len(self._queue) < limit:
            # Read without the lock first: the common call takes no lock. A call may pass
            # beside another thread's here, as it may between this check and its `track`.
            return 0.0
        with self._lock:
            if len(self._queue) < limit:
                return 0.0
            done = [self._queue.popleft() for _ in range(len(self._queue) - limit // 2)]
        began = _step_stats.clock()
        for token in done:  # concrete arrays: their own method, without jax's tree walk
            token.block_until_ready()
        return _step_stats.clock() - began

    def track(self, token: jax.Array) -> None:
        """Records a dispatched step by its token (a concrete scalar the step returns, which
        only jmirror holds: it is never donated or deleted)."""
        with self._lock:
            self._queue.append(token)


@dataclasses.dataclass(frozen=True, eq=False)
class Dispatch:
    """How a strategy dispatches steps: its bound on the shared queue, and its donation policy.

    Make one with `Dispatch.create(topology, max_in_flight, donation)`.
    """

    max_in_flight: int
    donation: str
    topology: Topology
    in_flight: InFlight
    timeout_s: float | None = None  # the bound on a step across processes (None: one process)
    # The strategy's counts of where the time goes (strategy.step_stats).
    stats: _step_stats.Recorder = dataclasses.field(default_factory=_step_stats.Recorder)

    @classmethod
    def create(
        cls, topology: Topology, max_in_flight: object, donation: object, call: str
    ) -> Dispatch:
        platform = topology.platform
        bound = check_max_in_flight(max_in_flight, platform, topology.num_devices, call)
        timeout = topology.timeout_s if topology.process_count > 1 else None
        in_flight = in_flight_for(platform)
        return cls(bound, check_donation(donation, call), topology, in_flight, timeout)

    def donates(self, donated: Sequence[Any]) -> bool:
        """Returns whether a step donates the arguments `donated` under this policy."""
        return donates(self.donation, self.topology.platform, self.topology.num_devices, donated)

    def wait_for_room(self) -> None:
        """Blocks until fewer than `max_in_flight` steps are queued on the platform (the wait
        counts as the open call's `room_wait_s`)."""
        waited = self.in_flight.wait_for_room(self.max_in_flight)
        if waited:
            _step_stats.waited_for_room(waited)

    def bounded(self, call: object) -> contextlib.AbstractContextManager[None]:
        """Returns the bound on dispatching a step across processes (a cheap one may run inline)."""
        return _deadline.bounded(call, self.timeout_s)

    def track(self, token: PyTree, call: object = "a replicated step") -> None:
        """Records a dispatched step by one of its outputs (`call` names it if it times out,
        and its row in `stats`)."""
        self.in_flight.track(token)
        self.stats.dispatched(call)
        if self.timeout_s is not None:
            _deadline.watch(token, call, self.timeout_s)


_BOUNDS: dict[str, InFlight] = {}
_BOUNDS_LOCK = threading.Lock()


def in_flight_for(platform: str) -> InFlight:
    """Returns the queue of steps in flight shared by every strategy on `platform`."""
    with _BOUNDS_LOCK:
        return _BOUNDS.setdefault(platform, InFlight())


def donates(donation: str, platform: str, num_devices: int, donated: Sequence[Any]) -> bool:
    """Returns whether a step donates the arguments `donated` under the policy `donation`."""
    return _donates_any_size(donation, platform, num_devices) or _all_small(
        jax.tree.leaves(donated)
    )


def _donates_any_size(donation: str, platform: str, num_devices: int) -> bool:
    return donation == "always" or platform != "cpu" or num_devices == 1


# How many input signatures a `Donation` remembers (more: it starts again, still correct).
_DECISIONS_KEPT = 16


class Donation:
    """The donation of one replicated function's `donate_argnums` under one `Dispatch`.

    `check(call, args, kwargs)` runs before every call: whether it donates (the policy,
    decided once per input signature) and, if so, the check that no donated buffer is deleted
    or passed twice. Neither runs Python code per leaf in the common case.
    """

    def __init__(self, dispatch: Dispatch, argnums: tuple[int, ...]):
        self.argnums = argnums
        topology = dispatch.topology
        self._always = _donates_any_size(dispatch.donation, topology.platform, topology.num_devices)
        # Donated leaves' aval identities -> (those avals, kept alive; the decision).
        self._decided: dict[tuple[int, ...], tuple[tuple[Any, ...], bool]] = {}

    def donates(self, args: tuple) -> bool:
        """Returns whether a call with positional arguments `args` donates (no check)."""
        if not self.argnums:
            return False
        if self._always:
            return True
        donated = self._donated(list(map(_LEAVES, args)))
        return self._policy(donated, _all_concrete(donated))

    def check(self, call: object, args: tuple, kwargs: dict) -> bool:
        """Returns whether this call donates; if it does, refuses what would crash jaxlib.

        Raises:
          ValueError: a donated leaf is deleted (donated to an earlier call) or is passed
            twice in this call, naming its path (`call` names the function).
        """
        if not self.argnums:
            return False
        per_arg = list(map(_LEAVES, args))
        donated = self._donated(per_arg)
        concrete = _all_concrete(donated)
        if not (self._always or self._policy(donated, concrete)):
            return False
        if not _safe(donated, concrete, per_arg, kwargs, self.argnums):
            _explain_donated(call, args, kwargs, self.argnums)
        return True

    def check_prepared(self, call: object, prepared: PyTree, shared: bool = False) -> bool:
        """Returns whether a prepared call (`jmirror._arguments.Prepared`) donates; if it
        does, refuses what would crash jaxlib (as `check`), from the call's flat leaves.
        With `shared` (the arguments reach one object holding leaves twice: a shared NNX
        `Variable`), a leaf passed twice makes the call not donate instead.

        Raises:
          ValueError: a donated leaf is deleted (donated to an earlier call) or is passed
            twice in this call, naming its path (`call` names the function).
        """
        if not self.argnums:
            return False
        donated = prepared.donated
        concrete = _all_concrete(donated)
        if not (self._always or self._policy(donated, concrete)):
            return False
        if not _safe_flat(donated, concrete, prepared.others):
            if shared and not (concrete and any(map(_IS_DELETED, donated))):
                return False  # one buffer twice cannot be donated; nothing is deleted
            args, kwargs = prepared.arguments()
            _explain_donated(call, args, kwargs, self.argnums)
        return True

    def _donated(self, per_arg: list[list[Any]]) -> list[Any]:
        n = len(per_arg)
        if len(self.argnums) == 1:
            i = self.argnums[0]
            return per_arg[i] if i < n else []
        return list(itertools.chain.from_iterable(per_arg[i] for i in self.argnums if i < n))

    def _policy(self, donated: Sequence[Any], concrete: bool) -> bool:
        """`donates` for these leaves under "auto" on several CPU devices, once per signature.

        The key holds the ids of the leaves' avals; the cache holds those avals, so an id in
        a key is never reused by another object while the key exists.
        """
        if not concrete:
            return _all_small(donated)
        key = tuple(map(id, map(_AVAL, donated)))
        known = self._decided.get(key)
        if known is None:
            if len(self._decided) >= _DECISIONS_KEPT:
                self._decided.clear()
            avals = tuple(map(_AVAL, donated))
            known = self._decided[key] = (avals, _all_small(donated))
        return known[1]


def _all_small(donated: Sequence[Any]) -> bool:
    return all(getattr(x, "nbytes", 0) < LARGE_DONATION for x in donated)


def _safe(
    donated: list[Any],
    concrete: bool,
    per_arg: list[list[Any]],
    kwargs: dict,
    argnums: tuple[int, ...],
) -> bool:
    """Returns whether no donated leaf is deleted or appears twice, from the leaves per argument."""
    others = [a for i, a in enumerate(per_arg) if i not in argnums]
    if kwargs:
        others.append(jax.tree_util.tree_leaves(kwargs))
    return _safe_flat(donated, concrete, list(itertools.chain.from_iterable(others)))


def _safe_flat(donated: Sequence[Any], concrete: bool, others: Sequence[Any]) -> bool:
    """Returns whether no donated leaf is deleted or appears twice (in `donated` or among `others`);
    C-level passes when `concrete`: every donated leaf is a concrete `jax.Array`."""
    ids = set(map(id, donated))
    if len(ids) != len(donated) or not ids.isdisjoint(map(id, others)):
        return False
    if concrete:
        return not any(map(_IS_DELETED, donated))
    return not _any_deleted(donated)


_CONCRETE: set[type] = set()  # the concrete (never traced) jax.Array classes seen
_IS_DELETED = operator.methodcaller("is_deleted")
_AVAL = operator.attrgetter("aval")
_LEAVES = jax.tree_util.tree_leaves


def _all_concrete(leaves: Sequence[Any]) -> bool:
    """Returns whether every leaf is a concrete (placed, never traced) `jax.Array`: one C-level pass
    once each class has been seen."""
    if _CONCRETE.issuperset(map(type, leaves)):
        return True
    for x in leaves:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return False
        _CONCRETE.add(type(x))
    return True


def _any_deleted(leaves: Sequence[Any]) -> bool:
    """Returns whether a concrete array among `leaves` is deleted (one C-level pass if all are)."""
    if _CONCRETE.issuperset(map(type, leaves)):
        return any(map(_IS_DELETED, leaves))
    for x in leaves:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            _CONCRETE.add(type(x))
            if x.is_deleted():
                return True
    return False


def _explain_donated(
    call: object, args: tuple, kwargs: dict, donate_argnums: Sequence[int]
) -> None:
    """Raises the `ValueError` for the first donated leaf that is deleted or used twice."""
    donated = [i for i in donate_argnums if i < len(args)]
    explain_deleted(call, {f"args[{i}]": args[i] for i in donated})
    donated_ids: dict[int, str] = {}
    for i in donated:
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
                continue
            where = f"args[{i}]{jax.tree_util.keystr(path)}"
            first = donated_ids.setdefault(id(leaf), where)
            if first != where:
                raise ValueError(_TWICE.format(call=call, first=first, where=where))
    if not donated_ids:
        return
    for i, arg in enumerate(args):
        if i in donate_argnums:
            continue
        _check_not_donated(call, arg, f"args[{i}]", donated_ids)
    _check_not_donated(call, kwargs, "kwargs", donated_ids)


def refuse_deleted(call: object, prepared: PyTree, donated_checked: bool = False) -> None:
    """Raises the `ValueError` naming a deleted leaf among a prepared call's arguments
    (`jmirror._arguments.Prepared`): jaxlib ends the process on one when the step runs on
    several devices. `donated_checked`: the donated leaves were checked already (a call that
    donates, `Donation.check_prepared`).

    Raises:
      ValueError: an argument leaf was deleted (donated to an earlier call, or deleted by the
        caller), naming its path and the fix.
    """
    if _any_deleted(prepared.others) or (not donated_checked and _any_deleted(prepared.donated)):
        args, kwargs = prepared.arguments()
        explain_deleted(call, {"args": args, "kwargs": kwargs})


def explain_deleted(call: object, trees: dict[str, PyTree]) -> None:
    """Raises the `ValueError` for the first deleted array leaf of the `trees` (by the name
    that paths start with; none deleted: returns)."""
    if not _any_deleted(jax.tree_util.tree_leaves(list(trees.values()))):
        return  # the common case: one C-level pass, no paths
    for prefix, tree in trees.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
                if leaf.is_deleted():
                    where = f"{prefix}{jax.tree_util.keystr(path)}"
                    raise ValueError(_DELETED.format(call=call, where=where, leaf=leaf))


_DELETED = (
    "{call}: the argument at {where} (shape {leaf.shape}, dtype {leaf.dtype}) has been "
    "deleted: its buffer was donated to an earlier call (a step with donate_argnums reuses "
    "its donated inputs' buffers for its outputs) or deleted. Pass the value that call "
    "returned (state = step(state, ...)) instead of the old one, or keep the old value alive "
    "by dropping the argument from that step's donate_argnums."
)

_TWICE = (
    "{call}: one array is passed as the donated argument at {first} and again at {where}; a "
    "donated buffer is reused for the outputs, so it cannot be read a second time in the same "
    "call. Pass a copy (jnp.copy(x)) for one of them, or drop the argument from "
    "donate_argnums."
)


def _check_not_donated(
    call: object, tree: PyTree, prefix: str, donated_ids: dict[int, str]
) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        first = donated_ids.get(id(leaf))
        if first is not None:
            where = f"{prefix}{jax.tree_util.keystr(path)}"
            raise ValueError(_TWICE.format(call=call, first=first, where=where))
