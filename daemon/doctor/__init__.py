"""`kvwatch doctor`: prerequisites, then a canary per probe."""
