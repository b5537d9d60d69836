"""Workflow self-optimisation: an agent's workflow definition, step statistics from the lake,
proposed changes as JSON Patch (RFC 6902) with their evidence, and a person's review of them.

Pure code (no Dagster): ``definition`` (the format and its versioned store), ``derive`` (a
definition from what the logs show), ``stats`` (per-step statistics), ``proposals`` (the rules
that propose changes), ``review`` (approve / reject, audit log); and
``assets``, the thin Dagster assets on top. See ``docs/workflows.md``.
"""
