"""pipelines.ray_env.map_over_actors: the pool of plain Ray actors that runs pre-inference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.ray_env import ensure_ray, map_over_actors

pytestmark = pytest.mark.ray


def squarer() -> type:
    """A worker class that squares numbers; the first actor given `die_on` kills its process.
    Made in a function so that Ray ships it by value (workers cannot import test modules)."""

    class Squarer:
        def __init__(self, marker: str, die_on: int):
            self.marker, self.die_on = Path(marker), die_on

        def run(self, x: int) -> tuple[int, int]:
            if x == self.die_on and not self.marker.exists():
                self.marker.write_text(str(os.getpid()))
                os._exit(1)  # a real death: no exception, no cleanup
            return x, x * x

    return Squarer


def test_calls_of_an_actor_dead_for_good_go_to_the_others(tmp_path):
    ensure_ray(log=lambda *a: None)
    marker = tmp_path / "died"
    calls = list(range(12))
    out = list(
        map_over_actors(
            squarer(),
            {"marker": str(marker), "die_on": 3},
            calls,
            actors=2,
            method="run",
            options={"max_restarts": 0, "max_task_retries": 0, "num_cpus": 0.1},
        )
    )
    assert marker.exists(), "no actor died"
    assert sorted(out) == [(x, x * x) for x in calls]  # every call once, the dead one's too


def test_the_error_is_raised_once_every_actor_is_dead(tmp_path):
    ensure_ray(log=lambda *a: None)
    import ray

    marker = tmp_path / "died"

    with pytest.raises(ray.exceptions.ActorDiedError):
        list(
            map_over_actors(
                squarer(),
                {"marker": str(marker), "die_on": 0},
                [0],
                actors=1,
                method="run",
                options={"max_restarts": 0, "max_task_retries": 0, "num_cpus": 0.1},
            )
        )
    assert marker.exists()  # it died of its own death, not of anything else
