"""The loop on Ray (tiny model): 2 FSDP2 trainer ranks and 2 engine actors, disaggregated and
colocated, against the in-process default; and weight syncs that fail end the run with an error
naming the engine and the transport, within the timeout, leaving no Ray workers behind."""

import asyncio
import importlib.util
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import loop_config

import tidal.loop
from tidal.backends import RAY

VOLATILE = ("time/", "perf/")


def config(model_dir, out_dir, **over):
    return loop_config(model_dir, out_dir, **{"train.num_steps": 2, "rollout.rollout_batch_size": 2, **over})


def _ours(pid: int) -> bool:
    """Whether `pid` descends from this test process (its Ray's workers do): other test runs on a
    shared machine have Ray workers of the same classes."""
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def workers() -> list[str]:
    """Command lines of this test run's Ray actor processes of tidal's classes."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if ("TrainerRank" in cmd or "EngineServer" in cmd) and _ours(int(pid)):
                out.append(cmd)
    return out


def no_workers_left(timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while workers():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.fixture(scope="module")
def local_run(tiny_model_dir, tmp_path_factory):
    return tidal.loop.train(config(tiny_model_dir, tmp_path_factory.mktemp("local")))


LAYOUTS = {
    "2+2": {"cluster.trainers": 2, "cluster.engines": 2},
    "2+2 colocated": {"cluster.trainers": 2, "cluster.engines": 2, "cluster.colocate": True},
    # the two trainer ranks split each layer between them (tensor parallel), one engine
    "2 tp+1": {"cluster.trainers": 2, "cluster.tp_size": 2, "cluster.engines": 1},
    # the two trainer ranks split each micro-batch's tokens between them (context parallel)
    "2 cp+1": {"cluster.trainers": 2, "cluster.cp_size": 2, "cluster.engines": 1},
    # the rehearsal of a cluster layout on one machine (docs/scaling.md): the same Ray path, smallest
    "1+1 with cluster.ray true": {"cluster.ray": True},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainer_ranks_and_engines_on_ray_train_like_one_process(
    ray_session, tiny_model_dir, tmp_path, local_run, layout
):
    cfg = config(tiny_model_dir, tmp_path, **LAYOUTS[layout])
    assert (cfg.uses_ray, cfg.placement, cfg.weight_sync.name) == (True, RAY, "broadcast")
    history = tidal.loop.train(cfg)
    assert [h["step"] for h in history] == [1, 2]
    first, local = history[0], local_run[0]
    # step 1 samples the same initial weights with the same seeds: the same batch and update
    for key in ("reward/mean", "response/length_mean", "loss/pg", "actor/tokens", "actor/skipped_samples"):
        assert first[key] == pytest.approx(local[key], rel=1e-5, abs=1e-6), key
    assert first["actor/grad_norm"] == pytest.approx(local["actor/grad_norm"], rel=1e-4)
    # the engine actors' counters over HTTP, summed over them: the same tokens fed back one at a
    # time, and every prompt token computed or taken from a cache, as by the one engine
    assert first["engine/decode_tokens"] == local["engine/decode_tokens"]
    spared = ("engine/prefill_tokens", "engine/cached_tokens")
    assert sum(first[k] for k in spared) == sum(local[k] for k in spared)
    for h in history:  # every push moved the whole model, checked by the engines' checksums
        assert h["sync/bytes"] > 0 and h["time/sync"] > 0 and h["time/engine_idle"] >= h["time/sync"]
    ckpt = tmp_path / "checkpoints" / "step_2"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(ckpt).config.num_hidden_layers == 2
    assert no_workers_left()


def test_ppo_with_the_critic_on_two_colocated_ranks_trains_like_one_process(ray_session, tiny_model_dir, tmp_path):
    """The critic on the trainer ranks, beside the actor, the engines colocated: the first step's
    values, advantages and both losses are the in-process run's."""
    ppo = {"algo.advantage": "ppo", "algo.critic_lr": 1e-3}
    local = tidal.loop.train(config(tiny_model_dir, tmp_path / "local", **ppo))
    layout = {"cluster.trainers": 2, "cluster.engines": 2, "cluster.colocate": True}
    history = tidal.loop.train(config(tiny_model_dir, tmp_path / "ray", **ppo, **layout))
    assert [h["step"] for h in history] == [1, 2]
    first, one = history[0], local[0]
    for key in ("reward/mean", "loss/pg", "critic/loss", "critic/value_mean", "critic/clip_frac", "actor/tokens"):
        assert first[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    for key in ("actor/grad_norm", "critic/grad_norm"):
        assert first[key] == pytest.approx(one[key], rel=1e-4), key
    assert history[1]["critic/value_mean"] != 0.0  # the second step's values come from the trained critic
    assert no_workers_left()


def engine_roles(tiny_model_dir, tmp_path, timeout, **over):
    from transformers import AutoTokenizer

    from tidal.roles import build_roles

    cfg = config(
        tiny_model_dir,
        tmp_path,
        **{"cluster.trainers": 1, "cluster.engines": 2, "cluster.sync_timeout": timeout, **over},
    )
    cfg, _ = tidal.loop.resolve_precision(cfg)
    return build_roles(cfg, Path(tiny_model_dir), AutoTokenizer.from_pretrained(str(tiny_model_dir)), None)


def after_recover(engines, act) -> None:
    """Call `act()` right after the push's `engines.recover()` (its health check and restarts):
    a fault there is one during the weight push itself, which the push names rather than recovers."""
    recover = engines.recover

    def recover_then_act() -> bool:
        changed = recover()
        act()
        return changed

    engines.recover = recover_then_act


def test_an_engine_killed_during_weight_sync_ends_the_push_naming_it(ray_session, tiny_model_dir, tmp_path):
    import ray

    from tidal.sync.base import SyncError

    roles = engine_roles(tiny_model_dir, tmp_path, timeout=60)
    try:
        roles.sync.push(1)
        victim = roles.engines.actors[1]
        pid = ray.get(victim.pid.remote())

        def stop_then_kill() -> None:  # once the push has checked the engines and is under way:
            os.kill(pid, signal.SIGSTOP)  # stuck: the push waits on it...
            threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()  # ...and then it dies

        after_recover(roles.engines, stop_then_kill)
        t0 = time.monotonic()
        with pytest.raises(SyncError) as err:
            roles.sync.push(2)
        assert time.monotonic() - t0 < 60
        msg = str(err.value)
        assert "over broadcast" in msg and roles.engines.urls[1] in msg and "(engine 1)" in msg
        assert "the process died" in msg
    finally:
        roles.close()
    assert no_workers_left()


def test_a_weight_sync_past_its_timeout_ends_the_push_naming_the_engine(ray_session, tiny_model_dir, tmp_path):
    import ray

    from tidal.sync.base import SyncError

    roles = engine_roles(tiny_model_dir, tmp_path, timeout=5)
    pid = None
    try:
        roles.sync.push(1)
        # the rollout role's controls reach every engine actor
        assert roles.engines.health()
        roles.engines.pause()
        roles.engines.resume()
        loop = roles.engines.loop
        assert loop.run(roles.engines.engine.get_weight_versions(), 30) == [1, 1]
        # the engines listen on the node's address, so only this run (it holds the key) may call them
        import httpx

        assert httpx.get(roles.engines.urls[0] + "/get_weight_version").status_code == 401
        pid = ray.get(roles.engines.actors[0].pid.remote())
        # the engine stops answering once the push has checked the engines and is under way
        after_recover(roles.engines, lambda: os.kill(pid, signal.SIGSTOP))
        t0 = time.monotonic()
        with pytest.raises(SyncError, match=r"over broadcast: the broadcast timed out after 5 s") as err:
            roles.sync.push(2)
        assert 5 <= time.monotonic() - t0 < 60  # the timeout, then the teardown; generous for a loaded machine
        # the silent engine is the one named; the others were waiting on it
        assert str(err.value).startswith(f"weight sync to engine {roles.engines.urls[0]} (engine 0) over broadcast")
        assert "waiting with it: trainer rank 0" in str(err.value)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        roles.close()
    assert no_workers_left()


@pytest.fixture(scope="module")
def h32_model_dir(tmp_path_factory, tokenizer):
    """The tiny Llama with 32-dimensional heads (vLLM's CPU attention has no 16)."""
    from conftest import make_model

    path = tmp_path_factory.mktemp("tiny_model_h32")
    make_model(num_attention_heads=2, num_key_value_heads=2).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here"),
]


