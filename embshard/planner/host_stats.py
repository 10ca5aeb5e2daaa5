"""Per-host statistics of a load matrix: for every row and host, the busiest rank's load, the largest load of
the host's other ranks, and which rank is the busiest (the first on ties), for one state of the loads (computed
when asked for, kept until the loads change). The search reads them where it evaluates a block on every rank of a
wide world (State._add_peers); one rank's evaluation reads the loads directly (rank_pick.others)."""

from __future__ import annotations

import numpy as np


class HostStats:
    """Statistics of the loads [rows, W] of `hosts` hosts of `lws` ranks each, valid for one key (the owner's
    loads object and version)."""

    def __init__(self, hosts: int, lws: int) -> None:
        self.H, self.lws = hosts, lws
        self.key: tuple | None = None
        self.top = self.second = self.arg = np.empty(0)
        """[rows, H] each: the busiest rank's load, the largest of the other ranks (-inf alone on its host), the
        busiest rank's index within its host (the first on ties when computed afresh)."""

    def get(self, matrix: np.ndarray, key: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(top, second, arg) of `matrix` [rows, W], whose state `key` names (computed when the kept ones are not
        for `key`)."""
        if self.key != key:
            self._compute(matrix)
            self.key = key
        return self.top, self.second, self.arg

    def valid(self, key: tuple) -> bool:
        return self.key == key

    def of(self, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(top, second, arg) [rows, H] of `matrix` [rows, W], computed afresh and not kept."""
        n = matrix.shape[0]
        top, second, arg = self._of(matrix.reshape(n * self.H, self.lws))
        return top.reshape(n, self.H), second.reshape(n, self.H), arg.reshape(n, self.H)

    def _compute(self, matrix: np.ndarray) -> None:
        self.top, self.second, self.arg = self.of(matrix)

    def _of(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[k] each: top, second and arg of the rows of `groups` [k, lws]."""
        arg = groups.argmax(axis=1)
        flat = np.arange(len(groups))
        top = groups[flat, arg]
        if self.lws > 1:
            rest = groups.copy()
            rest[flat, arg] = -np.inf
            second = rest.max(axis=1)
        else:
            second = np.full_like(top, -np.inf)
        return top, second, arg
