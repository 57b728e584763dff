"""How a `KvCanary` reads its device tables on the host: its counters and ring rows
(`HostReader`), and the violations the other ranks of a process group saw (`others_count`)."""

from __future__ import annotations

import torch


class HostReader:
    """Reads the counters and ring rows to the host. On CUDA it copies them through pinned
    buffers and waits on an event for that copy only, instead of a blocking copy."""

    def __init__(self, counters: torch.Tensor, ring: torch.Tensor, origins: torch.Tensor):
        self._counters, self._ring, self._origins = counters, ring, origins
        self._cuda = counters.device.type == "cuda"
        if self._cuda:
            self._pinned_counters = torch.empty(counters.shape, dtype=torch.int64, pin_memory=True)
            self._pinned_ring = torch.empty(ring.shape, dtype=torch.int64, pin_memory=True)
            self._pinned_origins = torch.empty(origins.shape, dtype=torch.int64, pin_memory=True)
            self._pinned_lagging = torch.empty(counters.shape, dtype=torch.int64, pin_memory=True)
        self._lagging = [0] * counters.numel()  # the counters of the latest finished copy (`counters_without_waiting`)
        self._lagging_copy = None  # the event of the copy in flight

    def _read(self, device_tensor: torch.Tensor, pinned: torch.Tensor) -> list:
        if not self._cuda:
            return device_tensor.tolist()
        pinned.copy_(device_tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return pinned.tolist()

    def counters(self) -> list[int]:
        return self._read(self._counters, self._pinned_counters if self._cuda else None)

    def counters_without_waiting(self) -> list[int]:
        """The counters as of the latest finished copy (CUDA: a copy into a pinned buffer of
        its own, queued where none is in flight, its event queried, never waited on), or
        the current ones on the CPU."""
        if not self._cuda:
            return self._counters.tolist()
        if self._lagging_copy is not None and self._lagging_copy.query():
            self._lagging = self._pinned_lagging.tolist()
            self._lagging_copy = None
        if self._lagging_copy is None:
            self._pinned_lagging.copy_(self._counters, non_blocking=True)
            self._lagging_copy = torch.cuda.Event()
            self._lagging_copy.record()
        return self._lagging

    def ring_rows(self, count: int) -> list[list[int]]:
        return self._read(self._ring[:count], self._pinned_ring[:count] if self._cuda else None)

    def origins(self, count: int) -> list[list[int]]:
        return self._read(self._origins[:count], self._pinned_origins[:count] if self._cuda else None)


def others_count(local: int, group, device: torch.device) -> int:
    """How many violations the other ranks of ``group`` saw (an all-reduce of the counts)."""
    import torch.distributed as dist

    on_device = dist.get_backend(group) != "gloo"
    count = torch.tensor([local], dtype=torch.int64, device=device if on_device else "cpu")
    dist.all_reduce(count, group=group)
    return int(count.item()) - local
