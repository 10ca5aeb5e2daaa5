"""Processes that tests/test_checkpoint_faults.py and tests/test_train.py kill with SIGKILL (nothing here is part
of embshard: the faults are injected by wrapping embshard's functions in these processes only).

    python tests/ckpt_faults.py save FOLDER {data|commit}
        one process: saves step 1 (complete), trains a step, then saves step 2 and stops for good while writing
        its data (async save, in the writer thread) or just before its COMMIT (sync save); writes FOLDER/paused
        when it stopped, and FOLDER/step1.pt with the tables of step 1.
    torchrun ... tests/ckpt_faults.py train CONFIG [overrides]
        `embshard train`, except that on the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank KILL_RANK kills
        itself (SIGKILL) before training step KILL_STEP, once checkpoint step KILL_AFTER is committed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _stop(folder: str) -> None:
    Path(folder, "paused").write_text(str(os.getpid()))
    while True:  # until SIGKILL
        time.sleep(1)


def save_then_stop(folder: str, where: str) -> None:
    from ckpt_cases import build, full_state, plan_for, train

    from embshard.checkpoint import Checkpointer, TrainState, save, storage
    from embshard.spec.plan import MemoryTier

    ebc = build(torch.device("cpu"), "rowwise", plan_for(1, 0, tier=MemoryTier.HOST))
    ckpt = Checkpointer(TrainState({"ebc": ebc}), folder, async_save=where == "data", chunk_bytes=1024)
    train(ebc, 0, 1, torch.device("cpu"), 1, 1)
    ckpt.save(1)
    ckpt.wait()
    torch.save(full_state(ebc), Path(folder, "step1.pt"))
    train(ebc, 0, 1, torch.device("cpu"), 1, 2)
    if where == "data":  # stop in the writer thread after a few chunks are written
        original, calls = storage.PieceSavePlanner.resolve_data, [0]

        def resolve_data(self, item):
            calls[0] += 1
            if calls[0] == 5:
                _stop(folder)
            return original(self, item)

        storage.PieceSavePlanner.resolve_data = resolve_data
    else:  # every byte and DCP's index written, the COMMIT not yet

        def commit(path, info, files=None):
            _stop(folder)

        storage.commit = commit
    assert save.storage is storage
    ckpt.save(2)
    ckpt.wait()
    raise AssertionError("the save should have stopped")


def train_and_die(argv: list[str]) -> None:
    from embshard.models.build import RecModel
    from embshard.training.train import main

    kill_step, kill_rank = int(os.environ["KILL_STEP"]), int(os.environ["KILL_RANK"])
    committed = Path(os.environ["KILL_AFTER"], "COMMIT")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    original = RecModel.step

    def step(self, batch, *args, **kwargs):  # RecModel.step's own arguments passed on
        if first_attempt and self.training and self.ebc.step == kill_step and int(os.environ["RANK"]) == kill_rank:
            deadline = time.time() + 120
            while not committed.is_file() and time.time() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, batch, *args, **kwargs)

    RecModel.step = step
    main(argv)


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save_then_stop(sys.argv[2], sys.argv[3])
    else:
        train_and_die(sys.argv[2:])
