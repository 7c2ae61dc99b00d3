"""tidal.hooks: every option that takes user code is imported and checked before anything loads,
user modules are found in the working directory (as `python -m` finds them) and in the processes
tidal starts, and each error names the option, the path, why, and the forms that work."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import textwrap

import pytest

from tidal.config import GROUPS, Config
from tidal.hooks import FORMS, HOOKS, check_user_code
from tidal.options import USER_CODE, ConfigError

USER_CODE_FILE = textwrap.dedent(
    '''
    def reward(sample):
        return float(len(sample.response))

    def two(sample, label):
        return 0.0

    async def agent_two(client, prompt):
        return 1.0

    def keep(group):
        return True

    class HalfBuffer:
        def add(self, group):
            pass

    def search(query: str) -> str:
        """Search the notes."""
        return query

    def broken(query: "NoSuchType") -> str:  # noqa: F821
        return query
    '''
)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project folder as the working directory, holding `myrl/hooks.py`, and not on the
    import path (as when the `tidal` script runs: Python puts the script's folder there)."""
    for name in [m for m in sys.modules if m == "myrl" or m.startswith("myrl.")]:  # another test's package
        del sys.modules[name]
    (tmp_path / "myrl").mkdir()
    (tmp_path / "myrl" / "__init__.py").write_text("")
    (tmp_path / "myrl" / "hooks.py").write_text(USER_CODE_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.curdir, str(tmp_path))])
    yield tmp_path
    for name in [m for m in sys.modules if m == "myrl" or m.startswith("myrl.")]:
        del sys.modules[name]


def config(**values) -> Config:
    """A Config with `group.key` values set as given, unvalidated (what check_user_code reads)."""
    cfg = Config()
    for dotted, value in values.items():
        group, _, key = dotted.partition(".")
        setattr(getattr(cfg, group), key, value)
    return cfg


def errors(cfg: Config) -> list[str]:
    with pytest.raises(ConfigError) as err:
        check_user_code(cfg)
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid config:"
    return [line.removeprefix("  ") for line in lines[1:]]


def test_a_module_in_the_working_directory_is_found(project):
    check_user_code(
        config(**{"reward.fn": "myrl.hooks:reward", "rollout.generate": "tools", "tools.names": ["myrl.hooks:search"]})
    )
    assert sys.path[0] == str(project)  # put first, as `python -m` puts it
    check_user_code(config(**{"reward.fn": "myrl/hooks.py:reward"}))  # the file form, relative to it too


