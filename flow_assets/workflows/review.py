"""A person's review of workflow proposals: approve (the patch is applied as a new version) or
reject, every decision kept in an append-only audit log.

Files, beside the definitions of :class:`~flow_assets.workflows.definition.WorkflowStore`::

    <root>/proposals/<id>.json    one proposal, its status and its review
    <root>/audit.jsonl            one JSON object per line, never rewritten: proposed, superseded,
                                  approve, reject, refuse; each line carries the sha256 of the
                                  line before it (``prev``), so an edited or deleted line shows

Everything runs under the store's lock, so a review and a run of ``workflow_proposals`` never
interleave. An approval applies the patch to the current definition only if the proposal was
made against that very version and every operation of the patch (its ``test`` operations
included) succeeds; otherwise it is refused with the reason, recorded, and the proposal is marked
``stale``. Nothing else in flowopt changes a workflow definition once it exists.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import jsonpointer
from pydantic import ValidationError

from flow_assets.workflows.definition import WorkflowDefinition, WorkflowStore, utc_now, write_json_atomic
from flow_assets.workflows.proposals import Proposal, Review

#: the only part of a definition a proposal may change; agent, version, format and change
#: history belong to the store
PATCHABLE = "/steps"


class ProposalNotFound(KeyError):
    """No proposal has the given id."""


class ReviewRefused(RuntimeError):
    """A review cannot be carried out; ``reason`` says why (also written to the audit log).

    Attributes:
        reason: one sentence for the person who asked.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _NotApplicable(Exception):
    def __init__(self, reason: str, stale: bool = True):
        super().__init__(reason)
        self.reason, self.stale = reason, stale


@dataclass(frozen=True)
class RecordSummary:
    """What :meth:`ProposalBoard.record` did: ids of proposals new to the board, already there
    (their status kept), and open ones it marked ``superseded``."""

    new: list[str]
    kept: list[str]
    superseded: list[str]


