"""Serving the policy to agents: ``gateway`` (the OpenAI-compatible server that captures every
call with its token ids and log-probs) and ``agents`` (the harness that runs an agent through it, and
the built-in agents)."""
