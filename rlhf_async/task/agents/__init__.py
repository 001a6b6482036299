"""What plays a multi-turn episode: `task.env` classes and their chat-template rendering
(`environment`), `task.agent` agents on the policy's OpenAI-compatible endpoint (`agent`,
`agent_session`, `endpoint`), tools in a sandbox (`sandbox`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf_async.config import ConfigError

if TYPE_CHECKING:
    from rlhf_async.task.agents.agent import AgentEpisodes


def agent_episodes(agent: str | Any, tok: Any) -> AgentEpisodes:
    """The episode driver of an agent: `task.agent`'s ('file.py:run') or an adapter's
    (`async agent(base_url, row) -> reward`), one endpoint session per episode."""
    try:  # the endpoint needs aiohttp, an extra: imported only when an agent plays
        from rlhf_async.task.agents.agent import AgentEpisodes, load_agent
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "aiohttp":
            raise
        raise ConfigError(["task.agent: the agent endpoint needs aiohttp: pip install "
                           "'rlhf-async[agent]'"]) from None
    return AgentEpisodes(load_agent(agent) if isinstance(agent, str) else agent, tok,
                         bool(getattr(tok, "chat_template", None)))
