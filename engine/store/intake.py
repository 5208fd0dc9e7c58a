"""What a customer sends us and what we remind them of: intake forms, reminders sent."""


class IntakeStore:
    """Intake and reminders, in the caller's transaction."""
