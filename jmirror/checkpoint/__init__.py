"""Checkpoints of mirrored, sync-on-read and per-replica state, on orbax-checkpoint.

`save` and `restore` write and read one checkpoint directory; `CheckpointManager` keeps a
series of steps (with the input position as `data`), saves in the background and resumes
from the newest complete one. Mirrored state is written once, never N times; checkpoints
appear only when complete; restoring never unpickles anything.

Example:
    >>> import tempfile, numpy as np, jmirror as jm
    >>> strategy = jm.MirroredStrategy()
    >>> state = {"w": strategy.mirror(np.ones(2)), "step": 3}
    >>> path = tempfile.mkdtemp() + "/ckpt"
    >>> jm.checkpoint.save(path, state)
    >>> jm.checkpoint.restore(path)["step"]
    3
"""

from jmirror.checkpoint._checkpoint import restore as restore
from jmirror.checkpoint._checkpoint import save as save
from jmirror.checkpoint._format import CorruptCheckpointError as CorruptCheckpointError
from jmirror.checkpoint._manager import CheckpointManager as CheckpointManager

__all__ = ["CheckpointManager", "CorruptCheckpointError", "restore", "save"]