class ProposalBoard:
    """The proposals of a workflow directory and their review.

    Args:
        store: the definitions the proposals patch; proposals and the audit log live in its root.
    """

    def __init__(self, store: WorkflowStore):
        self.store = store

    @property
    def proposals_dir(self) -> Path:
        """One ``<id>.json`` per proposal."""
        return self.store.root / "proposals"

    @property
    def audit_path(self) -> Path:
        """The append-only audit log (JSON Lines)."""
        return self.store.root / "audit.jsonl"

    # -- reading ----------------------------------------------------------------------------
    def get(self, proposal_id: str) -> Proposal:
        """The proposal ``proposal_id`` as stored (status and review included).

        Raises:
            ProposalNotFound: no such proposal.
        """
        path = self.proposals_dir / f"{proposal_id}.json"
        if "/" in proposal_id or not path.is_file():
            raise ProposalNotFound(proposal_id)
        return Proposal.model_validate_json(path.read_bytes())

    def find(self, status: str | None = None, agent_id: str | None = None) -> list[Proposal]:
        """Stored proposals, oldest first, optionally only those with ``status`` / of ``agent_id``."""
        if not self.proposals_dir.is_dir():
            return []
        found = [Proposal.model_validate_json(p.read_bytes()) for p in self.proposals_dir.glob("wp-*.json")]
        chosen = [p for p in found if (status is None or p.status == status) and (agent_id is None or p.agent_id == agent_id)]
        return sorted(chosen, key=lambda p: (p.created_at, p.agent_id, p.id))

    def audit(self) -> list[dict[str, Any]]:
        """Every audit log entry, in order."""
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def verify_audit(self) -> list[str]:
        """Problems of the audit log's hash chain: each line's ``prev`` must be the sha256 of the
        line before it (empty for the first); an empty list means the log is intact."""
        if not self.audit_path.exists():
            return []
        problems, prev = [], ""
        for number, line in enumerate(self.audit_path.read_bytes().splitlines(), start=1):
            if json.loads(line).get("prev") != prev:
                problems.append(f"{self.audit_path}, line {number}: prev does not match the line before it")
            prev = hashlib.sha256(line).hexdigest()
        return problems

    # -- writing ----------------------------------------------------------------------------
    def _append(self, action: str, proposal: Proposal, by: str, at: str, **fields: Any) -> None:
        prev = ""
        if self.audit_path.exists():
            lines = self.audit_path.read_bytes().splitlines()
            prev = hashlib.sha256(lines[-1]).hexdigest() if lines else ""
        entry = {"at": at, "action": action, "proposal_id": proposal.id, "agent_id": proposal.agent_id, "by": by,
                 "base_version": proposal.base_version, "rule": proposal.rule, **fields, "prev": prev}  # fmt: skip
        self.audit_path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: bytes already written are never touched, whatever happens to this write
        with open(self.audit_path, "ab") as fh:
            fh.write(json.dumps(entry, ensure_ascii=False, sort_keys=True).encode() + b"\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _save(self, proposal: Proposal) -> None:
        write_json_atomic(self.proposals_dir / f"{proposal.id}.json", proposal.model_dump(mode="json"))

    def record(self, proposals: Iterable[Proposal], agents: Iterable[str], by: str = "workflow_proposals") -> RecordSummary:
        """Store a run's ``proposals`` for ``agents`` (the agents the run judged).

        A proposal already stored keeps its status and review; a new one is stored ``open`` and
        logged as ``proposed``; an ``open`` proposal of one of ``agents`` that this run no longer
        makes (newer logs, a newer version) becomes ``superseded``. Never touches a definition.
        """
        with self.store.locked():
            incoming = {p.id: p for p in proposals}
            judged = set(agents) | {p.agent_id for p in incoming.values()}
            new, kept, superseded = [], [], []
            for proposal in incoming.values():
                if (self.proposals_dir / f"{proposal.id}.json").exists():
                    kept.append(proposal.id)
                    continue
                self._save(proposal)
                self._append("proposed", proposal, by, proposal.created_at, summary=proposal.summary, patch=proposal.patch)
                new.append(proposal.id)
            for old in self.find(status="open"):
                if old.agent_id in judged and old.id not in incoming:
                    at = utc_now()
                    reason = "the rules no longer make this proposal on the current logs and version"
                    self._save(old.model_copy(update={"status": "superseded", "review": Review(action="supersede", by=by, at=at, reason=reason)}))
                    self._append("superseded", old, by, at, reason=reason)
                    superseded.append(old.id)
            return RecordSummary(new, kept, superseded)

    def _refuse(self, proposal: Proposal, by: str, reason: str, stale: bool) -> ReviewRefused:
        at = utc_now()
        if stale:
            self._save(proposal.model_copy(update={"status": "stale", "review": Review(action="refuse", by=by, at=at, reason=reason)}))
        self._append("refuse", proposal, by, at, reason=reason)
        return ReviewRefused(reason)

    def _patched(self, proposal: Proposal, current: WorkflowDefinition | None) -> WorkflowDefinition:
        """``current`` with the proposal's patch applied (not saved).

        Raises:
            _NotApplicable: why it cannot be applied (``stale``: because the definition moved on
                or the patch fails, rather than because of the proposal's own status).
        """
        if proposal.status != "open":
            raise _NotApplicable(f"proposal {proposal.id} is {proposal.status}, not open", stale=False)
        if current is None:
            raise _NotApplicable(f"{proposal.agent_id!r} has no workflow definition in {self.store.root}")
        if current.version != proposal.base_version:
            raise _NotApplicable(
                f"stale: the proposal was made against version {proposal.base_version} of {proposal.agent_id!r}'s workflow, "
                f"which is now at version {current.version}; materialise workflow_proposals again"
            )
        outside = [op.get("path") for op in proposal.patch if not str(op.get("path", "")).startswith(PATCHABLE + "/")]
        if outside:
            raise _NotApplicable(f"the patch touches {outside}; a proposal may change only {PATCHABLE}")
        try:
            return WorkflowDefinition.model_validate(jsonpatch.apply_patch(current.document(), proposal.patch))
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as error:
            raise _NotApplicable(f"the patch does not apply to version {current.version}: {error}") from None
        except ValidationError as error:
            raise _NotApplicable(f"the patched workflow is not valid: {error.errors()[0]['msg']}") from None

    def check(self, proposal_id: str) -> str | None:
        """Why approving ``proposal_id`` now would be refused, or ``None`` if it would apply.
        Writes nothing.

        Raises:
            ProposalNotFound: no such proposal.
        """
        proposal = self.get(proposal_id)
        try:
            self._patched(proposal, self.store.current(proposal.agent_id))
        except _NotApplicable as refusal:
            return refusal.reason
        return None

    def approve(self, proposal_id: str, by: str, reason: str | None = None) -> tuple[Proposal, WorkflowDefinition]:
        """Apply the proposal's patch to its agent's current definition as a new version (the
        previous one is kept) and mark the proposal ``applied``.

        Returns:
            ``(the applied proposal, the new definition)``.

        Raises:
            ProposalNotFound: no such proposal.
            ReviewRefused: the proposal is not open; the agent has no definition; the definition
                is no longer at the proposal's base version; the patch fails (a ``test`` operation,
                a path that does not exist) or would leave an invalid definition or touch anything
                outside ``/steps``. All but the first mark the proposal ``stale``.
        """
        with self.store.locked():
            proposal = self.get(proposal_id)
            current = self.store.current(proposal.agent_id)
            if proposal.status == "open" and current is not None and current.change is not None and current.change.proposal_id == proposal.id:
                # a crash after the definition was saved and before the proposal was marked
                return self._applied(proposal, current, by, current.change.at, reason), current
            try:
                changed = self._patched(proposal, current)
            except _NotApplicable as refusal:
                raise self._refuse(proposal, by, refusal.reason, refusal.stale) from None
            note = f"approved proposal {proposal.id} ({proposal.rule}): {proposal.summary}" + (f"; {reason}" if reason else "")
            saved = self.store.save(changed, by=by, reason=note, base_version=current.version, proposal_id=proposal.id)
            return self._applied(proposal, saved, by, saved.change.at, reason), saved

    def _applied(self, proposal: Proposal, saved: WorkflowDefinition, by: str, at: str, reason: str | None) -> Proposal:
        review = Review(action="approve", by=by, at=at, reason=reason, new_version=saved.version)
        applied = proposal.model_copy(update={"status": "applied", "review": review})
        self._save(applied)
        self._append("approve", proposal, by, at, reason=reason, new_version=saved.version, patch=proposal.patch)
        return applied

    def reject(self, proposal_id: str, by: str, reason: str) -> Proposal:
        """Mark an open (or stale) proposal ``rejected`` with who and why; the definition is untouched.

        Raises:
            ProposalNotFound: no such proposal.
            ReviewRefused: ``reason`` is empty, or the proposal was already applied, rejected or superseded.
        """
        with self.store.locked():
            proposal = self.get(proposal_id)
            if not reason or not reason.strip():
                raise self._refuse(proposal, by, "a rejection needs a reason", stale=False)
            if proposal.status not in ("open", "stale"):
                raise self._refuse(proposal, by, f"proposal {proposal.id} is {proposal.status}; only an open or stale one can be rejected", stale=False)
            at = utc_now()
            rejected = proposal.model_copy(update={"status": "rejected", "review": Review(action="reject", by=by, at=at, reason=reason)})
            self._save(rejected)
            self._append("reject", proposal, by, at, reason=reason)
            return rejected
