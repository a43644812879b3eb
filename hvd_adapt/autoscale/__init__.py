"""Goodput autoscaling: :mod:`.profile` (the step-time profile), :mod:`.policy` (the
policy that picks a batch size), :mod:`.memory` (the largest atomic batch that fits) and
:mod:`.controller` (what a loader and an optimizer share)."""
