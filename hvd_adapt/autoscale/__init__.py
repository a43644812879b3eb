"""Goodput autoscaling: the step-time profile, the policy that picks a batch size,
and the controller a loader and an optimizer share (see each module)."""
