"""The event log: the event schema (events, ids) and the stores that keep it."""
