-- The id of the queued write that made the row: a write taken over from a dead replica's
-- spool may have reached the database already, and is then not stored twice.
ALTER TABLE audit_log ADD COLUMN write_id TEXT UNIQUE;
ALTER TABLE scaling_events ADD COLUMN write_id TEXT UNIQUE;
