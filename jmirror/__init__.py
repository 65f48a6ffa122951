"""jmirror: synchronous data parallelism on the devices of one machine or several, the JAX way."""

from jmirror import checkpoint as checkpoint  # jm.checkpoint.save, ...
from jmirror import distributed as distributed  # jm.distributed.initialize, ...
from jmirror import metrics as metrics  # noqa: E402  (jm.metrics.Mean, ...)
from jmirror._context import ReplicaContext as ReplicaContext
from jmirror._context import all_gather as all_gather
from jmirror._context import all_reduce as all_reduce
from jmirror._context import in_replica_context as in_replica_context
from jmirror._context import merge_call as merge_call
from jmirror._context import num_replicas as num_replicas
from jmirror._context import replica_context as replica_context
from jmirror._context import replica_id as replica_id
from jmirror._context import replica_key as replica_key
from jmirror._context import sync as sync
from jmirror._input import InputContext as InputContext
from jmirror._mirrored_state import MirroredStateError as MirroredStateError
from jmirror._mirrored_state import MirroredStateWarning as MirroredStateWarning
from jmirror._multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from jmirror._replicate import replicate as replicate
from jmirror._shard_update import shard_update as shard_update
from jmirror._step_stats import StepStats as StepStats
from jmirror._strategy import MirroredStrategy as MirroredStrategy
from jmirror._strategy import get_strategy as get_strategy
from jmirror._sync_batch_norm import sync_batch_norm as sync_batch_norm
from jmirror._values import Aggregation as Aggregation
from jmirror._values import PerReplica as PerReplica
from jmirror._values import ReduceOp as ReduceOp
from jmirror._values import Sharded as Sharded  # the value kind of jm.shard_update's state
from jmirror._values import Synchronization as Synchronization
from jmirror._values import SyncOnRead as SyncOnRead
from jmirror._values import ValueContext as ValueContext

__version__ = "0.1.0"

__all__ = [
    "Aggregation",
    "InputContext",
    "MirroredStateError",
    "MirroredStateWarning",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "StepStats",
    "SyncOnRead",
    "Synchronization",
    "ValueContext",
    "all_gather",
    "all_reduce",
    "get_strategy",
    "in_replica_context",
    "merge_call",
    "num_replicas",
    "replica_context",
    "replica_id",
    "replica_key",
    "replicate",
    "shard_update",
    "sync",
    "sync_batch_norm",
]

# tf.distribute's module-level names with another name in jmirror.
_TF_NAMES = {
    "get_replica_context": "replica_context() (inside a replica function)",
    "in_cross_replica_context": "in_replica_context() (negated)",
}


def __getattr__(name: str) -> object:
    ours = _TF_NAMES.get(name)
    hint = f"; tf.distribute's {name} is jmirror's jm.{ours}" if ours else ""
    raise AttributeError(f"module 'jmirror' has no attribute {name!r}{hint}")
