"""Checkpoint locations as the agent sees them: which are local paths, and which a rank may
report as its job's (the next attempt resumes from it, mounts it and owns it)."""

from __future__ import annotations

import os


def local_path(uri: str | None) -> str | None:
    """The local path a checkpoint location names (``file://`` or absolute), else None."""
    if not uri:
        return None
    if uri.startswith("file://"):
        return uri[len("file://") :]
    if uri.startswith("/"):
        return uri
    return None


def checkpoint_within(uri: str, checkpoint_dir: str | None) -> bool:
    """Whether a checkpoint a rank reports is its job's to resume from: a local one must lie
    inside the job's checkpoint dir (a rank must not steer the next attempt's mounts and
    ownership to the agent's state or the host's files); a remote one is the job's business."""
    path = local_path(uri)
    if path is None:
        return "://" in uri  # s3://, gs://, ...: no local effect
    root = local_path(checkpoint_dir)
    if root is None:
        return False
    path, root = os.path.normpath(path), os.path.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")
