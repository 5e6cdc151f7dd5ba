"""Tools around training: the dry-run planner, reports and plots, the capacity advisor, the supervisor."""
