"""Following other writers' segments of a shared directory: what they hold, and reading it."""
