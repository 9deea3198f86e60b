"""A plan file read back: its model rebuilt and checked against it (load/checked_plan.py), the one place every
command that reads a plan goes through."""
