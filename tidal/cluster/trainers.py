"""Trainer ranks on Ray: one `Actor` per rank over its FSDP2 shard, and the group the loop drives
as its trainer role.

Every rank gets the whole batch and takes its share (`balanced_share`: whole prompt groups, so a
group's prompt is still stored once, balanced by tokens); the loss of every micro-batch is divided
by the counts of the whole optimizer batch and FSDP2 sums the gradients over ranks, so N ranks
take exactly the step one process takes. Ranks run the same number of forward/backward passes
(FSDP2 gathers and reduces in each): one with fewer runs zero-loss passes.

With PPO each rank also holds the critic (`tidal.train.critic.Critic`), sharded the same way on
the same device, colocated with the actor: values and value updates run on the ranks, each on
its share, like log-probs and policy updates (`RankCritic` is the loop's critic role).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from tidal.algo.options import AlgoConfig
from tidal.cluster.options import ClusterConfig
from tidal.cluster.ranks import rank_name, wait_for_ranks
from tidal.hardware import CPU, bind_device, dist_backend, resolve_device
from tidal.train import lora
from tidal.train.options import TrainConfig
from tidal.train.update import Sums
from tidal.types import Sample
from tidal.utils import import_path_env

log = logging.getLogger("tidal")

# the whole tensors a rank gathers and hands the driver at a time (`TrainerGroup.named_weights`)
WEIGHT_BUCKET_BYTES = 256 * 2**20
STARTUP_TIMEOUT_S = 600.0  # ranks start (and meet) within this; their collectives then wait `timeout_s`


def balanced_share(samples: Sequence[Sample], indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's part of `indices`: samples with the same prompt stay together (their prompt is
    computed once), and groups go largest first to the rank with the fewest tokens so far (ties to
    the lowest rank). Every rank computes the same split."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        s = samples[i]
        groups.setdefault(tuple(s.tokens[: s.prompt_length]), []).append(i)
    cost = {k: len(k) + sum(samples[i].response_length for i in v) for k, v in groups.items()}
    load = [0] * world
    mine: list[int] = []
    for key in sorted(groups, key=lambda k: (-cost[k], groups[k][0])):
        r = min(range(world), key=lambda j: (load[j], j))
        load[r] += cost[key]
        if r == rank:
            mine.extend(groups[key])
    return sorted(mine)


class TrainerRank:
    """One rank (a Ray actor): the process group, the sharded policy, and its calls."""

    def __init__(
        self,
        rank: int,
        world: int,
        init_method: str,
        train: TrainConfig,
        algo: AlgoConfig,
        model: str,
        reference: str,
        temperature: float,
        pad_id: int,
        max_response_len: int,
        threads: int,
        timeout_s: float,
        device: str = "auto",
        critic: bool = False,
        tp_size: int = 1,
        cp_size: int = 1,
    ) -> None:
        """`init_method`: tcp://host:port of the TCP store the ranks meet at, which their caller
        serves (`TrainerGroup`; `tidal.net.host_store`). `critic`: also hold PPO's critic, from
        `reference` (the run's initial model).
        `tp_size`: ranks that split each layer (`tidal.train.parallel`); `cp_size`: ranks that
        split each micro-batch's tokens (`tidal.train.context`). The ranks form a dp x cp x tp
        mesh (dp = world / (cp_size x tp_size)), FSDP2 over its dp and cp dimensions."""
        import time

        import torch.distributed as dist

        from tidal.log import setup_worker_logging
        from tidal.train.actor import Actor

        setup_worker_logging()  # tidal's lines to the driver's console, no library chatter or bars
        started = time.perf_counter()
        torch.set_num_threads(max(1, threads))
        self.rank, self.world = rank, world
        # resolved on this rank's node: the GPU Ray gave the actor, or the CPU
        choice = resolve_device(device)
        self.device = bind_device(choice.device)
        if world > 1:
            from tidal.net import join_store

            # The ranks meet over the store `TrainerGroup` serves, which waits for a slow starter as
            # long as the start-up may take; `timeout_s` then bounds each collective, so a peer that
            # died or stopped is found in that time (and named by `TrainerGroup`).
            store = join_store(init_method, max(timeout_s, STARTUP_TIMEOUT_S))
            dist.init_process_group(
                dist_backend(self.device),
                store=store,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        # data-parallel rank and size: every tp (and cp) rank of a dp group takes the same share
        self.dp_rank, self.dp_world, self.dp_group = rank, world, None
        shard = (lambda trained: trained.shard()) if world > 1 else None
        if tp_size > 1 or cp_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            # dp x cp x tp (a size-1 dimension left out): the tp ranks of a layer are adjacent
            dims = {"dp": world // (tp_size * cp_size), "cp": cp_size, "tp": tp_size}
            dims = {d: n for d, n in dims.items() if d == "dp" or n > 1}
            mesh = init_device_mesh(self.device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
            dp = mesh["dp"]
            self.dp_rank, self.dp_world, self.dp_group = dp.get_local_rank(), dp.size(), dp.get_group()
            # FSDP2 shards over dp and cp: the cp ranks hold the same weights and share the gradient
            fsdp = mesh["dp", "cp"]._flatten("dp_cp") if cp_size > 1 else dp
            tp = mesh["tp"] if tp_size > 1 else None
            cp = mesh["cp"].get_group() if cp_size > 1 else None
            shard = lambda trained: trained.shard(fsdp, tp, cp)  # noqa: E731
        self.actor = Actor(
            model, train, algo, temperature, pad_id, reference, max_response_len, shard=shard, device=self.device
        )
        self.actor.rank = rank
        self.critic = None
        if critic:
            from tidal.train.critic import Critic

            self.critic = Critic(reference, train, algo, pad_id, device=self.device, shard=shard)
        if world > 1:
            for part in (self.actor, self.critic):
                if part is not None:
                    part.most_micro_batches = self._most
                    part.all_sum = self._sum
        log.info(
            "trainer rank %d of %d (pid %d): ready in %.1f s on %s (%s)",
            rank,
            world,
            os.getpid(),
            time.perf_counter() - started,
            self.device,
            choice.reason,
        )

    def describe(self) -> str:
        return self.actor.describe()

    def _most(self, n: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def _sum(self, t: Tensor) -> Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)  # tp ranks hold the same sums
        return t

    def _split(self, samples: Sequence[Sample], part=None) -> None:
        if self.dp_world > 1:
            (part or self.actor).share = lambda idx: balanced_share(samples, idx, self.dp_rank, self.dp_world)

    def ready(self) -> tuple[str, int]:
        """(node address, pid) of this rank's process: the group names a rank that fails by them."""
        from tidal.net import node_ip

        return node_ip(), os.getpid()

    def compute_log_probs(self, samples: list[Sample], which: str) -> Tensor:
        self._split(samples)
        return self.actor.compute_log_probs(samples, which)

    def train_sums(self, samples, advantages, old_log_probs, ref_log_probs) -> tuple[Sums, dict]:
        self._split(samples)
        return self.actor.train_sums(samples, advantages, old_log_probs, ref_log_probs)

    def critic_values(self, samples: list[Sample]) -> Tensor:
        self._split(samples, self.critic)
        return self.critic.values(samples)

    def critic_train_sums(self, samples: list[Sample], returns: Tensor, old_values: Tensor) -> tuple[Sums, dict]:
        self._split(samples, self.critic)
        return self.critic.train_sums(samples, returns, old_values)

    def critic_state_dict(self) -> dict | None:
        state = self.critic.state_dict()  # a collective: every rank takes part
        return state if self.rank == 0 else None

    def critic_load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state)

    def full_weights(self, dtype: torch.dtype | None, changed_only: bool = False) -> dict[str, Tensor] | None:
        """The whole model's weights (every rank gathers; rank 0 returns them)."""
        out: dict[str, Tensor] = {}
        first, last = True, False
        while not last:
            bucket, last = self.weights_bucket(dtype, changed_only, WEIGHT_BUCKET_BYTES, first)
            out.update(bucket or ())
            first = False
        return out if self.rank == 0 else None

    def weights_bucket(
        self, dtype: torch.dtype | None, changed_only: bool, bucket_bytes: int, first: bool
    ) -> tuple[list[tuple[str, Tensor]] | None, bool]:
        """The next whole tensors of the model, about `bucket_bytes` of them (a larger tensor
        alone), and whether they are the last: every rank gathers them from its shards in turn
        (`first` starts over), rank 0 returns them, so no rank holds more of the whole model than
        a bucket. Every rank cuts at the same tensor: the sizes are the whole tensors'."""
        if first:
            self._weights = iter(self.actor.named_weights(changed_only=changed_only))  # a collective, tensor by tensor
        out: list[tuple[str, Tensor]] = []
        size = 0
        for name, t in self._weights:
            size += t.numel() * (dtype or t.dtype).itemsize
            if self.rank == 0:
                out.append((name, t.to(CPU, dtype or t.dtype, copy=True)))
            if size >= bucket_bytes:
                return (out if self.rank == 0 else None), False
        self._weights = iter(())
        return (out if self.rank == 0 else None), True

    def weight_shapes(self, changed_only: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        """(name, full shape) of each weight, in `named_weights` order."""
        return self.actor.trained.weight_shapes(changed_only)

    def state_dict(self) -> dict | None:
        state = self.actor.state_dict()  # a collective: every rank takes part
        return state if self.rank == 0 else None

    def load_state_dict(self, state: dict) -> None:
        self.actor.load_state_dict(state)

    def save_model(self, path: str) -> None:
        if self.actor.trained.lora:
            state = lora.adapter_state(self.actor.model)  # every rank gathers the adapter
            if self.rank == 0:
                lora.save_adapter(self.actor.model, self.actor.cfg, path, self.actor.base, state)
            return
        # a Hugging Face folder written a bucket at a time: every rank gathers a bucket's whole
        # tensors, rank 0 writes them as one safetensors shard (with an index when there are
        # several), so no rank holds a second whole copy of the model
        folder = Path(path)
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        shards: dict[str, str] = {}  # tensor name -> its shard's file
        total, count, first, last = 0, 0, True, False
        while not last:
            bucket, last = self.weights_bucket(None, False, WEIGHT_BUCKET_BYTES, first)
            if self.rank == 0 and bucket:
                count += 1
                name = "model.safetensors" if first and last else f"model-{count:05d}.safetensors"
                save_file(dict(bucket), folder / name, metadata={"format": "pt"})
                shards.update(dict.fromkeys((n for n, _ in bucket), name))
                total += sum(t.numel() * t.element_size() for _, t in bucket)
            first = False
        if self.rank != 0:
            return
        if count == 1 and not (folder / "model.safetensors").exists():  # the last bucket came back empty
            os.replace(folder / "model-00001.safetensors", folder / "model.safetensors")
        if count > 1:
            index = {"metadata": {"total_size": total}, "weight_map": shards}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        model = self.actor.model
        model.config.save_pretrained(folder)
        if model.can_generate() and model.generation_config is not None:
            model.generation_config.save_pretrained(folder)

    # weight sync over a process group of its own (`tidal.sync.broadcast`), rank 0 only
    def join_weight_group(self, init_method: str, world: int, timeout_s: float) -> bool:
        from tidal.sync.broadcast import join_group

        self.weight_group = join_group(init_method, 0, world, timeout_s, self.device)
        return True

    def broadcast_weights(self, dtype: torch.dtype, bucket_bytes: int, changed_only: bool = False) -> str | None:
        """Every rank gathers the weights (`changed_only`: those training changes); rank 0
        broadcasts them (as `dtype`) and returns the checksum of what it sent."""
        from tidal.sync.broadcast import send_weights

        named = self.actor.named_weights(changed_only=changed_only)  # a collective: every rank iterates it
        if self.rank != 0:
            for _ in named:
                pass
            return None
        # streamed: each tensor is gathered, cast and sent in its bucket, never a whole second copy
        return send_weights(self.weight_group, ((n, t.to(dtype)) for n, t in named), bucket_bytes)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def rank_env(cluster: ClusterConfig) -> dict[str, str]:
    """Environment of a trainer rank's Ray worker: its torch threads, and this process's import
    path, so a user policy loss or advantage estimator (`algo.policy_loss: myrl.losses:fn`) found
    here, in the working directory or a folder a script added, is found in the rank too."""
    return {"OMP_NUM_THREADS": str(max(1, int(cluster.cpus_per_trainer))), "PYTHONPATH": import_path_env()}


class TrainerGroup:
    """The trainer role over `cluster.trainers` rank actors (see the module docstring)."""

    def __init__(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        algo: AlgoConfig,
        model: str | Path,
        reference: str | Path,
        temperature: float,
        pad_id: int,
        max_response_len: int,
        group,
        bundles: list[int],
        critic: bool = False,
    ) -> None:
        """`critic`: the ranks also train PPO's critic (`RankCritic`, as `self.critic`)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tidal.cluster.ray_setup import actor_gpus
        from tidal.net import host_store, node_ip

        self.timeout = cluster.sync_timeout
        self.tp_size, self.cp_size = cluster.tp_size, cluster.cp_size
        world = cluster.trainers
        # the ranks' store is served from here, bound before they are told its port (`host_store`)
        self._store = host_store(node_ip(), max(cluster.sync_timeout, STARTUP_TIMEOUT_S)) if world > 1 else None
        init = f"tcp://{node_ip()}:{self._store.port if self._store else 0}"
        remote = ray.remote(TrainerRank)
        self.ranks = [
            remote.options(
                num_cpus=cluster.cpus_per_trainer,
                num_gpus=actor_gpus(cluster)[0],
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundles[r]),
                runtime_env={"env_vars": rank_env(cluster)},
            ).remote(
                r,
                world,
                init,
                train,
                algo,
                str(model),
                str(reference),
                temperature,
                pad_id,
                max_response_len,
                int(cluster.cpus_per_trainer),
                cluster.sync_timeout,
                cluster.device,
                critic,
                cluster.tp_size,
                cluster.cp_size,
            )
            for r in range(world)
        ]
        self.where: list[tuple[str, int] | None] = [None] * world  # (node, pid) of each rank
        self.where = self._get([r.ready.remote() for r in self.ranks], "starting the trainer ranks", STARTUP_TIMEOUT_S)
        self.has_reference = algo.kl_coef > 0
        self.has_teacher = bool(algo.teacher)
        self.critic = RankCritic(self) if critic else None

    def describe(self) -> str:
        """What trains (rank 0's `Actor.describe`), and over how many ranks."""
        line = self._get([self.ranks[0].describe.remote()], "describing the trained model", self.timeout)[0]
        if len(self.ranks) == 1:
            return line
        split = f", each layer split over {self.tp_size} (tensor parallel)" if self.tp_size > 1 else ""
        if self.cp_size > 1:
            split += f", each micro-batch's tokens split over {self.cp_size} (context parallel)"
        return f"{line}, sharded over {len(self.ranks)} trainer ranks (FSDP2{split})"

    def rank_name(self, rank: int) -> str:
        """`trainer rank 1 (node 10.0.0.5, pid 1234)`."""
        return rank_name(rank, self.where[rank])

    def _get(self, refs, what: str, timeout: float | None = None):
        """Each rank's result (`refs` in rank order); a rank that dies, stops or fails raises
        `TrainerRankError` naming it and what the others were waiting in (`tidal.cluster.ranks`)."""
        limit = timeout or self.timeout * 4
        return wait_for_ranks(refs, self.where[: len(refs)], what, limit, collective_timeout=self.timeout)

    def compute_log_probs(self, samples: Sequence[Sample], which: str = "policy") -> Tensor:
        # every rank scores its share and returns the sum over ranks
        refs = [r.compute_log_probs.remote(list(samples), which) for r in self.ranks]
        return self._get(refs, f"computing {which} log-probs")[0]

    def train_step(self, samples, advantages, old_log_probs=None, ref_log_probs=None) -> dict[str, float]:
        args = (list(samples), advantages, old_log_probs, ref_log_probs)
        results = self.data_parallel(self._get([r.train_sums.remote(*args) for r in self.ranks], "a train step"))
        sums = Sums()
        for s, _ in results:
            sums.merge(s)
        extra = dict(results[0][1])
        extra["actor/tokens"] = sum(e["actor/tokens"] for _, e in results)
        return {**sums.mean(), **extra}

    def data_parallel(self, results: list) -> list:
        """One result per dp group (rank dp * group + 0): its tp (or cp) ranks computed the same share."""
        return results[:: self.tp_size * self.cp_size]

    def named_weights(self, dtype: torch.dtype | None = None, changed_only: bool = False, merged: bool = True):
        """The whole tensors, streamed from rank 0 a bucket (`WEIGHT_BUCKET_BYTES`) at a time: the
        ranks gather each bucket when the iteration reaches it (`TrainerRank.weights_bucket`)."""
        if not merged:  # config validation keeps train.lora_merge false to one trainer in this process
            raise ValueError("named_weights(merged=False): the ranks send merged weights only")
        return self._stream_weights(dtype, changed_only)

    def _stream_weights(self, dtype: torch.dtype | None, changed_only: bool):
        first, last = True, False
        while not last:
            refs = [r.weights_bucket.remote(dtype, changed_only, WEIGHT_BUCKET_BYTES, first) for r in self.ranks]
            bucket, last = self._get(refs, "gathering the weights")[0]
            first = False
            yield from bucket

    def weight_shapes(self, changed_only: bool = False) -> list[tuple[str, tuple[int, ...]]]:
        ref = self.ranks[0].weight_shapes.remote(changed_only)
        return self._get([ref], "listing the weights' shapes", self.timeout)[0]

    def state_dict(self) -> dict:
        return self._get([r.state_dict.remote() for r in self.ranks], "gathering the optimizer state")[0]

    def load_state_dict(self, state: dict) -> None:
        self._get([r.load_state_dict.remote(state) for r in self.ranks], "loading the optimizer state")

    def save_model(self, path: str | Path) -> None:
        self._get([r.save_model.remote(str(path)) for r in self.ranks], f"saving the model to {path}")

    def close(self) -> None:
        """Kill the actors (a rank or engine stuck in a broken collective would not answer a
        polite call); their processes free every resource they held."""
        import ray

        for a in self.ranks:
            ray.kill(a)
        self._store = None


class RankCritic:
    """PPO's critic role over the trainer ranks' critics (see the module docstring)."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group

    def values(self, samples: Sequence[Sample]) -> Tensor:
        # every rank computes its share's values and returns the sum over ranks
        refs = [r.critic_values.remote(list(samples)) for r in self.group.ranks]
        return self.group._get(refs, "computing the critic's values")[0]

    def train_step(self, samples: Sequence[Sample], returns: Tensor, old_values: Tensor) -> dict[str, float]:
        refs = [r.critic_train_sums.remote(list(samples), returns, old_values) for r in self.group.ranks]
        results = self.group.data_parallel(self.group._get(refs, "a critic step"))
        sums = Sums()
        for s, _ in results:
            sums.merge(s)
        return {**sums.mean(), **results[0][1]}

    def state_dict(self) -> dict:
        refs = [r.critic_state_dict.remote() for r in self.group.ranks]
        return self.group._get(refs, "gathering the critic's weights and optimizer state")[0]

    def load_state_dict(self, state: dict) -> None:
        self.group._get([r.critic_load_state_dict.remote(state) for r in self.group.ranks], "loading the critic")
