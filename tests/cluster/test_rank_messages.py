"""What a failed trainer rank's message says, from the errors Ray raises: a rank whose constructor
raised is named with its error (Ray reports it as a dead actor), a rank whose process died is
named with the exit Ray recorded; and the TCP store the ranks meet at is bound before anyone is
told its port."""

import socket

import pytest

from tidal.cluster.ranks import TrainerRankError, actor_death, describe_failure, wait_for_ranks
from tidal.net import host_store, join_store

ray = pytest.importorskip("ray")

# Ray 2.60's message for an actor whose process was SIGKILLed (the kernel's OOM killer does the same)
KILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: TrainerRank\n\tpid: 4242\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
    "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
    "include: (1) the process was killed by the OOM killer due to high memory usage"
)
# and for one Ray's memory monitor killed
OOM = (
    "The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY Worker "
    "exit detail: Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.5) "
    "where the lease was running was 22.51GB / 23.50GB (0.957), which exceeds the memory usage threshold"
)
# and for one whose constructor raised
INIT = (
    "The actor died because of an error raised in its creation task, ray::TrainerRank.__init__() (pid=4242)\n"
    '  File "/x/tidal/cluster/trainers.py", line 110, in __init__\n'
    "    store = join_store(init_method, max(timeout_s, STARTUP_TIMEOUT_S))\n"
    "torch.distributed.DistStoreError: Timed out after 601 seconds waiting for clients. 1/2 clients joined."
)


def test_actor_death_is_the_exit_ray_recorded():
    assert actor_death(KILLED) == "SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2"
    assert actor_death(OOM) == "NODE_OUT_OF_MEMORY: Task was killed due to the node running low on memory"
    assert actor_death("The actor experienced an error before finishing this task.") == ""


def test_a_dead_rank_is_named_with_the_exit_ray_recorded():
    errors = {1: ray.exceptions.RayActorError("a1", OOM)}
    msg, rank = describe_failure("a train step", [("10.0.0.5", 7), ("10.0.0.5", 8)], errors, [0])
    assert rank == 1
    assert msg == (
        "trainer rank 1 (node 10.0.0.5, pid 8) died during a train step (its process is gone; Ray: "
        "NODE_OUT_OF_MEMORY: Task was killed due to the node running low on memory); rank 0 had not finished yet"
    )


def test_a_rank_whose_constructor_raised_is_named_with_its_error_not_as_dead():
    errors = {0: ray.exceptions.RayActorError("a0", INIT, actor_init_failed=True)}
    msg, rank = describe_failure("starting the trainer ranks", [None, None], errors, [1])
    assert rank == 0
    assert msg == (
        "trainer rank 0 failed during starting the trainer ranks: torch.distributed.DistStoreError: Timed out "
        "after 601 seconds waiting for clients; rank 1 had not finished yet"
    )


def test_through_ray_a_constructor_error_and_a_death_are_told_apart(ray_session):
    """Ray's own errors (not the texts above): its wording is what `describe_failure` reads."""

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, fail: bool) -> None:
            if fail:
                raise ValueError("train.model: no config.json in /nowhere")

        def ready(self) -> int:
            return 1

        def die(self) -> None:
            import os

            os._exit(3)

    broken, healthy = Rank.remote(True), Rank.remote(False)
    # the healthy rank has started first and the grace is long, so the message names the broken
    # one alone: under CI's load the healthy one once had not started within a 1 s grace, and the
    # message rightly said so
    assert ray.get(healthy.ready.remote(), timeout=300) == 1
    with pytest.raises(TrainerRankError) as err:
        wait_for_ranks([broken.ready.remote(), healthy.ready.remote()], [None, None], "starting", 60, grace=30)
    assert str(err.value) == (
        "trainer rank 0 failed during starting: ValueError: train.model: no config.json in /nowhere"
    )
    with pytest.raises(TrainerRankError) as err:
        wait_for_ranks([healthy.die.remote()], [None], "a train step", 60, grace=1)
    assert str(err.value).startswith("trainer rank 0 died during a train step (its process is gone; Ray: "), err.value
    ray.kill(broken)


def test_the_store_is_bound_before_its_port_is_told():
    store = host_store("127.0.0.1", 10)
    taken = socket.socket()
    with pytest.raises(OSError):  # bound already: no other process can take the port meanwhile
        taken.bind(("127.0.0.1", store.port))
    taken.close()
    client = join_store(f"tcp://127.0.0.1:{store.port}", 10)
    client.set("rank1", b"ready")
    assert store.get("rank1") == b"ready"
