"""Count the calls that make the host wait for the device (a host sync on CUDA), on CPU."""

from __future__ import annotations

import collections
import traceback
from typing import Any

from torch.overrides import TorchFunctionMode

# tensor methods and functions that read device data back to the host (or whose output
# shape depends on device data)
SYNCS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                   "nonzero", "cpu", "numpy", "masked_select", "unique", "repeat_interleave"})


class HostSyncs(TorchFunctionMode):
    """Within the block, ``count`` holds each sync-making call, by name and the repository
    line that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.count.values())

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            ours = [f for f in traceback.extract_stack()[:-1]
                    if "site-packages" not in f.filename and "/tests/" not in f.filename]
            where = f"{ours[-1].filename.rsplit('/', 2)[-1]}:{ours[-1].lineno}" if ours else "?"
            self.count[f"{name} @ {where}"] += 1
        return func(*args, **(kwargs or {}))
