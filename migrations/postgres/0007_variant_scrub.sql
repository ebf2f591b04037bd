-- A variant's scrub pipeline (JSON list of steps); NULL = the agent's default for the
-- device's class. Kept in step with migrations/sqlite.
ALTER TABLE variants ADD COLUMN scrub TEXT;