@pytest.mark.parametrize(
    "kind,policy", [("tidal", "restart"), ("tidal", "drop"), pytest.param("vllm", "restart", marks=VLLM_MARKS)]
)
def test_an_engine_killed_during_a_rollout_is_restarted_on_the_current_weights(
    ray_session, tiny_model_dir, h32_model_dir, tmp_path, kind, policy
):
    """The engine process dies holding requests: they are sent again to the other engine (every
    sample comes back once, the one a healthy run samples), and before the next rollout the
    engine is restarted in its place and given the current weights (or dropped). The same for
    tidal's engine and vLLM in the engine actors."""
    import ray

    from tidal.contracts import SamplingParams

    prompts = [[5, 9, 33, 70]] * 4 + [[12, 40, 41, 42]] * 4 + [[100, 7]] * 4
    params = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=50 + i) for i in range(len(prompts))]
    model_dir = h32_model_dir if kind == "vllm" else tiny_model_dir
    over = {"cluster.engine_failure": policy, "engine.kind": kind}
    roles = engine_roles(model_dir, tmp_path, timeout=120, **over)
    try:
        roles.sync.push(1)
        engine, router, loop = roles.engines.engine, roles.engines.engine.router, roles.engines.loop

        async def rollout():
            calls = [
                engine.generate(p, sp, group=i // 4) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            return await asyncio.gather(*calls)

        reference = [o.token_ids for o in loop.run(rollout(), 120)]
        victim, old_url = roles.engines.actors[1], roles.engines.urls[1]
        pid = ray.get(victim.pid.remote())
        loop.run(router.clients[1].pause(), 30)  # its requests wait there...
        running = loop.submit(rollout())
        deadline = time.monotonic() + 60
        while router.in_flight[1] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        held = router.in_flight[1]
        os.kill(pid, signal.SIGKILL)  # ...and the process dies with them
        outs = running.result(120)
        assert [o.token_ids for o in outs] == reference
        assert all(o.weight_version == 1 for o in outs)
        assert list(router.down) == [1] and router.resent >= held >= 1
        metrics = roles.sync.push(2)  # recovers the engine first, then every engine gets version 2
        assert metrics["engines/restarts"] == 1.0
        if policy == "restart":
            assert roles.engines.urls[1] != old_url and ray.get(roles.engines.actors[1].pid.remote()) != pid
            assert engine.router.down == {} and loop.run(engine.get_weight_versions(), 30) == [2, 2]
        else:
            assert len(roles.engines.actors) == 1 and old_url not in roles.engines.urls
            assert engine.router.down == {} and loop.run(engine.get_weight_versions(), 30) == [2]
        outs = loop.run(rollout(), 120)
        assert {o.weight_version for o in outs} == {2}
    finally:
        roles.close()
    assert no_workers_left()


@pytest.mark.parametrize("colocate", [False, True])
def test_an_engine_that_dies_after_its_rollout_is_restarted_by_the_push_on_the_pushed_weights(
    ray_session, tiny_model_dir, tmp_path, colocate
):
    """The engine process dies after its last request of the rollout (colocated: while the trainer
    trains, the engines asleep), which the router never saw: the push finds it, restarts it in its
    place and gives it the trained weights, so the run goes on and the restarted engine samples
    with exactly the trainer's log-probs."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from tidal.contracts import SamplingParams
    from tidal.types import Sample

    over = {"sampling.temperature": 1.0, "cluster.colocate": colocate}
    roles = engine_roles(tiny_model_dir, tmp_path, timeout=120, **over)
    try:
        roles.sync.push(1)
        engine, router, loop = roles.engines.engine, roles.engines.engine.router, roles.engines.loop
        prompts = [[5, 9, 33, 70]] * 4 + [[12, 40, 41, 42]] * 4

        async def generate(client, prompt, seed):
            return await client.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed))

        async def rollout():
            sp = [SamplingParams(temperature=1.0, max_new_tokens=8, seed=70 + i) for i in range(len(prompts))]
            return await asyncio.gather(
                *(engine.generate(p, s, group=i // 4) for i, (p, s) in enumerate(zip(prompts, sp, strict=True)))
            )

        def sample(prompt, out) -> Sample:
            n = len(out.token_ids)
            return Sample(
                tokens=prompt + out.token_ids, response_length=n, loss_mask=[1] * n, rollout_log_probs=out.log_probs
            )

        outs = loop.run(rollout(), 120)
        assert router.down == {} and {o.weight_version for o in outs} == {1}
        samples = [sample(p, o) for p, o in zip(prompts, outs, strict=True)]
        for i, s in enumerate(samples):
            s.group_index, s.index = i // 4, i
        victim, old_url = roles.engines.actors[1], roles.engines.urls[1]
        pid = ray.get(victim.pid.remote())
        if colocate:
            roles.engines.sleep()
        roles.trainer.train_step(samples, torch.tensor([1.0, -1.0] * 4))
        os.kill(pid, signal.SIGKILL)  # the rollout is over, the new weights are not pushed yet
        if colocate:
            roles.engines.wake()  # the dead engine is taken out of service, not an error
        metrics = roles.sync.push(2)
        assert metrics["engines/restarts"] == 1.0
        assert roles.engines.urls[1] != old_url and ray.get(roles.engines.actors[1].pid.remote()) != pid
        assert router.down == {} and loop.run(engine.get_weight_versions(), 30) == [2, 2]
        # the restarted engine serves the trained weights: its log-probs are the trainer's ...
        prompt = [12, 40, 41, 42]
        out = loop.run(generate(router.clients[1], prompt, seed=5), 120)
        assert out.weight_version == 2 and len(out.token_ids) > 0
        n = len(out.token_ids)
        trained = roles.trainer.compute_log_probs([sample(prompt, out)])[0, :n]
        torch.testing.assert_close(torch.tensor(out.log_probs), trained, atol=1e-4, rtol=0)
        # ... and not the initial ones it loaded at its start
        initial_model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
        with torch.no_grad():
            logits = initial_model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        initial = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (initial - trained).abs().max() > 1e-3
        # the run goes on: the next rollout is on version 2
        assert {o.weight_version for o in loop.run(rollout(), 120)} == {2}
    finally:
        roles.close()
    assert no_workers_left()


def test_engines_that_do_not_start_within_the_grace_period_are_named(ray_session, tiny_model_dir, tmp_path):
    with pytest.raises(TimeoutError) as err:
        engine_roles(tiny_model_dir, tmp_path, timeout=60, **{"cluster.engine_startup_timeout": 0.01})
    assert str(err.value) == (
        "engines: engine 0, engine 1 did not start within 0.01 s (cluster.engine_startup_timeout)"
    )
    assert no_workers_left()


def test_the_ranks_weights_reach_the_driver_a_bucket_at_a_time(ray_session, tiny_model_dir, tmp_path, monkeypatch):
    """`TrainerGroup.named_weights` (what the http, disk and distributed transports send from
    trainer ranks): every whole tensor once, cast as asked, gathered by the ranks a bucket at a
    time as the iteration reaches it."""
    from transformers import AutoModelForCausalLM

    from tidal.cluster import trainers

    monkeypatch.setattr(trainers, "WEIGHT_BUCKET_BYTES", 60_000)  # the tiny model in several buckets
    roles = engine_roles(tiny_model_dir, tmp_path, timeout=60, **{"cluster.trainers": 2, "cluster.engines": 1})
    try:
        calls = []  # the group's waits on its ranks: one per bucket
        wait = roles.trainer._get
        roles.trainer._get = lambda refs, what, *a: calls.append(what) or wait(refs, what, *a)
        got = list(roles.trainer.named_weights(torch.bfloat16))
    finally:
        roles.close()
    want = dict(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).named_parameters())
    assert [n for n, _ in got] == list(want)
    for name, t in got:
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[name].detach().to(torch.bfloat16)), name
    assert len(calls) > 2 and set(calls) == {"gathering the weights"}
    assert no_workers_left()
