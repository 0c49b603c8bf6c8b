"""What `diagnose` requires its workload to exercise: every runner branch and every memory path.

The runner declares its branches (`ModelRunner.BRANCHES`) and runtime/mem_cache/paths.py the memory paths;
each component counts the ones it takes in plain ints. A path that no run of a policy took is a failed check,
so a new path cannot hide.
"""

from __future__ import annotations

from runtime.mem_cache import paths


def memory_path_counts(engine) -> dict[str, int]:
    """Every declared memory path of `engine`, summed over the components that count it (0 where none
    exists: no prefix cache, no graphs, no speculation)."""
    alloc, tree, runner = engine.pool.allocator, engine.slots.tree, engine.runner
    parts = [alloc.full.path_counts, alloc.swa.path_counts, alloc.path_counts, engine.scheduler.path_counts,
             *(part.path_counts for part in (tree, runner.graphs, runner.verify_graphs) if part is not None)]
    total = dict.fromkeys(paths.MEMORY_PATHS, 0)
    for part in parts:
        for name, n in part.items():
            total[name] += n
    return total


def missing_paths(runs, declared: tuple[str, ...]) -> list[str]:
    """The names of `declared` that no run in `runs` took (memory paths summed over the runs)."""
    taken = {name for run in runs for name, n in run.memory_paths.items() if n}
    return [name for name in declared if name not in taken]
