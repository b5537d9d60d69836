"""A person's review of workflow proposals: approve (the patch is applied as a new version) or
reject, every decision kept in an append-only audit log.

Files, beside the definitions of :class:`~flow_assets.workflows.definition.WorkflowStore`::

    <root>/proposals/<id>.json    one proposal, its status and its review
    <root>/audit.jsonl            one JSON object per line, never rewritten: proposed, superseded,
                                  approve, reject, refuse; each line carries the sha256 of the
                                  line before it (``prev``), so an edited or deleted line shows
    <root>/audit.head             the number of lines and the sha256 of the last one, rewritten
                                  (atomically) after each append: a deleted tail or an edit of
                                  the last line shows

Each decision's review in its proposal file keeps the sha256 of the audit line that records it
(``Review.audit_sha256``). That line's hash covers, through ``prev``, every line before it, so
a log edited and then re-chained from scratch (head file included) no longer holds the lines
the proposals point to: :meth:`ProposalBoard.verify_audit` (``flowopt proposals verify``)
checks the chain, the head and these anchors. A decision is final: once the log records an
approval, rejection or supersession of a proposal, no one can decide it again, whatever its
proposal file says (a file edited back to ``open`` is restored from the log).

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

#: audit actions that decide a proposal for good -> the status they give it
FINAL_ACTIONS = {"approve": "applied", "reject": "rejected", "superseded": "superseded"}
#: the review action each final audit action is stored as in the proposal file
_REVIEW_ACTION = {"approve": "approve", "reject": "reject", "superseded": "supersede"}
_REVIEW_ACTION_TEXT = {"approve": "approval", "reject": "rejection", "supersede": "supersession"}

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

    @property
    def head_path(self) -> Path:
        """The audit log's head: ``{"lines": n, "sha256": <hex sha256 of line n>}``."""
        return self.store.root / "audit.head"

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
        """Every audit log entry, in order (a line that is not a JSON object is skipped;
        :meth:`verify_audit` reports it).

        Raises:
            OSError: the log exists but cannot be read.
        """
        return [entry for _, entry, _ in self._audit_lines() if entry is not None]

    def _audit_lines(self) -> list[tuple[bytes, dict[str, Any] | None, str]]:
        """``(raw line, entry or None when not a JSON object, why not)`` for each line of the log."""
        if not self.audit_path.exists():
            return []
        out: list[tuple[bytes, dict[str, Any] | None, str]] = []
        for line in self.audit_path.read_bytes().split(b"\n"):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as error:  # UnicodeDecodeError included
                out.append((line, None, f"not JSON ({error})"))
                continue
            out.append((line, entry, "") if isinstance(entry, dict) else (line, None, f"a JSON {type(entry).__name__}, not an object"))
        return out

    def verify_audit(self) -> list[str]:
        """Problems of the audit log, first bad line first; an empty list means it is intact.

        Checked: every line is a JSON object whose ``prev`` is the sha256 of the line before it
        (empty for the first) and ends with a line end; the head file (:attr:`head_path`) names
        a line of the log with the same sha256 (an edited last line, a deleted tail); every
        proposal file has its ``proposed`` line with the same patch, and each decision in a
        proposal file (approve, reject, supersede) is the log line whose sha256 it keeps (a
        chain recomputed after an edit); every final decision in the log matches its proposal's
        status. Each problem is one line naming the file and, where there is one, the line.
        """
        found: list[tuple[int, str]] = []  # (line number or a large number, text), sorted at the end
        log = self.audit_path
        nowhere = 1 << 62

        def problem(number: int | None, text: str) -> None:
            found.append((number if number is not None else nowhere, f"{log}, line {number}: {text}" if number else text))

        raw = log.read_bytes() if log.exists() else b""
        lines = raw.split(b"\n")
        if raw and not raw.endswith(b"\n"):
            problem(len(lines), "no line end: a torn write, or the log was cut")
        if raw.endswith(b"\n"):
            lines.pop()
        prev = ""
        hashes: dict[str, int] = {}
        entries: list[tuple[int, dict[str, Any]]] = []
        for number, line in enumerate(lines, start=1):
            digest = hashlib.sha256(line).hexdigest()
            hashes.setdefault(digest, number)
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict):
                    raise ValueError(f"a JSON {type(entry).__name__}, not an object")
            except ValueError as error:
                problem(number, f"not a JSON object ({error})")
                entry = None
            if entry is not None:
                entries.append((number, entry))
                if entry.get("prev") != prev:
                    problem(number, f"prev does not match the sha256 of line {number - 1}" if number > 1 else "the first line's prev is not empty")
            prev = digest
        self._verify_head(lines, problem)
        self._verify_anchors(entries, hashes, problem)
        return [text for _, text in sorted(found, key=lambda item: item[0])]

    def _verify_head(self, lines: list[bytes], problem) -> None:
        head = self.head_path
        if not head.exists():
            if lines:
                problem(None, f"{head}: missing: the log's tail cannot be checked (a deleted tail or an edited last line would not show)")
            return
        try:
            recorded = json.loads(head.read_bytes())
            count, digest = int(recorded["lines"]), str(recorded["sha256"])
        except (ValueError, TypeError, KeyError) as error:
            problem(None, f"{head}: not an audit head ({error!r}); expected {{\"lines\": n, \"sha256\": hex}}")
            return
        if count > len(lines):
            problem(len(lines) + 1, f"missing: {head} records {count} lines, the log has {len(lines)} (its tail was deleted)")
        elif count and hashlib.sha256(lines[count - 1]).hexdigest() != digest:
            problem(count, f"differs from the sha256 {digest[:12]}... that {head} keeps for it (the line was edited)")

    def _verify_anchors(self, entries: list[tuple[int, dict[str, Any]]], hashes: dict[str, int], problem) -> None:
        proposals: dict[str, tuple[Path, Proposal]] = {}
        files = sorted(self.proposals_dir.glob("wp-*.json")) if self.proposals_dir.is_dir() else []
        for path in files:
            try:
                proposal = Proposal.model_validate_json(path.read_bytes())
            except (OSError, ValidationError) as error:
                problem(None, f"{path}: not a readable proposal ({str(error).splitlines()[0]})")
                continue
            proposals[proposal.id] = (path, proposal)
        proposed = {e.get("proposal_id"): (n, e) for n, e in entries if e.get("action") == "proposed"}
        for pid, (path, proposal) in proposals.items():
            if pid not in proposed:
                problem(None, f"{path}: the log has no 'proposed' line for {pid}")
            else:
                number, entry = proposed[pid]
                fields = ("agent_id", "base_version", "rule", "patch")
                if any(entry.get(f) != getattr(proposal, f) for f in fields):
                    problem(number, f"the 'proposed' line of {pid} differs from {path} in {', '.join(f for f in fields if entry.get(f) != getattr(proposal, f))}")
            review = proposal.review
            if review is None or review.action == "refuse":
                continue
            action = {v: k for k, v in _REVIEW_ACTION.items()}[review.action]
            matching = [(n, e) for n, e in entries if e.get("action") == action and e.get("proposal_id") == pid]
            if review.audit_sha256:
                if review.audit_sha256 not in hashes:
                    where = matching[-1][0] if matching else None
                    problem(where, f"{path} keeps sha256 {review.audit_sha256[:12]}... for its {action} by {review.by} at {review.at}, "
                                   "and the log holds no such line (edited, removed, or the chain recomputed)")  # fmt: skip
            elif not any(e.get("by") == review.by and e.get("at") == review.at for _, e in matching):
                problem(None, f"{path}: its {action} by {review.by} at {review.at} is not in the log")
        for number, entry in entries:
            status = FINAL_ACTIONS.get(entry.get("action"))
            if status is None:
                continue
            pid = entry.get("proposal_id")
            if pid not in proposals:
                problem(number, f"records the {entry['action']} of {pid}, whose proposal file is missing")
            elif proposals[pid][1].status != status:
                problem(number, f"records the {entry['action']} of {pid}, whose proposal file says {proposals[pid][1].status}")

    def _decision(self, proposal_id: str) -> tuple[int, dict[str, Any], str] | None:
        """The log's final decision on ``proposal_id``: ``(line number, entry, sha256 of the line)``."""
        found = None
        for number, (line, entry, _) in enumerate(self._audit_lines(), start=1):
            if entry is not None and entry.get("proposal_id") == proposal_id and entry.get("action") in FINAL_ACTIONS:
                found = found or (number, entry, hashlib.sha256(line).hexdigest())
        return found

    def _restore_decided(self, proposal: Proposal) -> Proposal:
        """``proposal`` as the log's final decision on it left it; saved again if its file says
        otherwise (a crash between the log line and the file, or a file edited back to open)."""
        decision = self._decision(proposal.id)
        if decision is None:
            return proposal
        _, entry, digest = decision
        status = FINAL_ACTIONS[entry["action"]]
        if proposal.status == status and proposal.review is not None and proposal.review.audit_sha256 in (None, digest):
            return proposal
        review = Review(action=_REVIEW_ACTION[entry["action"]], by=str(entry.get("by")), at=str(entry.get("at")),
                        reason=entry.get("reason"), new_version=entry.get("new_version"), audit_sha256=digest)  # fmt: skip
        restored = proposal.model_copy(update={"status": status, "review": review})
        self._save(restored)
        return restored

    # -- writing ----------------------------------------------------------------------------
    def _append(self, action: str, proposal: Proposal, by: str, at: str, **fields: Any) -> str:
        """Append one entry and move the head to it; returns the hex sha256 of the line written."""
        lines = self.audit_path.read_bytes().splitlines() if self.audit_path.exists() else []
        prev = hashlib.sha256(lines[-1]).hexdigest() if lines else ""
        entry = {"at": at, "action": action, "proposal_id": proposal.id, "agent_id": proposal.agent_id, "by": by,
                 "base_version": proposal.base_version, "rule": proposal.rule, **fields, "prev": prev}  # fmt: skip
        line = json.dumps(entry, ensure_ascii=False, sort_keys=True).encode()
        self.audit_path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: bytes already written are never touched, whatever happens to this write
        with open(self.audit_path, "ab") as fh:
            fh.write(line + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        digest = hashlib.sha256(line).hexdigest()
        # a crash before this leaves a head one line behind: still a line of the log, so verify
        # passes, and the next append moves it on
        write_json_atomic(self.head_path, {"lines": len(lines) + 1, "sha256": digest})
        return digest

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
                    # the log line first: a crash before the file is saved is repaired from the log
                    digest = self._append("superseded", old, by, at, reason=reason)
                    review = Review(action="supersede", by=by, at=at, reason=reason, audit_sha256=digest)
                    self._save(old.model_copy(update={"status": "superseded", "review": review}))
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
            proposal = self._final(self.get(proposal_id), by)
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
        digest = self._append("approve", proposal, by, at, reason=reason, new_version=saved.version, patch=proposal.patch)
        review = Review(action="approve", by=by, at=at, reason=reason, new_version=saved.version, audit_sha256=digest)
        applied = proposal.model_copy(update={"status": "applied", "review": review})
        self._save(applied)
        return applied

    def reject(self, proposal_id: str, by: str, reason: str) -> Proposal:
        """Mark an open (or stale) proposal ``rejected`` with who and why; the definition is untouched.

        Raises:
            ProposalNotFound: no such proposal.
            ReviewRefused: ``reason`` is empty, or the proposal was already applied, rejected or superseded.
        """
        with self.store.locked():
            proposal = self._final(self.get(proposal_id), by)
            if not reason or not reason.strip():
                raise self._refuse(proposal, by, "a rejection needs a reason", stale=False)
            if proposal.status not in ("open", "stale"):
                raise self._refuse(proposal, by, f"proposal {proposal.id} is {proposal.status}; only an open or stale one can be rejected", stale=False)
            at = utc_now()
            digest = self._append("reject", proposal, by, at, reason=reason)
            review = Review(action="reject", by=by, at=at, reason=reason, audit_sha256=digest)
            rejected = proposal.model_copy(update={"status": "rejected", "review": review})
            self._save(rejected)
            return rejected

    def _final(self, proposal: Proposal, by: str) -> Proposal:
        """``proposal``, or a refusal when the log records a final decision on it that its file
        no longer shows (the file is restored from the log first).

        Raises:
            ReviewRefused: the log decided it already; the refusal is logged too.
        """
        restored = self._restore_decided(proposal)
        if restored.status == proposal.status:
            return proposal
        review = restored.review
        reason = (f"proposal {proposal.id} is {restored.status}, not {proposal.status}: the audit log records its "
                  f"{_REVIEW_ACTION_TEXT[review.action]} by {review.by} at {review.at}; a decision is final "
                  f"(its proposal file said {proposal.status} and was restored from the log)")  # fmt: skip
        raise self._refuse(restored, by, reason, stale=False)
