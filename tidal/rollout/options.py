"""The rollout's option groups: `rollout` (what one rollout step is), `sampling` (how each token is
drawn), `tools` (the built-in multi-turn tool loop), `agent` (the agent door) and `overlap`
(rollout while the trainer trains)."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.options import USER_CODE, Need, is_dotted, one_of, opt

BUILTIN_GENERATE = ("single_turn", "tools", "agent")
AGENT_SAMPLES = ("last", "first", "all")
OVERLAP_MODES = ("off", "one_step", "full")


@dataclass
class RolloutConfig:
    rollout_batch_size: int = opt(8, "prompts per rollout step")
    n_samples_per_prompt: int = opt(4, "responses sampled per prompt (the GRPO group size)")
    max_new_tokens: int = opt(64, "longest response of one engine call, in tokens")
    generate: str = opt(
        "single_turn",
        "how a prompt becomes samples: single_turn | tools (multi-turn tool loop: the tools group) | agent (the "
        "agent door: the agent group) | your own `async def generate(ctx, sample, sampling)` given as "
        f"{USER_CODE}; a prompt row may name its own in its metadata field `generate`",
    )
    max_turns: int = opt(4, "tools and multi-turn generate functions: most assistant turns per sample")
    max_response_tokens: int = opt(
        0,
        "tools/agent: most response tokens per sample over all turns, tool output included "
        "(0 = max_new_tokens x max_turns)",
    )
    max_failed_ratio: float = opt(
        0.5, "stop the run when more than this share of a step's samples failed (1 = never stop)"
    )

    @property
    def response_budget(self) -> int:
        """Most response tokens of one sample, over all its turns."""
        if self.generate == "single_turn":
            return self.max_new_tokens
        return self.max_response_tokens or self.max_new_tokens * self.max_turns

    def check(self, need: Need) -> None:
        for name in ("rollout_batch_size", "n_samples_per_prompt", "max_new_tokens", "max_turns"):
            need(getattr(self, name) >= 1, f"rollout.{name}: must be >= 1, got {getattr(self, name)}")
        need(
            self.generate in BUILTIN_GENERATE or is_dotted(self.generate),
            f"rollout.generate: single_turn, tools, agent or a dotted path to a generate function, "
            f"got {self.generate!r}",
        )
        need(
            self.max_response_tokens >= 0, f"rollout.max_response_tokens: must be >= 0, got {self.max_response_tokens}"
        )
        need(
            0 <= self.max_failed_ratio <= 1,
            f"rollout.max_failed_ratio: must be in [0, 1], got {self.max_failed_ratio}",
        )


@dataclass
class SamplingConfig:
    """The rollout's sampling; every sample gets its own seed (`tidal.rollout.manager`)."""

    temperature: float = opt(1.0, "sampling temperature (0 = greedy)")
    top_p: float = opt(1.0, "nucleus sampling mass, in (0, 1]")
    top_k: int = opt(0, "sample among the k most likely tokens (0 = off)")
    stop: list = opt([], "stop strings")
    stop_token_ids: list = opt([], "extra stop token ids (the tokenizer's eos always stops)")
    seed: int = opt(0, "base seed; each sample's seed is derived from it, the step and its index")

    def check(self, need: Need) -> None:
        need(self.temperature >= 0, f"sampling.temperature: must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, f"sampling.top_p: must be in (0, 1], got {self.top_p}")
        need(self.top_k >= 0, f"sampling.top_k: must be >= 0, got {self.top_k}")
        need(all(isinstance(s, str) and s for s in self.stop), "sampling.stop: must be a list of non-empty strings")
        need(
            all(isinstance(i, int) and not isinstance(i, bool) for i in self.stop_token_ids),
            "sampling.stop_token_ids: must be a list of integers",
        )


@dataclass
class ToolsConfig:
    """The built-in tool loop (`rollout.generate: tools`, `tidal.rollout.multi_turn`)."""

    names: list = opt(
        ["calculator", "python"],
        "built-in tools (calculator, python) or your own functions (type-hinted parameters), each given as "
        f"{USER_CODE}",
    )
    max_output_tokens: int = opt(256, "a tool's output is cut to this many tokens")
    timeout: float = opt(10.0, "seconds one tool call may take; then the model reads a timeout error")

    def check(self, need: Need) -> None:
        need(self.max_output_tokens >= 1, f"tools.max_output_tokens: must be >= 1, got {self.max_output_tokens}")
        need(self.timeout > 0, f"tools.timeout: must be > 0 seconds, got {self.timeout}")


@dataclass
class AgentConfig:
    """The agent door (`rollout.generate: agent`, `tidal.rollout.agent`)."""

    fn: str = opt(
        "",
        "your own `async def agent(client, prompt, label)` (client: an openai.AsyncOpenAI; prompt: a string or a list "
        f"of chat messages) given as {USER_CODE}",
    )
    max_drift_tokens: int = opt(
        16, "a re-rendered history that differs only in tokenization over at most this many tokens is realigned"
    )
    request_timeout: float = opt(300.0, "seconds one request of the agent's client to the door may take")
    samples: str = opt(
        "last",
        "which samples of a trajectory are trained when its calls split into several: last | first | all "
        "(all: every trajectory of a batch must split into the same number, else the rollout stops with an error)",
    )
    # agent programs (tidal.rollout.program): the agent as a command, instead of agent.fn
    command: str = opt(
        "",
        "instead of agent.fn: a program run once per sample, e.g. 'python my_agent.py' (split as a shell would, "
        "run with no shell; {prompt} in an argument is replaced by the prompt) in a fresh working directory, with "
        "OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY (its session on the door) and "
        "TIDAL_PROMPT (also on stdin) in its environment; what it prints goes to metadata agent_output",
    )
    timeout: float = opt(
        600.0,
        "agent.command: seconds the program may run per sample; then all its processes are killed, the sample fails",
    )
    memory_mb: int = opt(4096, "agent.command: address space of each of the program's processes, in MiB (RLIMIT_AS)")
    env: dict = opt({}, "agent.command: more environment variables of the program (name: value)")

    def check(self, need: Need) -> None:
        one_of(need, "agent.samples", self.samples, AGENT_SAMPLES)
        need(self.max_drift_tokens >= 0, f"agent.max_drift_tokens: must be >= 0, got {self.max_drift_tokens}")
        need(self.request_timeout > 0, f"agent.request_timeout: must be > 0 seconds, got {self.request_timeout}")
        need(self.timeout > 0, f"agent.timeout: must be > 0 seconds, got {self.timeout}")
        need(self.memory_mb >= 1, f"agent.memory_mb: must be >= 1, got {self.memory_mb}")
        need(
            isinstance(self.env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()),
            f"agent.env: must map variable names to strings, got {self.env!r}",
        )


@dataclass
class OverlapConfig:
    """Rollout and training at once (`async` in other frameworks; `async` is a Python keyword)."""

    mode: str = opt(
        "off",
        "off (rollout, then train) | one_step (roll out step k+1 with version k weights while step k trains) | "
        "full (generate ahead into the buffer, bounded by max_staleness)",
    )
    max_staleness: int = opt(
        1, "full: a trained token is at most this many weight versions older than the trainer (admission control)"
    )
    sync_interval: int = opt(1, "full: push the weights to the engine every this many steps")
    partial_rollout: bool = opt(
        True, "full: abort in-flight requests when new weights arrive and continue them from their tokens"
    )
    partial_loss: str = opt(
        "correct",
        "tokens of a partial rollout sampled by older weights: correct (algo.is_correction re-weights them) | "
        "mask (not trained on)",
    )
    buffer: str = opt(
        "",
        "your own buffer class (add, get, state_dict, load_state_dict; made with no arguments) given as "
        f"{USER_CODE}; empty = built-in",
    )
    buffer_filter: str = opt(
        "fifo",
        "which buffered groups train next: fifo | newest_first | reward_stratified | your own "
        f"`buffer_filter(groups, n, step) -> list[int]` given as {USER_CODE}",
    )
    wait_timeout: float = opt(1800.0, "seconds the trainer waits for a batch before the run stops")

    def check(self, need: Need) -> None:
        one_of(need, "overlap.mode", self.mode, OVERLAP_MODES)
        need(self.max_staleness >= 0, f"overlap.max_staleness: must be >= 0, got {self.max_staleness}")
        need(self.sync_interval >= 1, f"overlap.sync_interval: must be >= 1, got {self.sync_interval}")
        need(
            self.partial_loss in ("correct", "mask"),
            f"overlap.partial_loss: correct or mask, got {self.partial_loss!r}",
        )
        need(self.wait_timeout > 0, f"overlap.wait_timeout: must be > 0 seconds, got {self.wait_timeout}")
        need(
            self.mode != "full" or self.max_staleness >= self.sync_interval - 1,
            f"overlap.max_staleness: must be >= overlap.sync_interval - 1 = {self.sync_interval - 1}: weights pushed "
            f"every {self.sync_interval} steps are that many versions behind the trainer before anything is admitted",
        )
