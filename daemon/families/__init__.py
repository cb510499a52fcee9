"""Uprobe probe families as the agent runs them: attach in the background, per-process tracking."""
