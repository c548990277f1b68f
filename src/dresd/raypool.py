"""Model work on a Ray cluster (`--ray [ADDRESS]` of `dresd build` and `dresd corpus
regenerate`), optional.

Only the expensive step moves: the target's forwards. Ray actors each load the model once
(`load`, called on the actor: a 7B model is loaded from its name on every node rather than
shipped through the object store) and run jobs `function(target, *args)`, where `function` is
a plain module-level function of dresd (so it pickles by name). Everything else stays in the
single process that writes the output, in the same code as without Ray:

- `dresd build` (datastore/dense.py): the chunk plan, the seeded transform sample (fit chunks
  first, the transform fitted on the driver), the chunk files and done markers (so a build
  resumes by chunk, with or without Ray), the join, values, index and manifest. A job is one
  chunk's forward (raw states and stream offsets); the driver turns states into keys.
- `dresd corpus regenerate` (regenerate.py): a job is one batch of prompts; the driver writes
  the batches in input order, so the file and its resumption are those of one process.

The output is then the single-process one, up to the forward's own rounding where actors run
another number of threads or another machine. Ray is imported here only: without `--ray`
nothing of it is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from dresd.errors import MissingPackageError
from dresd.models.target import Target

# Jobs queued per actor beyond the one it is running: its next job is ready when it
# finishes, and the driver holds few jobs' results at once.
QUEUED_PER_ACTOR = 1


class _TargetActor:
    """Holds the target once; runs jobs on it (wrapped by `ray.remote` when Ray is started)."""

    def __init__(self, load: Callable[[], Target], threads: int) -> None:
        torch.set_num_threads(threads)
        self.target = load()

    def run(self, function: Callable[..., Any], args: tuple) -> Any:
        return function(self.target, *args)


class RayPool:
    """Ray actors holding the target; `address`: a cluster's (None: join the one `RAY_ADDRESS`
    names, or start a local one). `actors`: how many (default: one per `threads` CPUs of the
    cluster)."""

    def __init__(self, load: Callable[[], Target], address: str | None = None,
                 actors: int | None = None, threads: int = 1) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        count = actors or max(1, cpus // threads)
        actor = ray.remote(num_cpus=threads)(_TargetActor)
        self.actors = [actor.remote(load, threads) for _ in range(count)]

    def map_unordered(self, function: Callable[..., Any], jobs: Iterable[tuple]
                      ) -> Iterator[tuple[int, Any]]:
        """(job number, function(target, *job)) for every job, in the order they finish; each
        actor is kept busy with at most QUEUED_PER_ACTOR jobs waiting."""
        ray = import_ray()
        waiting = list(enumerate(jobs))[::-1]
        running: dict = {}  # object ref -> (job number, actor)

        def submit(actor) -> None:
            if waiting:
                number, args = waiting.pop()
                running[actor.run.remote(function, args)] = (number, actor)

        for actor in self.actors:
            for _ in range(1 + QUEUED_PER_ACTOR):
                submit(actor)
        while running:
            [done], _ = ray.wait(list(running), num_returns=1)
            number, actor = running.pop(done)
            submit(actor)
            yield number, ray.get(done)

    def map(self, function: Callable[..., Any], jobs: Iterable[tuple]) -> Iterator[Any]:
        """function(target, *job) for every job, in the jobs' order (finished ones wait for
        those before them)."""
        ready: dict[int, Any] = {}
        next_number = 0
        for number, result in self.map_unordered(function, jobs):
            ready[number] = result
            while next_number in ready:
                yield ready.pop(next_number)
                next_number += 1

    def close(self) -> None:
        ray = import_ray()
        for actor in self.actors:
            ray.kill(actor)


def import_ray():
    try:
        import ray
    except ImportError as err:
        raise MissingPackageError("--ray needs the optional package: "
                                  "pip install 'dresd[ray]'") from err
    return ray
