-- How a failed job step failed (retryable, refused, broken), kept beside its message so a
-- resumed runner and the API see the same. Kept in step with migrations/sqlite.
ALTER TABLE job_steps ADD COLUMN error_kind TEXT;
