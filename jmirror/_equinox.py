"""equinox modules as arguments of replicated functions, with `eqx.filter_jit`'s semantics.

An `eqx.Module` is a pytree whose leaves mix arrays with functions, flags and numbers
(`eqx.nn.MLP.activation`, `eqx.nn.Dropout.inference`). Inside a module, at any depth, only
arrays are traced: every other leaf, Python numbers and bools included, is static, exactly as
`eqx.filter_jit` partitions it with `eqx.is_array`. `ADAPTER` says so through the adapter
interface (`jmirror._adapter.Adapter.leaf_policy`); equinox modules are immutable, so no
call needs a variant of the replica function or a write-back.

Nothing here imports equinox: an equinox module can only exist once the caller imported it,
so `sys.modules` tells.
"""

from __future__ import annotations

import sys
from typing import Any

from jmirror._adapter import Adapted
from jmirror._arguments import is_array


def _equinox() -> Any:
    """Returns `equinox` when the caller has imported it, else None."""
    return sys.modules.get("equinox")


def is_module(x: Any) -> bool:
    """Returns whether `x` is an `eqx.Module`."""
    eqx = _equinox()
    return eqx is not None and isinstance(x, eqx.Module)


class EquinoxAdapter:
    """The `jmirror._adapter.Adapter` of equinox modules: their non-array leaves are static."""

    def adapt(self, args: tuple, kwargs: dict, static_argnums: tuple[int, ...]) -> Adapted | None:
        """Returns None: an equinox module runs through the user's own function."""
        return None

    def check_plain(self, name: str, in_treedef: Any) -> None:
        """Refuses nothing: equinox modules need no variant."""

    def leaf_policy(self, node_type: type) -> Any:
        """Returns `is_array` for `eqx.Module` subclasses (their other leaves are static)."""
        eqx = _equinox()
        if eqx is not None and issubclass(node_type, eqx.Module):
            return is_array
        return None


ADAPTER = EquinoxAdapter()