def test_a_module_that_is_not_found_says_where_it_was_looked_for(project, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/opt/elsewhere")
    assert errors(config(**{"reward.fn": "myrl.rewards:reward"})) == [
        "reward.fn: cannot load 'myrl.rewards:reward': module 'myrl.rewards' not found (No module named "
        f"'myrl.rewards'); looked in the working directory {project}, PYTHONPATH (/opt/elsewhere) and the installed "
        f"packages; {FORMS}"
    ]
    assert errors(config(**{"reward.fn": "myrl/rewards.py:reward"})) == [
        f"reward.fn: cannot load 'myrl/rewards.py:reward': file '{project}/myrl/rewards.py' not found; {FORMS}"
    ]
    assert errors(config(**{"reward.fn": "myrl/hooks.py:score"})) == [
        f"reward.fn: cannot load 'myrl/hooks.py:score': '{project}/myrl/hooks.py' has no attribute 'score'; {FORMS}"
    ]


def test_forms_name_both_spellings():
    assert FORMS == (
        "a user function is given as pkg.module:fn (a module importable from the working directory or PYTHONPATH) "
        "or path/to/file.py:fn"
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"reward.fn": "myrl.hooks:two"},
            "reward.fn: 'myrl.hooks:two' takes (sample, label); tidal calls it with 1 argument: "
            "reward(sample) -> float | dict, sync or async",
        ),
        (
            {"reward.group_fn": "myrl.hooks:two"},
            "reward.group_fn: 'myrl.hooks:two' takes (sample, label); tidal calls it with 1 argument: "
            "group_reward(samples) -> list[float | dict], sync or async",
        ),
        (
            {"algo.advantage": "myrl.hooks:reward"},
            "algo.advantage: 'myrl.hooks:reward' takes (sample); tidal calls it with 4 arguments: "
            "advantage(rewards, mask, group_size, samples) -> [N] or [N, R] advantages",
        ),
        (
            {"algo.policy_loss": "myrl.hooks:two"},
            "algo.policy_loss: 'myrl.hooks:two' takes (sample, label); tidal calls it with 5 arguments: "
            "policy_loss(logp, old_logp, advantages, mask, algo) -> (per_token_loss, metrics)",
        ),
        (
            {"algo.dynamic_sampling_filter": "myrl.hooks:two"},
            "algo.dynamic_sampling_filter: 'myrl.hooks:two' takes (sample, label); tidal calls it with 1 argument: "
            "keep(group: list[Sample]) -> bool",
        ),
        (
            {"overlap.mode": "one_step", "overlap.buffer_filter": "myrl.hooks:keep"},
            "overlap.buffer_filter: 'myrl.hooks:keep' takes (group); tidal calls it with 3 arguments: "
            "buffer_filter(groups, n, step) -> list[int]",
        ),
        (
            {"overlap.mode": "full", "overlap.buffer": "myrl.hooks:HalfBuffer"},
            "overlap.buffer: 'myrl.hooks:HalfBuffer' has no get, state_dict, load_state_dict; expected a class whose "
            "instances have add, get, state_dict and load_state_dict",
        ),
        (
            {"rollout.generate": "agent", "agent.fn": "myrl.hooks:agent_two"},
            "agent.fn: 'myrl.hooks:agent_two' takes (client, prompt); tidal calls it with 3 arguments: "
            "async def agent(client, prompt, label)",
        ),
        (
            {"rollout.generate": "agent", "agent.fn": "myrl.hooks:keep"},
            "agent.fn: 'myrl.hooks:keep' must be `async def agent(client, prompt, label)`",
        ),
        (
            {"rollout.generate": "myrl.hooks:keep"},
            "rollout.generate: 'myrl.hooks:keep' must be `async def generate(ctx, sample, sampling)`",
        ),
        (
            {"rollout.generate": "tools", "tools.names": ["calculator", "myrl.hooks:broken"]},
            "tools.names: 'myrl.hooks:broken' cannot be described to the model as a tool: name 'NoSuchType' is not "
            "defined",
        ),
    ],
)
def test_a_function_that_does_not_take_what_tidal_gives_is_named_with_the_call(project, values, message):
    assert errors(config(**values)) == [message]


def test_a_name_that_is_neither_built_in_nor_a_path_lists_the_built_ins(project):
    cfg = config(
        **{
            "reward.fn": "reverse",
            "rollout.generate": "tools",
            "tools.names": ["calculatr"],
            "overlap.mode": "one_step",
            "overlap.buffer_filter": "newest",
        }
    )
    assert errors(cfg) == [
        "reward.fn: 'reverse' is neither built in (math, exact_match, code_tests, judge, rm) nor a path to a "
        f"function; {FORMS}",
        f"overlap.buffer_filter: 'newest' is neither built in (fifo, newest_first, reward_stratified) nor a path to "
        f"a function; {FORMS}",
        f"tools.names: 'calculatr' is neither built in (calculator, python) nor a path to a function; {FORMS}",
    ]


def test_options_not_in_use_are_not_loaded(project):
    # the buffer exists only with overlap on, tools and the agent only with their generate
    check_user_code(
        config(
            **{
                "overlap.buffer": "nowhere_x:Buffer",
                "tools.names": ["nowhere_y:tool"],
                "agent.fn": "nowhere_z:agent",
                "reward.group_fn": "myrl.hooks:reward",
                "reward.fn": "nowhere_w:reward",  # group_fn scores instead of it
            }
        )
    )


def test_every_option_whose_help_offers_user_code_is_checked():
    """An option whose --help says it takes `pkg.module:fn` is one check_user_code loads: a new
    hook option is caught here until it is added to HOOKS (and so checked before the model)."""
    defaults = Config()
    offered = {
        f"{group}.{f.name}"
        for group in GROUPS
        for f in dataclasses.fields(getattr(defaults, group))
        if USER_CODE in f.metadata.get("help", "")
    }
    assert offered == set(HOOKS)


def test_a_reward_worker_process_finds_the_module_in_the_working_directory(project):
    """A sync reward runs in worker processes (`reward.workers`): they find the user's module where
    the run found it, in the working directory."""
    from tidal.reward.pool import RewardPool
    from tidal.types import Sample

    check_user_code(config(**{"reward.fn": "myrl.hooks:reward"}))
    pool = RewardPool("myrl.hooks:reward", 1)
    try:
        assert asyncio.run(pool(Sample(prompt="p", response="abc"))) == 3.0
    finally:
        pool.close()
