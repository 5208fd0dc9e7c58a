"""The reconciliation with the workflow system: its runs, and the changes it finds."""


class ReconcileStore:
    """The reconciliation with the workflow system, in the caller's transaction."""
