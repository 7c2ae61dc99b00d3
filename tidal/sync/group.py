"""The process group a trainer forms with SGLang-protocol servers to send weights by broadcast
(`/init_weights_update_group`, `/update_weights_from_distributed`).

The group is built the way SGLang builds its own (`init_custom_process_group` in SGLang's
`srt/utils`): a TCP store at `master_address:master_port` (rank 0, the trainer, serves it), a
`PrefixStore` named after the group, and the backend's process group over that store. Ranks:
the trainer is 0; a server's ranks are `rank_offset + tp_rank`. A trainer that forms its group
with `join_weight_group` therefore meets a real SGLang server (NCCL on GPUs) and a `tidal serve`
server (gloo on CPU) alike.

With gloo the backend is built directly, with the same store keys as torch's own group helper,
so that a trainer and servers may share one process (tests) without clashing in torch's global
registry of group names. Other backends (NCCL) go through torch's helper, as SGLang does.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class WeightGroup:
    """One rank's membership of a weight-update group."""

    name: str
    rank: int
    world_size: int
    backend: str
    pg: Any
    store: Any = field(repr=False, default=None)  # kept alive: rank 0 may serve the TCP store

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 (received in place on the other ranks)."""
        if self.backend == "gloo":
            self.pg.broadcast(tensor, 0).wait()
        else:
            dist.broadcast(tensor, 0, group=self.pg)

    def close(self) -> None:
        """Leave the group; an operation still waiting on it fails instead of waiting for its timeout."""
        try:
            if self.backend == "gloo":
                self.pg.abort()
            else:
                dist.destroy_process_group(self.pg)
        except Exception:  # a broken group may refuse: it is dropped either way
            pass
        self.pg = self.store = None


def join_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout: float = 300.0,
    store: Any = None,
) -> WeightGroup:
    """Join (rank 0: create) the group; blocks until all `world_size` ranks have joined, at most
    `timeout` seconds, which also bounds every later operation on the group. `store`: a TCP store
    this process already serves or reaches at `master_address:master_port` (`tidal.net.host_store`,
    `join_store`), used instead of a rendezvous there, in which rank 0 would bind that port."""
    from torch.distributed.distributed_c10d import PrefixStore, rendezvous

    if not group_name:
        raise ValueError("group_name: must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is not in [0, world_size={world_size})")
    limit = datetime.timedelta(seconds=timeout)
    host = f"[{master_address}]" if ":" in master_address else master_address
    if store is None:
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=limit))
    store.set_timeout(limit)
    prefixed = PrefixStore(group_name, store)
    if backend == "gloo":
        # torch's helper would add "<group>/" and then "<device>/" to the store's keys: the same here
        keys = PrefixStore("cpu/", PrefixStore(f"{group_name}/", prefixed))
        pg = dist.ProcessGroupGloo(keys, rank, world_size, limit)
        pg._set_sequence_number_for_group()  # torch's helper does it too; a peer built by it waits for it
    else:
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

        pg, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), prefixed, group_name=group_name, timeout=limit
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return WeightGroup(group_name, rank, world_size, backend, pg, store)
