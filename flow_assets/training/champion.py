"""The champion as a Dagster asset: the registry's every change is one materialisation.

``champion`` is an external asset (an :class:`~dagster.AssetSpec`: Dagster does not compute it, it
records what happened to it). Three things change the registry, and each reports the change as a
materialisation of ``champion``, so the UI shows the adapter history (v0, v1, ...) with lineage:

- ``base_policy`` registers ``v0``;
- ``promoted_adapter`` promotes a candidate that passed the gate;
- ``flowopt rollback`` restores the previous champion (a runless event on the instance).

The graph has no edge back from ``promoted_adapter`` to ``champion``: the loop champion -> rollouts
-> log batch -> round -> promotion would be a cycle, which Dagster's asset graph cannot hold.
"""

from __future__ import annotations

import time

from dagster import AssetKey, AssetMaterialization, MetadataValue

CHAMPION = AssetKey("champion")
CHAMPION_DESCRIPTION = (
    "The adapter the trainable agent is served with, as the registry (registry.json in the models "
    "directory) records it. Every change is one materialisation: v0 registered by base_policy, each "
    "promotion by promoted_adapter, each rollback by flowopt rollback; its metadata gives the version, "
    "the adapter, who changed it and why, and the registry's recent history."
)


def champion_materialization(content: dict, history_rows: int = 20) -> AssetMaterialization:
    """The materialisation of ``champion`` for a registry ``content`` (``AdapterRegistry.load()``)
    right after a change: the champion, the event that made it (``action``, ``previous``, ``by``,
    ``reason``) and the last ``history_rows`` events as a Markdown table (times in UTC).

    Raises:
        ValueError: the registry has no champion yet.
    """
    entry = content.get("champion")
    if not entry:
        raise ValueError("the registry has no champion")
    history = content.get("history", [])
    last = history[-1] if history else {}
    lines = ["| version | action | previous | by | reason | at (UTC) |", "|---|---|---|---|---|---|"]
    for event in reversed(history[-history_rows:]):
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(event.get("at", 0)))
        reason = str(event.get("reason", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {event['version']} | {event['action']} | {event.get('previous') or '-'} | {event.get('by', '')} | {reason} | {at} |")
    return AssetMaterialization(
        asset_key=CHAMPION,
        description=f"{last.get('action', 'register')}: {entry['version']}" + (f" (was {last['previous']})" if last.get("previous") else ""),
        metadata={
            "version": entry["version"],
            "action": last.get("action", ""),
            "previous": last.get("previous") or "",
            "by": last.get("by", ""),
            "reason": last.get("reason", ""),
            "adapter": MetadataValue.path(entry["adapter_path"]),
            "versions_in_history": MetadataValue.int(len({e["version"] for e in history})),
            "history": MetadataValue.md("\n".join(lines)),
        },
    )
