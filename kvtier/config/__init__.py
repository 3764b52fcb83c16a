"""Settings: every key typed and checked once, from defaults, a file, the environment and a mapping."""
