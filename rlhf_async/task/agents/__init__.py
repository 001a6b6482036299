"""What plays a multi-turn episode: `task.env` classes and their chat-template rendering
(`environment`), `task.agent` agents on the policy's OpenAI-compatible endpoint (`agent`,
`agent_session`, `endpoint`), tools in a sandbox (`sandbox`)."""
