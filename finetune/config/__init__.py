"""The run's configuration: the registry of problem types and metrics (`tasks`), the typed schema that is the only home
of defaults (`schema`), config files in and out with dotted overrides and every problem reported at once (`files`),
and docs/CONFIG.md and configs/schema.json generated from the schema (`docs`). May import `core` only.
"""
