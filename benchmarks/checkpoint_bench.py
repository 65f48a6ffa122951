"""Checkpoints: bytes on disk, time `save` blocks, and restore time, against orbax and flax.

The state is a flax `TrainState` of the MLP 64 -> H -> H -> 10 (H = 2048 by default) with
optax Adam (parameters, mu and nu: about 52 MB), mirrored on 8 XLA:CPU host devices.

  (1) Bytes on disk, as a multiple of one copy of the state (the sum of its leaves' bytes):
      `jm.checkpoint.save` of the mirrored state; orbax's `StandardCheckpointer` of the same
      mirrored arrays; and the flax idiom, `flax.jax_utils.replicate(state)` (N stacked copies)
      saved by orbax. Target for jmirror: <= 1.1.
  (2) Time `CheckpointManager.save` blocks with `async_save=True`, against a save of the same
      state with `async_save=False` (which returns when the checkpoint is complete). Target:
      <= 0.10.
  (3) `jm.checkpoint.restore` of the mirrored state (read and placed on 8 devices), against
      orbax's own restore of the same single-copy tree (`StandardCheckpointer.restore` with an
      abstract target on one device). Target: <= 1.2. Beside it, orbax restoring that tree
      straight into the mirrored sharding.
  (4) Checksums: every array is written with its CRC-32C checksums and verified on restore.
      A sync save with checksums against the same save with the checksum function replaced
      by a constant (target: <= 1.05); the time `save` blocks with `async_save=True`, with
      and without checksums (the checksums run in the background thread, so the ratio should
      be about 1); and restore with verification against restore without.

Each measurement is repeated ROUNDS times, the compared operations alternating within a round;
the printed ratios are the medians of the per-round ratios (and the medians of the times are
shown beside them). The machine this was written on has 2 cores shared with other work, so
single timings drift by tens of percent: only the medians mean anything.

Run: python benchmarks/checkpoint_bench.py [--hidden 2048] [--rounds 7]
"""

import argparse
import pathlib
import shutil
import statistics
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.jax_utils  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax.training import train_state  # noqa: E402

import jmirror as jm  # noqa: E402
from benchmarks.models import FEATURES, MLP  # noqa: E402
from jmirror.checkpoint import _integrity  # noqa: E402


def make_state(hidden: int) -> train_state.TrainState:
    model = MLP(hidden)
    params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    # One step so that mu and nu are not zeros (zeros would compress).
    grads = jax.tree.map(lambda p: jnp.sin(p * 7.0) + 0.1, params)
    return state.apply_gradients(grads=grads)


def disk_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bytes_on_disk(state, mirrored, root: pathlib.Path) -> dict[str, float]:
    one_copy = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))
    jm.checkpoint.save(root / "jm", mirrored)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(root / "orbax_mirrored", mirrored)
        checkpointer.save(root / "orbax_flax_replicated", flax.jax_utils.replicate(state))
    names = ["jm", "orbax_mirrored", "orbax_flax_replicated"]
    return {name: disk_bytes(root / name) / one_copy for name in names}


def blocked_ratio(mirrored, root: pathlib.Path, rounds: int) -> tuple[float, float, float]:
    ratios, blocked, sync = [], [], []
    asynchronous = jm.checkpoint.CheckpointManager(root / "async", max_to_keep=1)
    synchronous = jm.checkpoint.CheckpointManager(root / "sync", max_to_keep=1, async_save=False)
    for step in range(rounds + 1):
        b = timed(lambda step=step: asynchronous.save(step, mirrored))
        asynchronous.wait_until_finished()
        s = timed(lambda step=step: synchronous.save(step, mirrored))
        if step:  # the first round compiles and warms the caches
            blocked.append(b)
            sync.append(s)
            ratios.append(b / s)
    asynchronous.close()
    synchronous.close()
    return statistics.median(ratios), statistics.median(blocked), statistics.median(sync)


def restore_ratio(state, mirrored, root: pathlib.Path, rounds: int) -> dict[str, float]:
    """Median times of jm's restore and of orbax's (one device; mirrored sharding)."""
    jm_path = root / "jm_restore"
    orbax_path = root / "orbax_single"
    jm.checkpoint.save(jm_path, mirrored)
    single = jax.device_put(state, jax.devices()[0])
    on_one = jax.tree.map(ocp.utils.to_shape_dtype_struct, single)
    replicated = jax.tree.map(lambda x: x.sharding, mirrored)
    on_all = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), on_one, replicated
    )
    times: dict[str, list[float]] = {"jm": [], "one": [], "all": [], "ratio": [], "ratio_all": []}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(orbax_path, single)
        checkpointer.wait_until_finished()
        for i in range(rounds + 1):
            one = timed(lambda: jax.block_until_ready(checkpointer.restore(orbax_path, on_one)))
            ours = timed(lambda: jax.block_until_ready(jm.checkpoint.restore(jm_path, state)))
            every = timed(lambda: jax.block_until_ready(checkpointer.restore(orbax_path, on_all)))
            if i:
                for key, value in [("jm", ours), ("one", one), ("all", every)]:
                    times[key].append(value)
                times["ratio"].append(ours / one)
                times["ratio_all"].append(ours / every)
    return {key: statistics.median(values) for key, values in times.items()}


def _without_checksums(fn):
    """Runs `fn` with the checksums replaced by a constant (the baseline of (4))."""
    real = _integrity.array_checksums
    _integrity.array_checksums = lambda arrays, *args, **kwargs: {n: [0] for n in arrays}
    try:
        return fn()
    finally:
        _integrity.array_checksums = real


