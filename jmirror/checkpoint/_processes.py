"""Several processes saving one checkpoint: who writes, and when the others may look.

With `jm.MultiWorkerMirroredStrategy` every process calls `save`, `restore` and the manager's
methods in the same order. Reading the state (a `SyncOnRead` read, gathering `PerReplica`
components) takes device collectives, which every process makes in the caller's thread, and
only once every process has arrived at the save: a process that skips a save its peers make
goes on to its next collective (an input pass's agreement, a step), and a collective of the
save made meanwhile would be paired with that one (gloo then aborts the run, or the two
exchange wrong data). So a save first meets the other processes through the coordination
service: `jm.checkpoint.save` at its first barrier, the manager by gathering every process's
`data` through the service's key-value store. Then one process, the writer (the first process
of the strategy's devices), writes the files alone, with orbax set to this process only; the
other processes write nothing. Two barriers of every process surround the writer's work: the
first lets the writer start only once every process has finished looking at the directory
(its listing, the `exists` checks), the second lets no process go on before the checkpoint is
complete (and older steps are deleted). So every process sees the same steps.

The barriers are orbax's barriers of the JAX distributed runtime's coordination service
(`wait_at_barrier`), not device collectives, so a background save may wait in one while the
training loop's collectives run (a device collective from a second thread can deadlock gloo).
Their keys, and those of the gathered data, come from one counter per process, drawn in the
caller's thread; since every process makes the same calls in the same order, the keys agree.
Each process deletes its data key at the first barrier, where every process has read it.

Timeouts: with `jm.MultiWorkerMirroredStrategy(timeout_s=...)` a process that does not reach a
barrier (it skipped a `save` the others make, or it is stuck) ends the waiting processes after
`timeout_s` seconds, naming it (`jmirror._deadline`): the first barrier, the gathering of
per-process data and the gathering of per-replica components (`_encode`) wait `timeout_s`.
The barrier after the write also waits for the writer's writing, which a large state on a
slow filesystem may make long, so it waits `max(timeout_s, BARRIER_TIMEOUT_S)`; a writer that
dies ends the others through the runtime's heartbeat.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import orbax.checkpoint as ocp

from jmirror import _deadline, _shim
from jmirror._values import PyTree

if TYPE_CHECKING:
    from jmirror._strategy import MirroredStrategy

# A slow write (a large state, a slow filesystem) keeps the other processes waiting this long;
# a lost process ends the run sooner, through the runtime's heartbeat.
BARRIER_TIMEOUT_S = 3600
_KEYS = itertools.count()
# The runtime's barrier times out this much after jmirror's bound, which names the processes.
_BACKSTOP_S = 30
_SETTING = "jm.MultiWorkerMirroredStrategy"
# The tasks that did not reach a barrier, as JAX's coordination service lists them.
_TIMED_OUT_TASKS = re.compile(r"Some timed out task names:\s*((?:\S+\s*)+?)\n\n", re.S)
DATA_CALL = "{call}'s gathering of every process's data"


class Keys(NamedTuple):
    """The coordination service's keys of one save, the same on every process.

    Attributes:
      start: the barrier before the writer writes.
      end: the barrier after it has written.
      data: the directory of every process's `data` (`{data}/{process}`).
    """

    start: str
    end: str
    data: str


@dataclasses.dataclass(frozen=True)
class Group:
    """The processes whose devices hold a strategy's replicas, and this process's place.

    Attributes:
      processes: the process indices of the strategy's devices, ascending.
      me: this process's index (`jax.process_index()`).
      timeout_s: the strategy's bound on a wait for the other processes, or None.
      call: the user's call these processes make together (`"jm.checkpoint.save"`,
        `"CheckpointManager.save"`), which names each of its waits if it times out.
    """

    processes: tuple[int, ...]
    me: int
    timeout_s: float | None = None
    call: str = "jm.checkpoint"

    @classmethod
    def of(cls, strategy: MirroredStrategy, call: str = "jm.checkpoint") -> Group:
        topology = strategy.topology
        processes = tuple(sorted({d.process_index for d in topology.devices}))
        return cls(processes, topology.process_index, topology.timeout_s, call)

    @property
    def size(self) -> int:
        return len(self.processes)

    @property
    def rank(self) -> int:
        """Returns this process's position among `processes` (0 for the writer)."""
        return self.processes.index(self.me)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    @property
    def writer(self) -> int:
        return self.processes[0]

    def keys(self, what: str) -> Keys:
        """Returns the keys of one save of `what` (draw them in the caller's thread).

        `what` is in every key, so that processes that make different saves at the same
        point (one skipped a save) never take each other's keys.
        """
        n = next(_KEYS)
        data = f"jmirror/checkpoint/{n}/data/{urllib.parse.quote(what, safe='')}"
        return Keys(
            f"jmirror.checkpoint.{n}.start:{what}", f"jmirror.checkpoint.{n}.end:{what}", data
        )

    def barrier(self, key: str, call: str | None = None, timeout_s: float | None = None) -> None:
        """Waits until every process of the group reaches the barrier `key` (any thread).

        Bounded by `timeout_s` (default: the strategy's), and by `BARRIER_TIMEOUT_S` without
        one; `call` names the barrier if it times out (equal on every process; default: from
        the key).
        """
        if self.size == 1:
            return
        call = call or f"{self.call}'s barrier {key}"
        wait = ocp.multihost.get_barrier_sync_fn(processes=set(self.processes))
        if timeout_s is None:
            timeout_s = self.timeout_s
        if timeout_s is None:
            wait(key=key, timeout_ms=BARRIER_TIMEOUT_S * 1000)
            return
        # The runtime's own timeout comes first, since it knows who did not arrive;
        # jmirror's bound is the backstop.
        with _deadline.bounded(call, timeout_s + _BACKSTOP_S):
            try:
                wait(key=key, timeout_ms=int(timeout_s * 1000))
            except Exception as e:
                if "Barrier timed out" not in str(e):
                    raise
                absent = _timed_out_tasks(str(e))
                _deadline.expire(call, timeout_s, setting=_SETTING, absent=absent)

    def arrive(self, keys: Keys) -> None:
        """Waits at the barrier before writing, where every process has gathered its data.

        From there on no process reads its data key: this process's is deleted, so that the
        coordination service keeps no key of a past save.
        """
        what = keys.start.partition(":")[2]
        self.barrier(keys.start, f"{self.call}'s barrier before writing {what}")
        client = _shim.distributed_client() if self.size > 1 else None
        if client is not None:
            try:
                client.key_value_delete(f"{keys.data}/{self.me}")
            except Exception:  # noqa: BLE001 - a key left behind costs only its bytes
                pass

    def write(self, keys: Keys, work: Callable[[], None], *, arrived: bool = False) -> None:
        """Runs `work` on the writer only, between the two barriers of `keys`.

        `arrived`: the caller already waited at the first barrier (`arrive`). The writer
        raises its error after the second barrier, so no process waits for it in vain; the
        others learn of a failed write from the files (see the callers).
        """
        if not arrived:
            self.arrive(keys)
        what = keys.start.partition(":")[2]
        error: BaseException | None = None
        if self.is_writer:
            try:
                work()
            except BaseException as e:  # raised below, after the others are released
                error = e
        after = None if self.timeout_s is None else max(self.timeout_s, BARRIER_TIMEOUT_S)
        self.barrier(keys.end, f"{self.call}'s barrier after writing {what}", after)
        if error is not None:
            raise error

    def gather_json(self, data: PyTree, keys: Keys) -> list[Any]:
        """Returns every process's JSON-able `data`, in process order (every process calls it).

        Through the coordination service's key-value store, not a device collective: it is
        where the processes meet before the save's first collective (see the module's
        docstring). A process whose data has not come within the strategy's `timeout_s`
        ends this one, named (`BARRIER_TIMEOUT_S` without a bound: a `TimeoutError`).
        """
        if self.size == 1:
            return [data]
        client = _shim.distributed_client()
        if client is None:
            raise RuntimeError(
                f"{self.call}: the strategy spans processes {list(self.processes)}, but JAX's "
                "coordination service is not running in this process; start every process "
                "with jm.distributed.initialize()."
            )
        call = DATA_CALL.format(call=self.call)
        client.key_value_set(f"{keys.data}/{self.me}", json.dumps(data), True)
        bound = BARRIER_TIMEOUT_S if self.timeout_s is None else self.timeout_s
        end = time.monotonic() + bound
        found: dict[int, str] = {}
        # The service's own timeout comes first, since it knows who did not arrive;
        # jmirror's bound is the backstop.
        backstop = None if self.timeout_s is None else self.timeout_s + _BACKSTOP_S
        with _deadline.bounded(call, backstop):
            for p in self.processes:
                if p == self.me:
                    continue
                left_ms = max(1, int((end - time.monotonic()) * 1000))
                try:
                    found[p] = client.blocking_key_value_get(f"{keys.data}/{p}", left_ms)
                except Exception as e:
                    if "DEADLINE_EXCEEDED" not in str(e):
                        raise
                    self._not_arrived(client, keys, call, bound)
        found[self.me] = json.dumps(data)
        return [json.loads(found[p]) for p in self.processes]

    def _not_arrived(self, client: Any, keys: Keys, call: str, bound: float) -> None:
        """Ends the process (or raises, without a bound) naming the processes whose data has
        not come."""
        try:
            here = {key.rpartition("/")[2] for key, _ in client.key_value_dir_get(keys.data)}
        except Exception:  # noqa: BLE001 - then the processes' published progress names them
            absent = None
        else:
            absent = tuple(p for p in self.processes if p != self.me and str(p) not in here)
        if self.timeout_s is not None:
            _deadline.expire(call, self.timeout_s, setting=_SETTING, absent=absent or None)
        raise TimeoutError(
            f"{call} has not completed in {bound:g} s: processes {list(absent or ())} have "
            "not arrived at this save. Find why: every process must make the same saves in "
            "the same order."
        )

    def not_written(self, call: str, path: Path) -> RuntimeError:
        return RuntimeError(
            f"{call}: process {self.writer}, which writes the checkpoints of this strategy, did "
            f"not complete {path}; its error is raised on process {self.writer}."
        )


def _timed_out_tasks(message: str) -> tuple[int, ...] | None:
    """Returns the process indices a barrier's timeout error lists as absent (JAX's task =
    process)."""
    match = _TIMED_OUT_TASKS.search(message + "\n\n")
    if match is None:
        return None
    names = match.group(1)
    found = re.findall(r"task:(\d+)" if "task:" in names else r"\b(\d+)\b", names)
    return tuple(sorted({int(t) for t in found})) or None
