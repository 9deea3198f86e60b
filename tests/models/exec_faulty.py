"""tests/models/exec_net.py with an injected fault, for the executor's failure tests.

``SHARD_PLANNER_TEST_FAULT=KIND@RANK`` (KIND: raise, oom, hang) makes rank RANK (from the RANK
environment variable the launcher sets) fail in its third forward call: raise a RuntimeError, raise a
MemoryError (as an allocation failure does on CPU), or sleep for an hour.
"""

import importlib.util
import os
import time
from pathlib import Path

# exec_net.py beside this file, loaded by path (the tool loads model files by path, not as a package)
_spec = importlib.util.spec_from_file_location("exec_net", Path(__file__).with_name("exec_net.py"))
exec_net = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exec_net)

make_batch = exec_net.make_batch
loss_fn = exec_net.loss_fn
TRAINING = exec_net.TRAINING


class FaultyNet(exec_net.Net):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, idx):
        self.calls += 1
        kind, _, rank = os.environ.get("SHARD_PLANNER_TEST_FAULT", "").partition("@")
        if kind and os.environ.get("RANK") == rank and self.calls == 3:
            if kind == "raise":
                raise RuntimeError("injected failure in forward")
            if kind == "oom":
                raise MemoryError("injected: could not allocate 1073741824 bytes")
            if kind == "hang":
                time.sleep(3600)
        return super().forward(idx)


def build_model():
    return FaultyNet()