def checksum_cost(mirrored, root: pathlib.Path, rounds: int) -> dict[str, float]:
    """Median ratios: with / without checksums, for sync saves, async blocking and restores."""
    times: dict[str, list[float]] = {k: [] for k in ("sync", "sync0", "blocked", "blocked0")}
    times.update({"restore": [], "restore0": [], "sync_ratio": [], "blocked_ratio": []})
    times["restore_ratio"] = []
    sync = jm.checkpoint.CheckpointManager(root / "crc_sync", max_to_keep=2, async_save=False)
    asynchronous = jm.checkpoint.CheckpointManager(root / "crc_async", max_to_keep=1)

    def blocked(step: int) -> float:
        t = timed(lambda: asynchronous.save(step, mirrored))
        asynchronous.wait_until_finished()
        return t

    def one_round(step: int, baseline_first: bool) -> dict[str, float]:
        """Each pair of operations, the order alternating between rounds."""

        def restore(step: int) -> float:
            return timed(lambda: jax.block_until_ready(sync.restore(step)))

        pairs = {
            "sync": (
                lambda: timed(lambda: sync.save(step, mirrored)),
                lambda: _without_checksums(lambda: timed(lambda: sync.save(step + 1, mirrored))),
            ),
            "blocked": (
                lambda: blocked(step),
                lambda: _without_checksums(lambda: blocked(step + 1)),
            ),
            "restore": (
                lambda: restore(step),
                lambda: _without_checksums(lambda: restore(step + 1)),
            ),
        }
        out = {}
        for key, (with_crc, without) in pairs.items():
            if baseline_first:
                out[key + "0"] = without()
                out[key] = with_crc()
            else:
                out[key] = with_crc()
                out[key + "0"] = without()
        return out

    for i in range(rounds + 1):
        measured = one_round(2 * i + 2, baseline_first=i % 2 == 1)
        if i:
            for key, value in measured.items():
                times[key].append(value)
            times["sync_ratio"].append(measured["sync"] / measured["sync0"])
            times["blocked_ratio"].append(measured["blocked"] / measured["blocked0"])
            times["restore_ratio"].append(measured["restore"] / measured["restore0"])
    sync.close()
    asynchronous.close()
    host = [np.asarray(x) for x in jax.tree.leaves(mirrored)]
    arrays = dict(enumerate(host))
    times["crc"] = [timed(lambda: _integrity.array_checksums(arrays)) for _ in range(rounds)]
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    strategy = jm.MirroredStrategy()
    state = make_state(args.hidden)
    mirrored = strategy.mirror(state)
    megabytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state)) / 2**20
    root = pathlib.Path(tempfile.mkdtemp(prefix="jmirror-checkpoint-bench-"))
    try:
        sizes = bytes_on_disk(state, mirrored, root)
        blocked = blocked_ratio(mirrored, root, args.rounds)
        restore = restore_ratio(state, mirrored, root, args.rounds)
        crc = checksum_cost(mirrored, root, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = strategy.num_replicas
    print(
        f"\nCheckpoint of an MLP hidden {args.hidden} TrainState with Adam ({megabytes:.1f} MiB "
        f"one copy), mirrored on {n} host devices; medians of {args.rounds} rounds.\n"
    )
    print("| measure | value | target |")
    print("|---|---|---|")
    print(f"| bytes on disk / one copy: jm.checkpoint.save | {sizes['jm']:.3f} | <= 1.1 |")
    print(f"| bytes on disk / one copy: orbax, mirrored arrays | {sizes['orbax_mirrored']:.3f} | |")
    print(
        f"| bytes on disk / one copy: orbax, flax `replicate` ({n} stacked copies) | "
        f"{sizes['orbax_flax_replicated']:.3f} | |"
    )
    print(
        f"| async save blocked / sync save | {blocked[0]:.3f} ({blocked[1] * 1e3:.0f} ms / "
        f"{blocked[2] * 1e3:.0f} ms) | <= 0.10 |"
    )
    print(
        f"| jm restore (mirrored on {n} devices) / orbax restore (one device) | "
        f"{restore['ratio']:.2f} ({restore['jm'] * 1e3:.0f} ms / {restore['one'] * 1e3:.0f} ms)"
        " | <= 1.2 |"
    )
    print(
        f"| jm restore / orbax restore into the mirrored sharding | {restore['ratio_all']:.2f} "
        f"({restore['jm'] * 1e3:.0f} ms / {restore['all'] * 1e3:.0f} ms) | |"
    )
    print(
        f"| sync save with checksums / without | {crc['sync_ratio']:.3f} "
        f"({crc['sync'] * 1e3:.0f} ms / {crc['sync0'] * 1e3:.0f} ms) | <= 1.05 |"
    )
    print(
        f"| checksums of the state alone / sync save without checksums | "
        f"{crc['crc'] / crc['sync0']:.3f} ({crc['crc'] * 1e3:.0f} ms / "
        f"{crc['sync0'] * 1e3:.0f} ms) | <= 0.05 |"
    )
    print(
        f"| async save blocked, with checksums / without | {crc['blocked_ratio']:.3f} "
        f"({crc['blocked'] * 1e3:.0f} ms / {crc['blocked0'] * 1e3:.0f} ms) | about 1 |"
    )
    print(
        f"| restore with verification / without | {crc['restore_ratio']:.3f} "
        f"({crc['restore'] * 1e3:.0f} ms / {crc['restore0'] * 1e3:.0f} ms) | |"
    )


if __name__ == "__main__":
    main()
