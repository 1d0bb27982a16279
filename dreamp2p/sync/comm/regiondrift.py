"""One drift verdict for a region of many local ranks: local rank 0's, on every rank at the same step.

Each rank's peer judges on its own shard ring whether the members ahead train with a plan this node
missed (`dreamp2p.peer.drift`), each at its own moment. The region must take their state as one replica,
at one step, or its ranks would end up holding different states. So only local rank 0's verdict counts:
at every step each rank posts a one-element broadcast from local rank 0 on a gloo group of its own
(asynchronous, so no step waits for it) and reads, at the next step, the one posted the step before. The
ranks step in lockstep (DDP averages their gradients at every step), so every rank reads the same verdicts
at the same steps, and the region takes the members' state one step after rank 0's peer asked for it.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# what ranks other than local rank 0 report as the members ahead: only local rank 0 fetches from them
AHEAD_OF_RANK_0 = ("the members ahead of local rank 0",)


class DriftVerdict:
    """Local rank 0's verdicts (the members ahead, or none), handed to every rank of the region a step later."""

    def __init__(self, group: dist.ProcessGroup, root: int, local_rank: int) -> None:
        self._group = group
        self._root = root  # global rank of local rank 0
        self._local_rank = local_rank
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._pending: dist.Work | None = None
        self._posted: tuple[str, ...] = ()  # local rank 0's members ahead, as posted with the pending verdict

    def exchange(self, ahead: tuple[str, ...]) -> tuple[str, ...]:
        """Post this step's verdict (``ahead``: local rank 0's members ahead; ignored on the other ranks) and
        return the previous step's: local rank 0's members ahead on rank 0, `AHEAD_OF_RANK_0` on the
        others, or () when local rank 0 had none (and at the first step)."""
        previous = self._take()
        self._posted = ahead if self._local_rank == 0 else ()
        self._flag = torch.tensor([1 if self._posted else 0], dtype=torch.int64)
        self._pending = dist.broadcast(self._flag, src=self._root, group=self._group, async_op=True)
        return previous

    def discard(self) -> None:
        """Drop the verdict in flight (every rank at the same step): the region just took the members' state,
        so a verdict posted before that is out of date."""
        self._take()

    def _take(self, timeout: float | None = None) -> tuple[str, ...]:
        """Wait for the verdict in flight, if any, and return it (see :meth:`exchange`)."""
        work, self._pending = self._pending, None
        if work is None:
            return ()
        if timeout is None:
            work.wait()  # the process group's own timeout: a rank that died stops the region anyway
        else:
            work.wait(datetime.timedelta(seconds=timeout))
        if not int(self._flag.item()):
            return ()
        return self._posted if self._local_rank == 0 else AHEAD_OF_RANK_0

    def close(self, timeout: float) -> None:
        """Finish the broadcast in flight, so no rank leaves one half done behind it."""
        try:
            self._take(timeout)
        except RuntimeError as exc:  # another rank already left: nothing to finish with it
            log.debug("region drift verdict not finished at close: %s", exc)
