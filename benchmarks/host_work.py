"""The host's share of code timed under torch's profiler: the time a named range spends
outside torch's ops (its Python and numpy work), what the host does where a GPU runs the
ops asynchronously."""

from __future__ import annotations


def host_work(events, range_name: str) -> list[float]:
    """Per engine step, the microseconds the ranges named ``range_name`` among ``events``
    (torch.profiler's) spend outside the torch ops they call, each step being two ranges in
    a row: the work before the forward and the work after it."""
    ranges = [event for event in events if event.name == range_name]
    inside = {id(event): 0.0 for event in ranges}
    for event in events:
        parent = event.cpu_parent
        if parent is not None and id(parent) in inside:
            inside[id(parent)] += event.cpu_time_total
    host = [event.cpu_time_total - inside[id(event)] for event in ranges]
    return [before + after for before, after in zip(host[::2], host[1::2])]
