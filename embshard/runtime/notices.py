"""Notices that libraries print on embshard's normal path and that ask nothing of its users, dropped where they are
emitted, each by its exact logger and text (every other record and warning stays visible).

- torch.fx, "is_fx_tracing will return true for both fx.symbolic_trace and torch.export ...": torchrec's
  KeyedJaggedTensor has torch.fx's ProxyableClassMeta as metaclass, whose `__call__` asks torch.fx's own
  deprecated `is_fx_tracing()` on every construction; that function logs this once per process (torch 2.13). It is
  advice to code that calls `is_fx_tracing()`, which embshard does not; any process that builds a
  KeyedJaggedTensor (every rank, each batch) would print it.

- fbgemm-gpu, "_fbgemm_torch_compat_table has no entry for <version> of FBGEMM; cannot determine compatibility with
  PyTorch ...": fbgemm-gpu's import checks its own table of tested torch versions, which lacks some releases
  (fbgemm-gpu 1.6.0 with torch 2.11, a pair embshard is tested with), and logs this on the root logger in
  every process that imports it. Its other message, a version the table says is not compatible, stays visible.

Warnings (Python's warnings filter, by the start of their text):

- FBGEMM, "TBE B200 optimization: device_major=...": a debug line that fbgemm-gpu 1.6's TBE backward (CUDA) prints
  once per process (`TORCH_WARN_ONCE`, marked "remove after verification" in its source); it reports the card's
  compute capability and a segment length.
- torch, "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered ...": FBGEMM's dense
  TBE (the data-parallel replicas, embshard/lookup/replicas.py) builds its own autograd graph, whose gradient is
  right; torch's fallback warns on its backward anyway.

- torch, "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled ...": torch.compile's
  advice, printed once per process when it compiles fp32 matrix products on a GPU with TF32 units.
  `training.precision` is the knob for it: fp32 keeps full fp32 products on purpose, tf32 (or bf16) takes the advice.

`install()` runs when this module is imported, the first thing `import embshard` does, so spawned ranks (which
import embshard to run) and the data workers (forked from them) get it too.
"""

from __future__ import annotations

import logging
import re
import warnings

# (logger name, start of the message) of each notice dropped
DROPPED = (
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"),
    ("root", "_fbgemm_torch_compat_table has no entry for "),
)
# start of the text of each warning dropped
DROPPED_WARNINGS = (
    "TBE B200 optimization: device_major=",
    "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
    "TensorFloat32 tensor cores for float32 matrix multiplication available but not enabled",
)


class _Drop(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str):
            return True
        return not _ANSI.sub("", record.msg).lstrip().startswith(self.prefix)  # text as printed, colours aside


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def install() -> None:
    """Add the filters (once per process; the loggers need not exist yet)."""
    for name, prefix in DROPPED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_Drop(prefix))
    for prefix in DROPPED_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(prefix), category=UserWarning)


install()
