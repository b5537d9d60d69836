"""The workflow directory: agents' workflow definitions, the proposals made against them and
the audit log of their review (``flow_assets/workflows``, ``docs/workflows.md``)."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.workflows.definition import DEFAULT_ROOT, WorkflowStore
from flow_assets.workflows.review import ProposalBoard


class WorkflowDirectory(ConfigurableResource):
    """Where workflow definitions and proposals live (``FLOWOPT_WORKFLOWS``, default ``.workflows``).

    Attributes:
        root: the directory; created on the first write.
    """

    root: str = Field(default=DEFAULT_ROOT, description="Directory of workflow definitions, proposals and the review audit log.")

    def store(self) -> WorkflowStore:
        """The versioned definitions of :attr:`root`."""
        return WorkflowStore(self.root)

    def board(self) -> ProposalBoard:
        """The proposals of :attr:`root` and their review."""
        return ProposalBoard(self.store())
