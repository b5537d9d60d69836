"""Agents in the loop: the harness that runs them against the gateway, and the built-in agents."""
