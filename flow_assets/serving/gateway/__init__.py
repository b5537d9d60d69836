"""The policy gateway: an OpenAI-compatible server in front of the policy that records every
rollout an agent makes through it (see ``app.py``)."""
